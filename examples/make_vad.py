"""Write examples/vad_tiny.onnx: a Silero-VAD-like model with control flow.

    .venv-torch/bin/python examples/make_vad.py [--out examples]

An ``If`` on the sample-rate input picks the front end (a strided Conv1d "STFT" for 16 kHz or
8 kHz), Conv+BatchNorm+ReLU encoder, then a ``Loop`` runs an LSTM cell over the frames with the
state (h, c) as inputs and outputs, like Silero VAD.  TorchScript exporter of a scripted module
(dynamo=False), opset 17, seeded random weights and BatchNorm statistics, dynamic batch and
sample count.  The export writes the LSTM weights as Slice/Concat of constants *inside* the Loop
body, recomputed every frame: what graphopt's folding inside bodies removes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn


class TinyVAD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stft16 = nn.Conv1d(1, 34, 64, stride=32, bias=False)
        self.stft8 = nn.Conv1d(1, 34, 32, stride=16, bias=False)
        self.enc = nn.Sequential(
            nn.Conv1d(34, 32, 3, padding=1),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1),
            nn.BatchNorm1d(32),
            nn.ReLU(),
        )
        self.cell = nn.LSTMCell(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, sr: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        x = x.unsqueeze(1)
        if bool(sr == 16000):
            f = self.stft16(x)
        else:
            f = self.stft8(x)
        f = self.enc(torch.abs(f))
        outs = []
        for t in range(f.size(2)):
            h, c = self.cell(f[:, :, t], (h, c))
            outs.append(torch.sigmoid(self.head(h)))
        return torch.stack(outs, 1).squeeze(2), h, c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyVAD().eval()
    with torch.no_grad():
        for bn in (model.enc[1], model.enc[4]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    x, h, c = torch.randn(2, 512), torch.zeros(2, 32), torch.zeros(2, 32)
    path = args.out / "vad_tiny.onnx"
    torch.onnx.export(
        torch.jit.script(model),
        (x, torch.tensor(16000), h, c),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["audio", "sr", "h", "c"],
        output_names=["prob", "hn", "cn"],
        dynamic_axes={
            "audio": {0: "batch", 1: "samples"},
            "h": {0: "batch"},
            "c": {0: "batch"},
            "prob": {0: "batch", 1: "frames"},
            "hn": {0: "batch"},
            "cn": {0: "batch"},
        },
    )
    onnx.checker.check_model(onnx.load(str(path)))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sr in (16000, 8000):
        feed = {"audio": x.numpy(), "sr": np.array(sr), "h": h.numpy(), "c": c.numpy()}
        with torch.no_grad():
            ref = model(x, torch.tensor(sr), h, c)
        err = max(float(np.abs(o - r.numpy()).max()) for o, r in zip(sess.run(None, feed), ref))
        print(f"sr={sr}: max |onnxruntime - torch| = {err:.1e}")
        assert err < 1e-5, err
    (args.out / "vad_tiny.json").write_text(
        '{\n  "inputs": {"audio": [1, 16000], "sr": [], "h": [1, 32], "c": [1, 32]}\n}\n'
    )
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
