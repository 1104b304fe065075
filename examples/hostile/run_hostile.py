"""Run graphopt on hostile and careless inputs, one command per case, and print the evidence:
case, command, expected and actual exit code, the one line it said, wall time and peak RSS.

    python examples/hostile/run_hostile.py [--work DIR] [--only TEXT] [--json FILE]

Every case builds its own files under --work (default: a temporary folder, removed after), runs
`graphopt ...` in its own process (peak RSS is that process's own, from os.wait4; a case with a
memory cap runs under RLIMIT_AS, as `ulimit -v` sets it) and is judged: the documented exit code,
exactly one stderr line starting "error:" when it fails (no traceback, no "internal error"), and
what the case is about (a planted library's constructor never ran, a device node is still one,
a fold did not blow the model up).  The script exits 1 when a case does not hold.

Libraries planted in bundles are built here with gcc: their constructor writes a marker file, so
"refused" means their code never ran.  Device nodes are private copies of /dev/null made with
mknod (as root only); the real /dev is never aimed at.  The unreadable-input case runs as the
root without the capabilities that read any file (setpriv drops them from the bounding set).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

OPSETS = [helper.make_opsetid("", 17)]
#: the gated model's input and output
GATED_SHAPE = [1, 16, 256, 256]
#: the marker a planted library's constructor writes: it must never appear
MARK_ENV = "GRAPHOPT_HOSTILE_MARK"
EVIL_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("GRAPHOPT_HOSTILE_MARK");
    FILE *f = p ? fopen(p, "w") : NULL;
    if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
"""

# The command as the console script runs it; its own process reports its exit status, peak RSS
# and (with a cap) runs under RLIMIT_AS.
_RUNNER = r"""
import os, resource, signal, subprocess, sys, time, json
spec = json.loads(sys.argv[1])
def pre():
    if spec["cap_mb"]:
        b = spec["cap_mb"] << 20
        resource.setrlimit(resource.RLIMIT_AS, (b, b))
t0 = time.perf_counter()
p = subprocess.Popen(spec["argv"], stdout=open(spec["out"], "wb"), stderr=open(spec["err"], "wb"),
                     preexec_fn=pre, cwd=spec["cwd"], env=spec["env"])
if spec["sigint_after"] is not None:
    time.sleep(spec["sigint_after"]); p.send_signal(signal.SIGINT)
_, st, ru = os.wait4(p.pid, 0)
print(json.dumps({"status": st, "rss_kb": ru.ru_maxrss, "wall": time.perf_counter() - t0}))
"""

_CONSOLE = "import sys\n{before}\nfrom graphopt.cli import console\nsys.exit(console())\n"
#: SIGINT delivered while graphopt's own imports run (as onnx is first imported)
_SIGINT_DURING_IMPORTS = """import builtins, os, signal
_real = builtins.__import__
def _import(name, *args, **kw):
    if name == "onnx" and not getattr(builtins, "_sent", False):
        builtins._sent = True
        os.kill(os.getpid(), signal.SIGINT)
    return _real(name, *args, **kw)
builtins.__import__ = _import"""


@dataclass
class Case:
    name: str
    args: list[str]
    code: int
    #: a further check of what the case is about: None when it holds, else why not
    holds: Callable[[], str | None] | None = None
    cap_mb: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    without_dac: bool = False
    sigint_after: float | None = None
    before: str = ""


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def save(path: Path, nodes, inputs, outputs, inits=(), functions=(), opsets=OPSETS) -> Path:
    g = helper.make_graph(nodes, path.stem, inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=opsets, functions=list(functions))
    path.write_bytes(m.SerializeToString())
    return path


class World:
    """The files the cases act on, made once under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mark = root / "PLANTED_LIBRARY_RAN"
        self.relu = save(
            root / "relu.onnx",
            [helper.make_node("Relu", ["x"], ["y"])],
            [vi("x", ["N", 64])],
            [vi("y", ["N", 64])],
        )
        np.savez(root / "x.npz", x=np.ones((2, 64), np.float32))
        self.evil = root / "evil.so"
        src = root / "evil.c"
        src.write_text(EVIL_C)
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(self.evil), str(src)], check=True)

    def graphopt(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*console_argv(self.root), *args],
            capture_output=True,
            text=True,
            cwd=self.root,
            check=False,
            timeout=600,
        )

    def bundle(self, name: str, kernels: bool = False) -> Path:
        """A fresh bundle of the relu model (or, with ``kernels``, of a gated Conv whose
        element-wise tail becomes a generated kernel library)."""
        out = self.root / name
        if kernels:
            src = self.gated()
            flags = ["--kernels"]
        else:
            src, flags = self.relu, ["--no-kernels"]
        done = self.graphopt("optimize", str(src), "-o", str(out), "-q", "--no-measure", *flags)
        if done.returncode != 0:
            raise SystemExit(f"could not write the bundle {name}: {done.stderr.strip()}")
        return out

    def gated(self) -> Path:
        """An element-wise chain of eight cheap nodes (no transcendental) over 4 MiB: a
        generated kernel reads and writes it once where onnxruntime makes eight passes, so its
        speed gate passes."""
        rng = np.random.default_rng(0)
        inits = [
            const("s", rng.standard_normal((16, 1, 1))),
            const("t", rng.standard_normal((16, 1, 1))),
        ]
        ops = [
            ("Mul", ["x", "s"]),
            ("Add", ["v0", "t"]),
            ("Relu", ["v1"]),
            ("Mul", ["v2", "s"]),
            ("Add", ["v3", "x"]),
            ("Mul", ["v4", "t"]),
            ("Add", ["v5", "s"]),
            ("Relu", ["v6"]),
        ]
        nodes = [
            helper.make_node(op, ins, [f"v{i}" if i < 7 else "y"])
            for i, (op, ins) in enumerate(ops)
        ]
        shape = GATED_SHAPE
        return save(self.root / "gated.onnx", nodes, [vi("x", shape)], [vi("y", shape)], inits)


def console_argv(root: Path, before: str = "") -> list[str]:
    # the name the console script runs as: graphopt guards its imports only there
    script = root / ("bin" if not before else "bin-interrupted") / "graphopt"
    script.parent.mkdir(exist_ok=True)
    if not script.exists():
        script.write_text(_CONSOLE.format(before=before))
    return [sys.executable, str(script)]


def _config(b: Path, libs) -> None:
    p = b / "session_config.json"
    data = json.loads(p.read_text())
    data["custom_op_libraries"] = libs
    p.write_text(json.dumps(data))


def never_ran(w: World) -> Callable[[], str | None]:
    return lambda: "the planted library's constructor ran" if w.mark.exists() else None


def library_cases(w: World) -> list[Case]:
    cases = []
    planted = w.bundle("planted")
    (planted / "kernels" / "cpu").mkdir(parents=True)
    shutil.copy(w.evil, planted / "kernels" / "cpu" / "libplanted.so")
    _config(planted, {"CPUExecutionProvider": "kernels/cpu/libplanted.so"})
    absolute = w.bundle("absolute")
    _config(absolute, {"CPUExecutionProvider": str(w.evil)})
    dotdot = w.bundle("dotdot")
    _config(dotdot, {"CPUExecutionProvider": "../evil.so"})
    for b in (planted, absolute, dotdot):
        for extra in ([], ["--verify", "none"], ["--portable"], ["--verify", "none", "--portable"]):
            cases.append(
                Case(
                    f"library {b.name} {' '.join(extra)}".strip(),
                    ["run", b.name, "--inputs", "x.npz", *extra],
                    1,
                    never_ran(w),
                )
            )
    kern = w.bundle("substituted", kernels=True)
    libs = sorted((kern / "kernels" / "cpu").glob("*.so"))
    if not libs:  # no C compiler, or the kernel's speed gate refused it on this machine
        print("skipped: the substituted-library cases (the gated model made no kernel library)")
        return cases
    lib = libs[0]
    tmp = lib.with_name(lib.name + ".new")
    shutil.copy(w.evil, tmp)
    os.replace(tmp, lib)
    for extra in ([], ["--verify", "none"]):
        cases.append(
            Case(
                f"library substituted {' '.join(extra)}".strip(),
                ["run", kern.name, "--inputs", "gated.npz", *extra],
                1,
                never_ran(w),
            )
        )
    unvouched = w.root / "unvouched"
    shutil.copytree(kern, unvouched)
    mp = unvouched / "manifest.json"
    manifest = json.loads(mp.read_text())
    for entry in (manifest.get("kernels") or {}).get("libraries", {}).values():
        entry.pop("sha256", None)
    mp.write_text(json.dumps(manifest))
    cases.append(
        Case(
            "library substituted, sha256 deleted, --verify none",
            ["run", "unvouched", "--inputs", "gated.npz", "--verify", "none"],
            1,
            never_ran(w),
        )
    )
    np.savez(w.root / "gated.npz", x=np.ones(GATED_SHAPE, np.float32))
    return cases


def side_output_cases(w: World) -> list[Case]:
    made: dict[str, Path] = {}
    side = w.root / "side"
    side.mkdir()
    if os.geteuid() == 0:
        os.mknod(side / "chardev", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made["char device"] = side / "chardev"
    os.mkfifo(side / "fifo")
    made["FIFO"] = side / "fifo"
    (side / "folder").mkdir()
    made["directory"] = side / "folder"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(side / "sock"))
        made["socket"] = side / "sock"
    except OSError:
        pass
    finally:
        sock.close()
    np.savez(w.root / "x.npz", x=np.ones((2, 64), np.float32))
    cases = []
    for kind, path in made.items():
        before = stat.S_IFMT(os.lstat(path).st_mode)
        rel = str(path.relative_to(w.root))

        def same(path=path, before=before):
            now = stat.S_IFMT(os.lstat(path).st_mode)
            return None if now == before else f"{path.name} was replaced"

        for flag, argv in (
            ("--remarks", ["optimize", "relu.onnx", "-o", "o_side", "-q", "--remarks", rel]),
            ("--junit", ["optimize", "relu.onnx", "-o", "o_side", "-q", "--junit", rel]),
            ("--html", ["optimize", "relu.onnx", "-o", "o_side", "-q", "--html", rel]),
            (
                "bench --save-baseline",
                ["bench", "relu.onnx", "--runs", "3", "--save-baseline", rel],
            ),
            ("explain --remarks", ["explain", "relu.onnx", "-q", "--remarks", rel]),
        ):
            cases.append(Case(f"side output {flag} at a {kind}", argv, 2, same))
    return cases


def resource_cases(w: World) -> list[Case]:
    r = w.root
    bomb_nodes = [
        helper.make_node("Range", ["s", "l", "d"], ["r"], name="bomb"),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Slice", ["rf", "st", "en"], ["sl"]),
        helper.make_node("Add", ["sl", "x"], ["y"]),
    ]
    bomb_inits = [
        const("s", 0, np.int64),
        const("l", 10**13, np.int64),
        const("d", 1, np.int64),
        const("st", [0], np.int64),
        const("en", [4], np.int64),
    ]
    save(r / "range_bomb.onnx", bomb_nodes, [vi("x", [4])], [vi("y", [4])], bomb_inits)
    # the same bomb inside an If branch that is never taken
    then_g = helper.make_graph(bomb_nodes, "then", [], [vi("y", [4])], bomb_inits)
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y2"])], "else", [], [vi("y2", [4])]
    )
    save(
        r / "range_bomb_if.onnx",
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        [vi("x", [4])],
        [vi("y", [4])],
        [const("c", False, np.bool_)],
    )

    def div(name, a, b):
        save(
            r / name,
            [
                helper.make_node("Div", ["a", "b"], ["q"]),
                helper.make_node("Add", ["q", "x"], ["y"]),
            ],
            [vi("x", [1], TensorProto.INT32)],
            [vi("y", [1], TensorProto.INT32)],
            [const("a", [a], np.int32), const("b", [b], np.int32)],
        )

    div("div_intmin.onnx", -(2**31), -1)
    div("div_zero.onnx", 7, 0)
    big = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)  # 1 MiB
    tile = [
        helper.make_node("Tile", [f"t{i}" if i else "c", "reps"], [f"t{i + 1}"]) for i in range(6)
    ]
    tile.append(helper.make_node("ReduceSum", ["t6"], ["s"], keepdims=0))
    tile.append(helper.make_node("Add", ["s", "x"], ["y"]))
    for i in range(1, 6):
        tile[i].input[0] = f"t{i}"
    save(
        r / "tile_chain.onnx",
        tile,
        [vi("x", [])],
        [vi("y", [])],
        [const("c", big), const("reps", [2, 1], np.int64)],
    )
    concat = [
        helper.make_node("Concat", ["c"] * 16, ["k"], axis=0),
        helper.make_node("ReduceSum", ["k"], ["s"], keepdims=0),
        helper.make_node("Add", ["s", "x"], ["y"]),
    ]
    save(r / "concat16.onnx", concat, [vi("x", [])], [vi("y", [])], [const("c", big)])
    body = helper.make_graph(
        [
            helper.make_node("Add", ["v_in", "one"], ["v_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL), vi("v_in", [1])],
        [vi("cond_out", [], TensorProto.BOOL), vi("v_out", [1])],
        [const("one", [1.0])],
    )
    save(
        r / "loop_1e9.onnx",
        [helper.make_node("Loop", ["n", "cond", "x"], ["y"], body=body)],
        [vi("x", [1])],
        [vi("y", [1])],
        [const("n", 10**9, np.int64), const("cond", True, np.bool_)],
    )

    outer = [
        helper.make_node("Einsum", ["v", "v"], ["o"], equation="i,j->ij", name="outer"),
        helper.make_node("ReduceMax", ["o"], ["m"], keepdims=0),
        helper.make_node("Add", ["x", "m"], ["y"]),
    ]
    save(
        r / "einsum_outer.onnx",
        outer,
        [vi("x", [4])],
        [vi("y", [4])],
        [const("v", np.ones(60_000))],
    )

    def smaller_than(src: str, out: str, factor: float):
        def check():
            a, b = (r / src).stat().st_size, (r / out / "model.onnx").stat().st_size
            return None if b <= factor * a else f"model.onnx is {b / a:.1f}x the input"

        return check

    return [
        Case(
            "Range(0, 1e13) bomb, ulimit -v 4 GiB",
            ["optimize", "range_bomb.onnx", "-o", "o_bomb", "-q"],
            3,
            cap_mb=4096,
        ),
        Case(
            "Range bomb in an untaken If, ulimit -v 4 GiB",
            ["optimize", "range_bomb_if.onnx", "-o", "o_bomb_if", "-q"],
            0,
            cap_mb=4096,
        ),
        Case(
            "Einsum outer product of a 240 KB constant (13.4 GiB), ulimit -v 8 GiB",
            ["optimize", "einsum_outer.onnx", "-o", "o_outer", "-q"],
            3,
            cap_mb=8192,
        ),
        Case(
            "Div INT_MIN / -1 at -O1",
            ["optimize", "div_intmin.onnx", "-o", "o_div", "-q", "-O1"],
            3,
        ),
        Case("Div by zero", ["optimize", "div_zero.onnx", "-o", "o_div0", "-q"], 3),
        Case(
            "six Tile x2 on 1 MiB",
            ["optimize", "tile_chain.onnx", "-o", "o_tile", "-q"],
            0,
            smaller_than("tile_chain.onnx", "o_tile", 2.0),
        ),
        Case(
            "Concat of one 1 MiB constant x16",
            ["optimize", "concat16.onnx", "-o", "o_cat", "-q"],
            0,
            smaller_than("concat16.onnx", "o_cat", 2.0),
        ),
        Case(
            "Loop of 1e9 iterations, GRAPHOPT_RUN_SECONDS=5",
            ["optimize", "loop_1e9.onnx", "-o", "o_loop", "-q"],
            3,
            env={"GRAPHOPT_RUN_SECONDS": "5"},
        ),
        Case("bench --runs 10^12", ["bench", "relu.onnx", "--runs", str(10**12)], 2),
        Case("bench --warmup 10^12", ["bench", "relu.onnx", "--warmup", str(10**12)], 2),
        Case(
            "run --repeat 10^12",
            ["run", "planted_ok", "--inputs", "x.npz", "--repeat", str(10**12)],
            2,
        ),
        Case(
            "GRAPHOPT_TIME_BUDGET=0",
            ["optimize", "relu.onnx", "-o", "o_tb", "-q"],
            1,
            env={"GRAPHOPT_TIME_BUDGET": "0"},
        ),
    ]


def _external(folder: Path, edit) -> Path:
    folder.mkdir()
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "mm",
        [vi("x", [1, 8])],
        [vi("y", [1, 8])],
        [const("W", np.arange(64, dtype=np.float32).reshape(8, 8))],
    )
    m = helper.make_model(g, opset_imports=OPSETS)
    external_data_helper.convert_model_to_external_data(
        m, all_tensors_to_one_file=True, location="w.bin", size_threshold=0
    )
    onnx.save(m, folder / "m.onnx")
    m = onnx.load(folder / "m.onnx", load_external_data=False)
    t = m.graph.initializer[0]
    entries = {e.key: e.value for e in t.external_data}
    edit(entries, folder)
    del t.external_data[:]
    for k, v in entries.items():
        t.external_data.add(key=k, value=v)
    onnx.save(m, folder / "m.onnx")
    return folder / "m.onnx"


def _loop(entries, folder):
    (folder / "w.bin").unlink()
    (folder / "w.bin").symlink_to("w2.bin")
    (folder / "w2.bin").symlink_to("w.bin")


def shown_as_written(w: World) -> Callable[[], str | None]:
    """The node name came out with its brackets as written and its control characters escaped."""

    def check() -> str | None:
        text = (w.root / "stdout.txt").read_text().replace("\n", "")
        if "\x1b" in text or "\u202e" in text:
            return "a control character reached the terminal"
        if "[bold red]x[/bold red][/oops]\\x1b[2J" not in text:
            return "the name was not printed as written"
        return None

    return check


def _zip_bomb(path: Path, nbytes: int) -> None:
    """An .npz of one float32 array of ``nbytes`` zeros, deflated to a few MB."""
    from numpy.lib import format as npy

    shape = (nbytes // 256, 64)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("x.npy", "w", force_zip64=True) as f:
            npy.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
            chunk = bytes(1 << 24)
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)


def input_cases(w: World) -> list[Case]:
    r = w.root
    cases = []
    for name, edit in (
        ("symlink loop", _loop),
        ("file shorter than offset+length", lambda e, f: os.truncate(f / "w.bin", 100)),
        ("negative length", lambda e, f: e.update(length="-4")),
        ("negative offset", lambda e, f: e.update(offset="-4")),
        ("non-integer offset", lambda e, f: e.update(offset="1.5")),
    ):
        folder = "ext_" + name.split()[0] + "_" + name.split()[1]
        _external(r / folder, edit)
        for cmd in (
            ["optimize", f"{folder}/m.onnx", "-o", f"o_{folder}", "-q"],
            ["lint", f"{folder}/m.onnx"],
        ):
            cases.append(Case(f"external data: {name} ({cmd[0]})", cmd, 1))
    save(
        r / "dim62.onnx",
        [helper.make_node("Relu", ["x"], ["y"])],
        [vi("x", [1, 2**62])],
        [vi("y", [1, 2**62])],
    )
    cases.append(Case("declared dim 2^62 (check)", ["check", "dim62.onnx", "dim62.onnx", "-q"], 1))
    cases.append(
        Case("declared dim 2^62 (optimize)", ["optimize", "dim62.onnx", "-o", "o_dim", "-q"], 3)
    )
    cases.append(Case("300-character -o name", ["optimize", "relu.onnx", "-o", "a" * 300, "-q"], 2))
    locked = r / "locked"
    locked.mkdir()
    shutil.copy(w.relu, locked / "relu.onnx")
    os.chmod(locked / "relu.onnx", 0)
    cases.append(
        Case(
            "unreadable input (mode 000"
            + (", root without DAC override)" if os.geteuid() == 0 else ")"),
            ["optimize", "locked/relu.onnx", "-o", "o_locked", "-q"],
            1,
            without_dac=os.geteuid() == 0 and shutil.which("setpriv") is not None,
        )
    )
    x, y = vi("x", [2]), vi("y", [2])
    save(
        r / "cycle.onnx",
        [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])],
        [x],
        [vi("b", [2])],
    )
    local = [*OPSETS, helper.make_opsetid("local", 1)]
    f = helper.make_function(
        "local", "F", ["a"], ["b"], [helper.make_node("F", ["a"], ["b"], domain="local")], local
    )
    save(
        r / "recursive.onnx",
        [helper.make_node("F", ["x"], ["y"], domain="local")],
        [x],
        [y],
        functions=[f],
        opsets=local,
    )
    raw = const("W", np.zeros((8, 8)))
    raw.raw_data = b"\0" * 12
    save(
        r / "rawdata.onnx",
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [vi("x", [1, 8])],
        [vi("y", [1, 8])],
        [raw],
    )
    for name, p in (
        ("a cycle", "cycle.onnx"),
        ("a recursive function", "recursive.onnx"),
        ("raw_data of the wrong size", "rawdata.onnx"),
    ):
        cases.append(Case(f"lint on {name}", ["lint", p], 1))
    listed = w.bundle("manifest_list")
    (listed / "manifest.json").write_text(
        json.dumps([json.loads((listed / "manifest.json").read_text())])
    )
    cases.append(
        Case("manifest.json a JSON list", ["run", "manifest_list", "--inputs", "x.npz"], 1)
    )
    level = w.bundle("bad_level")
    cfg = json.loads((level / "session_config.json").read_text())
    cfg["graph_optimization_level"] = "banana"
    (level / "session_config.json").write_text(json.dumps(cfg))
    cases.append(
        Case("session_config level 'banana'", ["run", "bad_level", "--inputs", "x.npz"], 1)
    )
    folder = w.bundle("config_path")
    cfg = json.loads((folder / "session_config.json").read_text())
    cfg["session_config_entries"] = {"session.model_external_initializers_file_folder_path": "/"}
    (folder / "session_config.json").write_text(json.dumps(cfg))
    cases.append(
        Case(
            "session_config entry naming a folder outside",
            ["run", "config_path", "--inputs", "x.npz"],
            1,
        )
    )
    save(r / "no_outputs.onnx", [helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [])
    cases.append(Case("a graph without outputs", ["optimize", "no_outputs.onnx", "-o", "o_no"], 1))
    name = "[bold red]x[/bold red][/oops]\x1b[2J\x1b[31mred\u202e"
    save(
        r / "named.onnx",
        [helper.make_node("FooBar", ["x"], ["y"], domain="my.dom", name=name)],
        [vi("x", [2])],
        [vi("y", [2])],
        opsets=[*OPSETS, helper.make_opsetid("my.dom", 1)],
    )
    cases.append(
        Case(
            "markup, ANSI escapes, a bidi override in a node name (lint)",
            ["lint", "named.onnx"],
            0,
            shown_as_written(w),
        )
    )
    _zip_bomb(r / "bomb.npz", 5 << 30)
    cases.append(
        Case(
            f"--inputs zip bomb ({(r / 'bomb.npz').stat().st_size >> 20} MB declaring 5 GiB), "
            "ulimit -v 4 GiB",
            ["optimize", "relu.onnx", "-o", "o_bomb", "--inputs", "bomb.npz", "-q"],
            2,
            cap_mb=4096,
        )
    )
    os.mkfifo(r / "in.fifo")
    cases.append(
        Case(
            "--inputs a FIFO (nothing writes it)",
            ["optimize", "relu.onnx", "-o", "o_fifo", "--inputs", "in.fifo", "-q"],
            2,
        )
    )
    for name, value in (("GRAPHOPT_RUN_SECONDS", "abc"), ("GRAPHOPT_KERNEL_THREADS", "1e9")):
        cases.append(
            Case(
                f"{name}={value}",
                ["optimize", "relu.onnx", "-o", "o_env", "-q"],
                2,
                env={name: value},
            )
        )
    w.bundle("planted_ok")  # a sound bundle for the count and npz cases
    (r / "corrupt.npz").write_bytes(b"PK\x03\x04" + b"\xff" * 64)
    np.savez(r / "zero.npz", x=np.ones((0, 64), np.float32))
    np.savez(r / "empty.npz")
    for name, npz in (
        ("corrupt", "corrupt.npz"),
        ("zero-size [0, 64]", "zero.npz"),
        ("empty (no arrays)", "empty.npz"),
    ):
        cases.append(
            Case(
                f"check --inputs {name} .npz",
                ["check", "relu.onnx", "relu.onnx", "--inputs", npz, "-q"],
                2,
            )
        )
        cases.append(
            Case(
                f"optimize --inputs {name} .npz",
                ["optimize", "relu.onnx", "-o", "o_npz", "--inputs", npz, "-q"],
                2,
            )
        )
        cases.append(Case(f"run --inputs {name} .npz", ["run", "planted_ok", "--inputs", npz], 2))
    cases.append(
        Case(
            "Ctrl-C while the imports run",
            ["lint", "relu.onnx"],
            130,
            before=_SIGINT_DURING_IMPORTS,
        )
    )
    cases.append(
        Case(
            "Ctrl-C 0.3 s after start",
            ["bench", "relu.onnx", "--runs", "1000000", "--min-seconds", "600"],
            130,
            env={"GRAPHOPT_PROGRESS_AFTER": "0"},
            sigint_after=0.3,
        )
    )
    cases.append(
        Case(
            "Ctrl-C 2 s after start",
            ["bench", "relu.onnx", "--runs", "1000000", "--min-seconds", "600"],
            130,
            env={"GRAPHOPT_PROGRESS_AFTER": "0"},
            sigint_after=2.0,
        )
    )
    return cases


#: a progress line on stderr ("12:00:00 graphopt +0.1s: loading"), not the case's message
_PROGRESS = re.compile(r"^\d\d:\d\d:\d\d graphopt \+[\d.]+s: ")


def run_case(w: World, case: Case) -> dict:
    argv = [*console_argv(w.root, case.before), *case.args]
    if case.without_dac:  # root without the capabilities that read any file
        argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]
    out, err = w.root / "stdout.txt", w.root / "stderr.txt"
    spec = {
        "argv": argv,
        "out": str(out),
        "err": str(err),
        "cwd": str(w.root),
        "env": os.environ | {MARK_ENV: str(w.mark)} | case.env,
        "cap_mb": case.cap_mb,
        "sigint_after": case.sigint_after,
    }
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    got = json.loads(done.stdout)
    code = os.waitstatus_to_exitcode(got["status"])
    said = err.read_text(errors="replace").strip().splitlines()
    lines = [line for line in said if not _PROGRESS.match(line)]  # progress a case turned on
    problems = []
    if code != case.code:
        problems.append(f"exit {code}, documented {case.code}")
    text = "\n".join(lines)
    if "Traceback" in text or "internal error" in text:
        problems.append("a traceback or internal error")
    if case.code != 0 and (len(lines) != 1 or not lines[0].startswith("error:")):
        problems.append(f"{len(lines)} stderr lines")
    if case.holds is not None and (why := case.holds()):
        problems.append(why)
    shown = ["graphopt", *(a if len(a) < 40 else a[:12] + "..." for a in case.args)]
    prefix = " ".join(f"{k}={v}" for k, v in case.env.items())
    if case.cap_mb:
        prefix = f"ulimit -v {case.cap_mb << 10}; " + prefix
    return {
        "case": case.name,
        "command": (prefix + " " if prefix else "") + " ".join(shown),
        "expected": case.code,
        "exit": code,
        "message": lines[0] if len(lines) == 1 else (lines[-1] if lines else ""),
        "seconds": round(got["wall"], 2),
        "peak_rss_mb": round(got["rss_kb"] / 1024),
        "holds": not problems,
        "problems": problems,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="folder for the cases' files (kept)")
    ap.add_argument("--only", help="run only cases whose name contains this")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if shutil.which("gcc") is None:
        print("needs gcc (the planted libraries are built here)", file=sys.stderr)
        return 2
    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="graphopt-hostile-")
        root = Path(tmp.name)
    else:
        root = args.work.resolve()
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
    try:
        w = World(root)
        cases = library_cases(w) + side_output_cases(w) + input_cases(w) + resource_cases(w)
        if args.only:
            cases = [c for c in cases if args.only in c.name]
        rows = []
        for case in cases:
            row = run_case(w, case)
            rows.append(row)
            print(
                f"{'ok ' if row['holds'] else 'BAD'} {row['case']}: exit {row['exit']} "
                f"{row['seconds']} s {row['peak_rss_mb']} MB {'; '.join(row['problems'])}",
                file=sys.stderr,
                flush=True,
            )
        print("| case | command | exit (documented) | message | s | peak RSS MB | holds |")
        print("|---|---|---:|---|---:|---:|---|")
        for row in rows:
            msg = row["message"].replace("|", "\\|")
            msg = msg if len(msg) <= 140 else msg[:137] + "..."
            print(
                f"| {row['case']} | `{row['command']}` | {row['exit']} ({row['expected']}) | "
                f"{msg} | {row['seconds']} | {row['peak_rss_mb']} | "
                f"{'yes' if row['holds'] else 'NO: ' + '; '.join(row['problems'])} |"
            )
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0 if all(r["holds"] for r in rows) else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
