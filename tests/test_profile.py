"""``graphopt profile``: where a bundle's time goes, who owns it, which missed fusions hold it."""

import json
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt.verify.profile import (
    INSERTED,
    PYTHON_BINDING,
    UNOWNED_ROWS,
    ModelIndex,
    Profiled,
    Provenance,
    region_of,
    summarize,
)

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def bundle_of(src: Path, out: Path, *extra) -> Path:
    res = invoke("optimize", src, "-o", out, "--no-measure", "-q", *extra)
    assert res.exit_code == 0, res.output
    return out


def profiled(*args) -> dict:
    res = invoke("profile", *args, "--format", "json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def mobilenet(tmp_path_factory):
    return bundle_of(EXAMPLES / "mobilenet_bn.onnx", tmp_path_factory.mktemp("mb") / "b")


def unfused_conv_bn(rng, tmp_path) -> Path:
    """An expensive Conv + BN whose BN parameters are graph inputs (kept overridable with
    --keep-initializer-inputs: fuse-conv-bn misses with non-constant-param), then a cheap Relu."""
    c = 32
    bn = [
        const(k, v)
        for k, v in zip(
            "gbmv",
            (
                rng.random(c) + 0.5,
                rng.standard_normal(c),
                rng.standard_normal(c),
                rng.random(c) + 0.1,
            ),
        )
    ]
    inits = [const("W", rng.standard_normal((c, 16, 3, 3)) * 0.1), *bn]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="/net/conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", *"gbmv"], ["n"], name="/net/bn"),
        helper.make_node("Relu", ["n"], ["y"], name="/net/relu"),
    ]
    inputs = [vi("x", [1, 16, 96, 96])] + [vi(t.name, [c]) for t in bn]
    p = tmp_path / "unfused.onnx"
    onnx.save(model(nodes, inputs, [vi("y", None)], inits), p)
    return p


def assert_unowned_time_is_inserted(data):
    """Node time no model node owns is exactly onnxruntime's inserted rows (NCHWc Reorders
    around a Conv); they are memory-bound and their share varies with the machine's load, so
    only a majority is asserted for the owned part."""
    node_ms = data["account"]["node_ms"]
    inserted = sum(r["ms"] for r in data["nodes"] if r["owner"] == INSERTED)
    assert data["coverage"] == pytest.approx(1 - inserted / node_ms, abs=2e-3)
    assert data["coverage"] > 0.5


def test_mobilenet_bundle_time_adds_up_and_has_owners(mobilenet):
    data = profiled(mobilenet, "--runs", "5")
    assert data["schema"] == "graphopt.profile/1" and data["runs"] == 5
    assert data["session"]["model"] in ("model.onnx", "model.machine.onnx")
    acc = data["account"]
    assert sum(g["ms"] for g in data["ops"]) == pytest.approx(acc["node_ms"], abs=1e-3)
    assert sum(g["kernel_ms"] for g in data["ops"]) == pytest.approx(data["kernel_ms"], abs=1e-3)
    assert [o["row"] for o in acc["other"]] == list(UNOWNED_ROWS)
    rows = acc["node_ms"] + sum(o["ms"] for o in acc["other"])
    assert acc["rows_ms"] == pytest.approx(rows, abs=1e-3)
    assert acc["residual_ms"] == pytest.approx(acc["measured_ms"] - rows, abs=1e-3)
    # the kernels alone are a share of the run (the rest: executor, profiler, binding)
    assert 0.2 < data["kernel_ratio"] <= 1.1
    assert data["kernel_ms"] <= acc["node_ms"] <= acc["measured_ms"] * 1.1
    assert_unowned_time_is_inserted(data)
    inserted = [r for r in data["nodes"] if r["owner"] == INSERTED]
    assert all(r["op"].startswith("Reorder") or r["op"] for r in inserted)
    fused = [r for r in data["nodes"] if r.get("rule") == "fuse-conv-bn"]
    assert fused and all(any("BatchNormalization" in o for o in r["originals"]) for r in fused)
    assert any(g["region"].startswith("/blocks/blocks.") for g in data["regions"])


def test_unfused_chain_is_the_top_missed_row(rng, tmp_path):
    src = unfused_conv_bn(rng, tmp_path)
    b = bundle_of(src, tmp_path / "b", "--keep-initializer-inputs")
    data = profiled(b, "--runs", "30")  # enough runs that a cold first one weighs little
    top = data["missed"][0]
    assert (top["rule"], top["code"]) == ("fuse-conv-bn", "non-constant-param")
    assert set(top["node_names"]) >= {"/net/conv", "/net/bn"}
    assert top["ms"] > 0.5 * data["account"]["node_ms"] and top["share"] > 0.3
    assert_unowned_time_is_inserted(data)
    # the rows (nodes, executor, session.run) account for the run: within 10 % on a quiet
    # machine; 0.5 leaves room for a loaded one or the process's first runs
    assert 0.5 <= data["ratio"] <= 1.1, data["ratio"]
    res = invoke("profile", b, "--runs", "3")
    assert res.exit_code == 0, res.output
    assert "fuse-conv-bn missed: non-constant-param" in " ".join(res.stdout.split())


#: the Trace Event Format's phases (chrome://tracing, Perfetto, speedscope read these)
_PHASES = set("BEXiIbneCMPOND") | {"s", "t", "f", "(", ")", "R", "c"}


def assert_trace_event_format(doc):
    """The JSON Object Format of the Trace Event Format, checked field by field: strict JSON
    (no NaN), a traceEvents list, each event with a string name, a known phase, numeric
    timestamps, integer process and thread ids, complete events with a duration >= 0."""
    json.dumps(doc, allow_nan=False)
    assert set(doc) <= {"traceEvents", "displayTimeUnit", "otherData", "systemTraceEvents"}
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in _PHASES, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert e["ph"] == "M" or isinstance(e["ts"], (int, float)), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        assert isinstance(e.get("args", {}), dict), e


def test_trace_and_compare(mobilenet, tmp_path):
    trace = tmp_path / "t.json"
    args = ["--runs", "3", "--trace", trace, "--compare", EXAMPLES / "mobilenet_bn.onnx"]
    data = profiled(mobilenet, *args)
    doc = json.loads(trace.read_text())
    assert_trace_event_format(doc)
    events = doc["traceEvents"]
    kernels = [e for e in events if "graphopt" in (e.get("args") or {})]
    assert kernels and all(e["ph"] == "X" for e in kernels)
    assert any(e["args"]["graphopt"]["owner"] == "model" for e in kernels)
    cmp = data["compare"]
    ops = {r["op"]: r for r in cmp["ops"]}
    assert ops["com.microsoft.FusedConv"]["count_original"] == 0
    assert ops["BatchNormalization"]["count_optimized"] == 0 or "BatchNormalization" not in ops
    assert cmp["run_ms_original"] > 0 and cmp["original"]["coverage"] > 0
    for r in cmp["ops"]:  # each side with the interval of its median per run
        for side in ("original", "optimized"):
            low, high = r[f"interval_{side}"]
            assert low <= r[f"ms_{side}"] <= high or low == high == r[f"ms_{side}"], r
    page = tmp_path / "p.html"
    text = invoke("profile", mobilenet, *args, "--html", page)
    assert text.exit_code == 0 and "vs original at ORT_ENABLE_ALL" in text.stdout
    html = page.read_text()
    assert "<h1>graphopt profile</h1>" in html and 'id="profile-ops"' in html
    assert 'id="profile-compare"' in html and "com.microsoft.FusedConv" in html


def test_plain_model_profiles_at_enable_all(tmp_path):
    data = profiled(EXAMPLES / "bert_tiny.onnx", "--runs", "2", "--shape", "input_ids=1,8")
    assert data["session"]["level"] == "ORT_ENABLE_ALL" and data["missed"] == []
    assert data["inputs"]["input_ids"] == [1, 8] and data["coverage"] > 0.5


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="a CUDA device is here"
)
def test_cuda_without_a_device_says_it_profiled_the_cpu(tmp_path):
    b = bundle_of(EXAMPLES / "mobilenet_bn.onnx", tmp_path / "cuda", "--target", "cuda")
    for src in (b, EXAMPLES / "mobilenet_bn.onnx"):
        extra = [] if src == b else ["--target", "cuda"]
        data = profiled(src, "--runs", "2", *extra)
        assert data["session"]["providers"] == ["CPUExecutionProvider"]
        assert "profiled the CPU provider" in data["providers_note"]
        assert "CUDAExecutionProvider not available" in data["providers_note"]
        res = invoke("profile", src, "--runs", "1", *extra)
        assert res.exit_code == 0 and "profiled the CPU provider" in " ".join(res.stdout.split())
    assert profiled(EXAMPLES / "mobilenet_bn.onnx", "--runs", "1")["providers_note"] is None


def test_bad_input_exit_codes(mobilenet, tmp_path):
    assert invoke("profile", tmp_path).exit_code == 2  # a folder that is no bundle
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert invoke("profile", bad).exit_code == 1
    assert invoke("profile", mobilenet, "--runs", "0").exit_code == 2
    assert invoke("profile", mobilenet, "--shape", "nope=1,2").exit_code == 2
    assert invoke("profile", mobilenet, "--target", "cuda").exit_code == 2
    corrupt = tmp_path / "c"
    corrupt.mkdir()
    (corrupt / "manifest.json").write_text("{")
    (corrupt / "session_config.json").write_text("{}")
    assert invoke("profile", corrupt).exit_code == 1


def test_kernel_names_map_to_model_nodes():
    g = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="/a/conv"),
            helper.make_node("Relu", ["c"], ["y"], name="/a/relu"),
        ],
        "g",
        [vi("x", [1])],
        [vi("y", [1])],
    )
    index = ModelIndex.of(helper.make_model(g))
    assert index.node_of("/a/conv") == "/a/conv"
    assert index.node_of("fused /a/relu") == "/a/relu"
    assert index.node_of("/a/conv_out_nchwc") == "/a/conv"
    assert index.node_of("c_nchwc") == "/a/conv"
    assert index.node_of("ReorderOutput_token_3") is None
    assert index.node_of("HardSigmoid_53") is None
    assert region_of("/model/layers.3/attn/MatMul") == "/model/layers.3/"
    assert region_of("/model/embeddings/Add") == "/model/embeddings/"
    assert region_of("conv") == "(top level)"


def _event(name, ts, dur, cat="Node"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X", "args": {}}


def test_every_microsecond_of_a_run_has_a_row():
    """Three runs of a two-node model, timed by hand: each node's span is its kernel and the
    gap to the next kernel; the executor's edges, onnxruntime's run outside the executor and
    Python's session.run outside that run are rows of their own.  Rows are means over the half
    of the runs nearest the median run (the third run, stretched by load, is left out), set
    against the median run: the residual is what that choice leaves."""
    g = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"], name="/n/a"),
            helper.make_node("Neg", ["a"], ["y"], name="/n/b"),
        ],
        "g",
        [vi("x", [1])],
        [vi("y", [1])],
    )
    index = ModelIndex.of(helper.make_model(g))
    events = []
    # (start, run, executor, first kernel): run 2's first kernel is 10 µs slower, run 3's 260
    for t0, run, execute, first in (
        (1000, 100, 90, 30),
        (2000, 100, 90, 40),
        (3000, 360, 350, 290),
    ):
        events += [
            _event("model_run", t0, run, "Session"),
            _event("SequentialExecutor::Execute", t0 + 5, execute, "Session"),
            _event("/n/a_kernel_time", t0 + 10, first, "Node"),
            _event("/n/b_kernel_time", t0 + 20 + first, 20, "Node"),
        ]
    runs = [(1000, 100), (2000, 100), (3000, 360)]
    walls = [130.0, 140.0, 400.0]
    prof = Profiled(events, runs, {}, {}, [50.0, 50.0, 50.0], walls)
    data = summarize(prof, index, Provenance())
    assert data["central_runs"] == 2
    ms = {r["node"]: (r["ms"], r["kernel_ms"]) for r in data["nodes"]}
    assert ms["/n/a"] == (0.045, 0.035)  # spans 40 and 50 µs, kernels 30 and 40
    assert ms["/n/b"] == (0.02, 0.02)  # the last kernel: no gap after it
    acc = data["account"]
    other = {o["row"]: o["ms"] for o in acc["other"]}
    assert other[UNOWNED_ROWS[0]] == 0.025  # 5 before the first kernel; 25, then 15 after the last
    assert other[UNOWNED_ROWS[1]] == 0.01
    assert other[PYTHON_BINDING] == 0.035
    assert acc["measured_ms"] == 0.14 and acc["rows_ms"] == 0.135
    assert acc["residual_ms"] == 0.005 and acc["profiler_ms"] == 0.09
    assert acc["kernel_events"] == 2 and acc["measured_quartiles_ms"] == [0.135, 0.14, 0.27]
    assert data["coverage"] == 1.0 and data["ratio"] == pytest.approx(0.135 / 0.14, abs=1e-4)


def test_a_subgraph_kernels_time_is_not_counted_twice():
    """An If's body runs inside the If's kernel: the If keeps its own time (the gaps around
    its body's kernels), each body node its span, and the rows still add up to the run."""
    branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["t"], name="/body/neg")], "b", [], [vi("t", [1])]
    )
    g = helper.make_graph(
        [
            helper.make_node(
                "If", ["c"], ["y"], name="/n/if", then_branch=branch, else_branch=branch
            ),
            helper.make_node("Relu", ["y"], ["z"], name="/n/relu"),
        ],
        "g",
        [vi("c", [1]), vi("x", [1])],
        [vi("z", [1])],
    )
    index = ModelIndex.of(helper.make_model(g))
    events = [
        _event("model_run", 0, 200, "Session"),
        _event("SequentialExecutor::Execute", 10, 7, "Session"),  # the body's executor
        _event("/body/neg_kernel_time", 12, 4, "Node"),
        _event("SequentialExecutor::Execute", 2, 190, "Session"),
        _event("/n/if_kernel_time", 5, 100, "Node"),
        _event("/n/relu_kernel_time", 110, 50, "Node"),
    ]
    data = summarize(Profiled(events, [(0, 200)], {}, {}, [], []), index, Provenance())
    rows = {r["node"]: (r["ms"], r["kernel_ms"]) for r in data["nodes"]}
    assert rows["/body/neg"] == (0.004, 0.004)
    assert rows["/n/if"] == (0.101, 0.096)  # 100 less its body's 4, and the gap of 5 after it
    assert rows["/n/relu"] == (0.05, 0.05)
    acc = data["account"]
    other = {o["row"]: o["ms"] for o in acc["other"]}
    assert other[UNOWNED_ROWS[0]] == 0.035 and other[UNOWNED_ROWS[1]] == 0.01
    assert PYTHON_BINDING not in other and acc["measured_by"] == "onnxruntime's model_run"
    assert acc["rows_ms"] == acc["measured_ms"] == 0.2 and acc["profiler_ms"] is None


def test_optimize_profile_puts_the_numbers_in_report_and_html(rng, tmp_path):
    src = unfused_conv_bn(rng, tmp_path)
    html = tmp_path / "r.html"
    args = ["--keep-initializer-inputs", "--profile", "--profile-runs", "3", "--html", html]
    res = invoke("optimize", src, "-o", tmp_path / "b", "--no-measure", *args)
    assert res.exit_code == 0, res.output
    assert "profile (3 runs): rows" in " ".join(res.stdout.split())
    prof = json.loads((tmp_path / "b" / "report.json").read_text())["profile"]
    assert prof["ran"] and prof["schema"] == "graphopt.profile/1" and prof["runs"] == 3
    assert (prof["missed"][0]["rule"], prof["missed"][0]["code"]) == (
        "fuse-conv-bn",
        "non-constant-param",
    )
    acc = prof["account"]
    assert acc["rows_ms"] == pytest.approx(
        acc["node_ms"] + sum(o["ms"] for o in acc["other"]), abs=1e-3
    )
    assert all(g["low_ms"] <= g["high_ms"] for g in prof["ops"])
    page = html.read_text()
    assert 'id="profile-ops"' in page and 'id="profile-missed"' in page
    assert "non-constant-param" in page and "sum of the rows" in page
    # the same numbers: the profile JSON the bundle holds is what `graphopt profile` prints
    assert set(prof) >= set(profiled(tmp_path / "b", "--runs", "2")) - {"compare"}


def _ops_doc(ops: dict, measured: float = 10.0) -> dict:
    return {
        "schema": "graphopt.profile/1",
        "account": {"measured_ms": measured},
        "ops": [
            {"op": op, "ms": (lo + hi) / 2, "low_ms": lo, "high_ms": hi}
            for op, (lo, hi) in ops.items()
        ],
    }


def test_op_baseline_comparison():
    from graphopt.opt.verify.gate import compare_op_baseline, op_regression_line

    base = _ops_doc({"Conv": (4.0, 5.0), "Relu": (0.01, 0.02)})
    # within the interval, a tiny op far past its own (under the floor: 1 % of the run), a new
    # op type with real time (a fusion that stopped firing)
    now = _ops_doc({"Conv": (4.5, 5.5), "Relu": (0.05, 0.06), "BatchNormalization": (0.5, 0.7)})
    cmp = compare_op_baseline(now, base, 0.05)
    assert cmp["regressed"] == ["BatchNormalization"] and cmp["floor_ms"] == 0.1
    assert op_regression_line(cmp).startswith("BatchNormalization 0.600 ms [0.500, 0.700]")
    slower = _ops_doc({"Conv": (5.3, 6.0), "Relu": (0.01, 0.02)})
    assert compare_op_baseline(slower, base, 0.05)["regressed"] == ["Conv"]
    assert compare_op_baseline(slower, base, 0.10)["regressed"] == []  # 5.3 < 5.0 × 1.10


def test_gate_fails_on_one_op_types_regression(tmp_path):
    src = EXAMPLES / "mobilenet_bn.onnx"
    saved = tmp_path / "ops.json"
    common = ["--max-seconds", "1", "--profile-runs", "5", "-q"]
    res = invoke("gate", src, "--save-op-baseline", saved, *common)
    assert res.exit_code == 0, res.output
    doc = json.loads(saved.read_text())
    assert doc["schema"] == "graphopt.profile/1" and doc["ops"]
    top = doc["ops"][0]  # a baseline in which the hottest op type took a tenth of its time
    top["ms"] = top["low_ms"] = top["high_ms"] = round(top["low_ms"] / 10, 4)
    doctored = tmp_path / "fast.json"
    doctored.write_text(json.dumps(doc))
    res = invoke("gate", src, "--op-baseline", doctored, *common, "--format", "json")
    assert res.exit_code == 5, res.output
    out = json.loads(res.stdout)
    assert out["op_comparison"]["regressed"][0] == top["op"]
    assert out["reason"].startswith(f"op-type regression: {top['op']} ")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "graphopt.gate-baseline/1"}))
    assert invoke("gate", src, "--op-baseline", bad, *common).exit_code == 2
