#!/usr/bin/env python3
"""Per decoder: what `graphopt optimize -O2` fuses, parity and the generation check.

    python examples/llm/llm_table.py MODELS_DIR [--work DIR]

For every NAME.onnx with a NAME.json sidecar in MODELS_DIR (as `examples/make_llms.py` writes
them), run `graphopt optimize` with the sidecar's shapes three ways: `--target cpu`,
`--target cuda` and `--target cpu --decoder-steps generate`, and print one markdown row each
from the bundle's report.json: the com.microsoft attention, rotary and skip-norm nodes, parity,
the generation check (verdict, same greedy tokens, largest logits difference), nodes before →
after and graphopt's exit code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

OPS = [
    "MultiHeadAttention",
    "GroupQueryAttention",
    "RotaryEmbedding",
    "SkipSimplifiedLayerNormalization",
]
SHAPED = ("input_ids", "attention_mask", "position_ids", "past_key_values.0.key")
RUNS = {
    "cpu": ["--target", "cpu"],
    "cuda": ["--target", "cuda"],
    "cpu --decoder-steps generate": ["--target", "cpu", "--decoder-steps", "generate"],
}


def shape_flags(sidecar: Path) -> list[str]:
    shapes = json.loads(sidecar.read_text())["inputs"]
    flags: list[str] = []
    for name in SHAPED:
        if name in shapes:
            flags += ["--shape", f"{name}={','.join(map(str, shapes[name]))}"]
    return flags


def generation_cell(gen: dict | None) -> str:
    if not gen:
        return "—"
    steps = gen.get("per_step", [])
    same = sum(s["same_token"] for s in steps)
    return f"{gen.get('verdict')}, {same}/{len(steps)} tokens, max abs {gen.get('max_abs', 0):.1e}"


def row(model: Path, label: str, flags: list[str], work: Path) -> str:
    out = work / f"{model.stem}-{label.replace(' ', '_')}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["graphopt", "optimize", str(model), "-O2", "-o", str(out), "--no-measure", "-q"]
    done = subprocess.run(cmd + flags, capture_output=True, text=True)
    try:
        rep = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        why = done.stderr.strip()[-120:].replace("|", "/")
        return (
            f"| {model.stem} | {label} |" + " |" * (len(OPS) + 3) + f" {done.returncode}: {why} |"
        )
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ops = rep["ops_after"]
    counts = " | ".join(str(ops.get(f"com.microsoft.{o}", 0)) for o in OPS)
    parity = rep["parity"]
    par = "ok" if parity.get("ok") else ("FAILED" if parity.get("ran") else "not run")
    nodes = f"{rep['nodes_before']} → {rep['nodes_after']}"
    gen = generation_cell(rep.get("generation"))
    return f"| {model.stem} | {label} | {counts} | {par} | {gen} | {nodes} | {done.returncode} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "graphopt-llm")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    models = [p for p in sorted(args.models_dir.glob("*.onnx")) if p.with_suffix(".json").exists()]
    print("| model | run | " + " | ".join(OPS) + " | parity | generation | nodes | exit |")
    print("|---|---|" + "---|" * (len(OPS) + 4))
    for model in models:
        flags = shape_flags(model.with_suffix(".json"))
        for label, target in RUNS.items():
            print(row(model, label, flags + target, args.work), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
