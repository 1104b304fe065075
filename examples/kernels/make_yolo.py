"""Build Ultralytics YOLO detection models and export them to ONNX, fully offline.

Each model is built from the architecture YAML bundled in the ultralytics package
(yolov8n, yolo11n, yolov5nu by default). The weights are RANDOM (ultralytics' own
init under torch.manual_seed(0)): no .pt is loaded and nothing is downloaded, so the
graphs are real YOLO graphs but the detections are meaningless.

For each model this writes DIR/<name>.onnx (opset 17, TorchScript exporter, no
simplifier, static batch 1, float input "images" of shape 1x3xSxS, output "output0")
and DIR/<name>.json: {"inputs": {"images": [1, 3, S, S]}}.

Usage (needs torch, ultralytics and onnx):
    python examples/kernels/make_yolo.py --out DIR [--imgsz 640] [--models yolov8n ...]
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--imgsz", type=int, default=640, help="square input size")
    ap.add_argument("--models", nargs="+", default=["yolov8n", "yolo11n", "yolov5nu"])
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        # Set before ultralytics is imported: YOLO_OFFLINE makes is_online() False, which gates
        # analytics, update checks and asset/font downloads; YOLO_AUTOINSTALL=0 stops pip
        # installs; a throwaway config dir keeps settings.json out of the user's ~/.config.
        os.environ["YOLO_OFFLINE"] = "1"
        os.environ["YOLO_AUTOINSTALL"] = "0"
        os.environ["YOLO_CONFIG_DIR"] = tmp
        import torch
        from ultralytics import YOLO
        from ultralytics.utils import SETTINGS

        SETTINGS.update(sync=False)
        os.chdir(tmp)  # the exporter writes <name>.onnx into the working directory

        for name in args.models:
            torch.manual_seed(0)
            model = YOLO(f"{name}.yaml")  # architecture only, random init
            f = model.export(
                format="onnx",
                opset=17,
                imgsz=args.imgsz,
                batch=1,
                dynamic=False,
                simplify=False,
                device="cpu",
            )  # nms left unset: raw (1, 84, anchors) output
            shutil.move(f, out / f"{name}.onnx")
            shape = [1, 3, args.imgsz, args.imgsz]
            (out / f"{name}.json").write_text(json.dumps({"inputs": {"images": shape}}) + "\n")
            print(f"wrote {out / name}.onnx")


if __name__ == "__main__":
    main()
