"""Wall time and peak RSS of graphopt on a large external-data model against onnxruntime's
offline optimizer, interleaved in one run (each tool in a fresh process, its output deleted as
soon as measured, so that at most one optimized copy is on disk).

    python examples/large/make_gpt_decoder.py --out gpt_big/model.onnx
    python examples/large/bench_large.py gpt_big/model.onnx --shape input_ids=1,16 --rounds 2

Prints one markdown table (median wall, largest peak RSS per tool) and writes the raw numbers
as JSON with ``--json``.  Peak RSS is the process's own (``wait4``), file-backed mapped pages
included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import onnx

HERE = Path(__file__).resolve().parent


def largest_tensor(model: Path) -> tuple[int, int]:
    """(bytes of the largest initializer, bytes of all), from metadata only."""
    from graphopt.opt.graph.io import tensor_nbytes

    proto = onnx.load_model(str(model), load_external_data=False)
    sizes = [tensor_nbytes(t) for t in proto.graph.initializer]
    return max(sizes), sum(sizes)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run ``cmd``; its wall time, peak RSS (MB) and exit status."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "wall_s": round(time.perf_counter() - start, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024),
        "rc": proc.returncode,
        "tail": out.decode(errors="replace").strip().splitlines()[-3:],
    }


def tools(model: Path, work: Path, shapes: list[str]) -> dict[str, tuple[list[str], Path]]:
    """name -> (command, output to delete after it)."""
    shape_args = [a for s in shapes for a in ("--shape", s)]
    ort_out = work / "ort_offline"
    bundle = work / "bundle"
    cli = shutil.which("graphopt", path=str(Path(sys.executable).parent)) or "graphopt"
    graphopt = [cli, "optimize", str(model), "-o", str(bundle)]
    graphopt += ["--target", "cpu", "-O", "2", "--quiet"]
    return {
        "onnxruntime offline (EXTENDED)": (
            [sys.executable, str(HERE / "ort_offline.py"), str(model), str(ort_out / "model.onnx")],
            ort_out,
        ),
        "graphopt --no-check": (graphopt + ["--no-check"], bundle),
        "graphopt (default: parity + safety net)": (graphopt + shape_args, bundle),
    }


def model_bytes(output: Path) -> int:
    """Bytes of the written model: ``model.onnx`` and its external data (``model.onnx.data``)."""
    return sum(p.stat().st_size for p in output.glob("model.onnx*") if p.is_file())


def report_seconds(bundle: Path) -> dict | None:
    try:
        report = json.loads((bundle / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return {
        "seconds": report.get("seconds"),
        "parity_ok": report["parity"].get("ok"),
        "pieces": report["parity"].get("pieces"),
        "performance_why": report.get("performance", {}).get("why"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--shape", action="append", default=[], help="parity input shape NAME=D0,..")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, help="where outputs go (default: beside the model)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = args.work or args.model.parent.with_name(args.model.parent.name + ".bench")
    work.mkdir(parents=True, exist_ok=True)
    largest, total = largest_tensor(args.model)
    size = sum(p.stat().st_size for p in args.model.parent.glob(args.model.stem + ".*"))
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, (cmd, output) in tools(args.model, work, args.shape).items():
            result = timed(cmd)
            result["report"] = report_seconds(output)
            result["output_mb"] = round(model_bytes(output) / 1e6)
            runs.setdefault(name, []).append(result)
            shutil.rmtree(output, ignore_errors=True)
            print(
                f"{name}: {result['wall_s']} s, {result['peak_rss_mb']} MB, "
                f"output {result['output_mb']} MB, rc {result['rc']}",
                file=sys.stderr,
                flush=True,
            )
    shutil.rmtree(work, ignore_errors=True)
    bound = 2 * largest / 1e6 + 300
    print(
        f"model: {total / 2**30:.2f} GiB of weights, largest tensor {largest / 1e6:.0f} MB; "
        f"bound 2 x largest + 300 MB = {bound:.0f} MB; input {size / 1e6:.0f} MB on disk; "
        f"{args.rounds} interleaved round(s)\n"
    )
    print("| tool | wall s (median) | peak RSS MB (max) | output MB | exit |")
    print("|---|---|---|---|---|")
    for name, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        rss = max(r["peak_rss_mb"] for r in results)
        codes = ",".join(str(r["rc"]) for r in results)
        out_mb = max(r["output_mb"] for r in results)
        print(f"| {name} | {wall:.1f} | {rss} | {out_mb} | {codes} |")
    if args.json:
        args.json.write_text(
            json.dumps({"largest_bytes": largest, "weights_bytes": total, "runs": runs}, indent=2)
        )


if __name__ == "__main__":
    main()
