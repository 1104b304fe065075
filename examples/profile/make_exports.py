"""Export the CNN and the detector that ``profile_table.py`` profiles (not committed).

    /path/to/export-venv/bin/python examples/profile/make_exports.py --out DIR [--only resnet18]

torchvision's resnet18 (input [1, 3, 224, 224]) and ssdlite320_mobilenet_v3_large (input
[1, 3, 320, 320]; boxes, scores and labels out, its NMS and top-k inside the graph), seeded
random weights (nothing is downloaded), TorchScript exporter, opset 17.  Writes DIR/NAME.onnx and
DIR/NAME.json = {"inputs": {name: shape}}.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torchvision


class Detections(torch.nn.Module):
    """torchvision's detector in eval mode, one image in, the first image's detections out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image):
        out = self.model([image[0]])[0]
        return out["boxes"], out["scores"], out["labels"]


def resnet18():
    return torchvision.models.resnet18(weights=None).eval(), [1, 3, 224, 224], ["logits"]


def ssdlite():
    model = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None
    ).eval()
    return Detections(model), [1, 3, 320, 320], ["boxes", "scores", "labels"]


MODELS = {"resnet18": resnet18, "ssdlite": ssdlite}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated names (default: all)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    for name in names:
        torch.manual_seed(0)
        module, shape, outputs = MODELS[name]()
        with torch.no_grad():
            # a detector's random weights score few boxes: lower its threshold so NMS has work
            if name == "ssdlite":
                module.model.score_thresh = 0.0
            path = os.path.join(args.out, f"{name}.onnx")
            torch.onnx.export(
                module,
                (torch.rand(*shape),),
                path,
                input_names=["input"],
                output_names=outputs,
                opset_version=17,
                dynamo=False,
            )
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump({"inputs": {"input": shape}}, f)
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
