"""A small ModernBERT encoder exported with its rotary embeddings (not committed).

    python examples/make_rotary_encoders.py --out models/rotary [--layers 4] [--static 128]

Needs torch and transformers (measured with torch 2.13, transformers 5.24).  The model is
transformers' ModernBertModel built from a small config (hidden 256, 4 heads of 64, global
attention every third layer with RoPE theta 160000, the others local with theta 10000, seeded
random weights; nothing is downloaded), exported with the TorchScript exporter (opset 17;
``--dynamo``: torch.export, opset 18):
``input_ids``, ``attention_mask`` (batch, sequence) -> ``last_hidden_state``.  The positions are
``arange(sequence)`` computed inside the graph, so every layer gathers its rows of cos/sin
from tables of ``max_position_embeddings`` rows.  ``--static S`` fixes batch 1 and the
sequence to S (no dynamic axes) and writes ``modernbert_s{S}.onnx``; else both dims are
dynamic (``modernbert.onnx``).  Each export is compared with torch (relative L2 <= 1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import onnxruntime as ort
import torch
from export_utils import quiet_warnings, rel_l2, seed_all
from torch import nn

TOLERANCE = 1e-4


class Encoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def build(layers: int) -> nn.Module:
    from transformers import ModernBertConfig, ModernBertModel

    cfg = ModernBertConfig(
        vocab_size=8192,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=8192,
        attn_implementation="eager",
    )
    return ModernBertModel(cfg).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--static", type=int, default=0, help="batch 1, this sequence length")
    ap.add_argument(
        "--dynamo",
        action="store_true",
        help="the torch.export exporter (opset 18), written as NAME_dynamo.onnx",
    )
    args = ap.parse_args()
    quiet_warnings()
    seed_all(0)
    torch.set_num_threads(1)
    net = Encoder(build(args.layers))
    seq = args.static or 16
    batch = 1 if args.static else 2
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    os.makedirs(args.out, exist_ok=True)
    name = f"modernbert_s{args.static}" if args.static else "modernbert"
    name += "_dynamo" if args.dynamo else ""
    path = os.path.join(args.out, f"{name}.onnx")
    axes = None
    if not args.static:
        axes = {n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask")}
        axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            net,
            (ids, mask),
            path,
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes=axes,
            opset_version=18 if args.dynamo else 17,
            dynamo=args.dynamo,
        )
        # another batch of the same shape (static) or another shape (dynamic)
        if not args.static:
            batch, seq = 3, 40
        ids = torch.randint(0, 8192, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        want = net(ids, mask).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    err = rel_l2(got, want)
    print(json.dumps({"name": name, "path": path, "rel_l2": err, "ok": bool(err <= TOLERANCE)}))
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"inputs": {"input_ids": [batch, seq], "attention_mask": [batch, seq]}}, f)
        f.write("\n")
    return 0 if err <= TOLERANCE and np.isfinite(got).all() else 1


if __name__ == "__main__":
    sys.exit(main())
