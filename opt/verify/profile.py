"""Where a model's time goes, node by node, and what graphopt said it could not win back.

onnxruntime's own profiler (``SessionOptions.enable_profiling``) runs the model as it deploys:
a bundle through :func:`graphopt.targets.bundle.open_session` (its session config, its fast path
where it matches this machine), a plain model file at ``ORT_ENABLE_ALL`` on the CPU provider.
One warm-up run, then ``runs`` runs,
each timed by Python around ``session.run``; each event is assigned to the run (``model_run``
event) it lies in.  Every microsecond of a run has a row:

- a node's *span*: its kernel (``*_kernel_time``) and the executor's gap after it, up to the next
  kernel's start (recording the event, releasing the values it read last, starting the next
  node); a kernel inside another's interval is a node of that one's subgraph (If, Loop), whose
  own time is its kernel less its body's spans;
- the executor's edges (``SequentialExecutor::Execute`` before the first kernel, after the last);
- onnxruntime's run outside the executor (``model_run`` less ``Execute``: feeds, fetches);
- ``session.run`` outside onnxruntime's run (the Python binding, numpy conversions).

Per run these add up exactly; across runs each row is its mean over the half of the runs
nearest the median run (see :func:`_central`), and the rows' sum is set against the median
``session.run`` with the residual shown.  The profiler is not free: each kernel's event (its
shapes, memory and thread statistics) is built inside the spans it records, a few microseconds
per node that dominate a model of sub-millisecond runs, so the same session is also timed with
its profiler stopped (``unprofiled_run_ms``) and the profiler's cost is the difference.

Every kernel is mapped to a node of the portable ``model.onnx`` by name: the node's own name,
``fused NAME`` (onnxruntime's fusions), a name that extends a node's or one of its outputs' name
(``NAME_out_nchwc``, ``OUTPUT_nchwc``), or, for a session built from another file (the fast
path), the node of that file whose output the portable model produces.  What maps to no node
(layout conversions ``ReorderInput``/``ReorderOutput``, nodes onnxruntime made and named
``Op_12``) is :data:`INSERTED`.  Through the bundle's ``report.json`` (the fired remarks name the
nodes a rewrite replaced and the nodes it created) each node has its *owners*, the original
model's nodes it came from, and the missed remarks are joined with the time of the nodes they
name.  The library builds the numbers; :mod:`graphopt.render` prints them.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import GraphoptError, UsageError
from ..graph.ir import PROVENANCE_KEY
from .feeds import candidate_shapes, validate_args
from .parity import make_inputs

#: the owner of kernels that map to no node of the model (layout conversions, onnxruntime's
#: own new nodes)
INSERTED = "onnxruntime-inserted"
KERNEL_SUFFIX = "_kernel_time"
#: onnxruntime's layout conversions: never a model node's, even when a name would match
_LAYOUT = re.compile(r"^(ReorderInput|ReorderOutput)(_token_\d+)?$")
_FUSED = "fused "
_SEPARATORS = "_/: "
#: a path component that numbers a repeated block: ``layers.3``, ``blocks.0``, ``layer_12``
_BLOCK = re.compile(r"[._]\d+$")
SCHEMA = "graphopt.profile/1"


# ------------------------------------------------------------------ the model's nodes
def _op_name(node: onnx.NodeProto) -> str:
    """An op as graphopt's reports spell it: ``domain.op`` outside the default domain."""
    if node.domain in ("", "ai.onnx"):
        return node.op_type
    return f"{node.domain}.{node.op_type}"


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    """The graph's nodes and those of its subgraphs (If/Loop/Scan bodies), in order."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _all_nodes(g)


@dataclass
class ModelIndex:
    """The portable model's nodes by name (op, rule that made it) and its tensors' producers."""

    ops: dict[str, str] = field(default_factory=dict)
    rules: dict[str, str] = field(default_factory=dict)
    producers: dict[str, str] = field(default_factory=dict)
    #: for a session built from another file (the fast path): its node → its outputs
    session_outputs: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto, session_model: onnx.ModelProto | None = None):
        index = cls()
        for node in _all_nodes(model.graph):
            if not node.name:
                continue
            index.ops[node.name] = _op_name(node)
            rule = next((p.value for p in node.metadata_props if p.key == PROVENANCE_KEY), None)
            if rule:
                index.rules[node.name] = rule
            for out in node.output:
                if out:
                    index.producers.setdefault(out, node.name)
        if session_model is not None:
            for node in _all_nodes(session_model.graph):
                if node.name and node.name not in index.ops:
                    index.session_outputs[node.name] = [o for o in node.output if o]
        return index

    def _named(self, text: str) -> str | None:
        if text in self.ops:
            return text
        return self.producers.get(text)

    def node_of(self, kernel: str) -> str | None:
        """The model node a kernel (its event name without ``_kernel_time``) runs, or None."""
        if _LAYOUT.match(kernel):
            return None
        while kernel.startswith(_FUSED):
            kernel = kernel[len(_FUSED) :]
        hit = self._named(kernel)
        if hit is not None:
            return hit
        for i in range(len(kernel) - 1, 0, -1):  # the longest name it extends
            if kernel[i] in _SEPARATORS:
                hit = self._named(kernel[:i])
                if hit is not None:
                    return hit
        for out in self.session_outputs.get(kernel, []):
            hit = self.producers.get(out)
            if hit is not None:
                return hit
        return None


def region_of(node: str) -> str:
    """A node's region: its name's path up to the first numbered block (``/model/layers.3/``),
    else its first two path components (``/model/embeddings/``); ``(top level)`` for a name
    without a path."""
    parts = node.split("/")
    dirs = parts[:-1]
    if not any(dirs):
        return "(top level)"
    for i, part in enumerate(dirs):
        if i and _BLOCK.search(part):
            return "/".join(dirs[: i + 1]) + "/"
    lead = 1 if dirs[0] == "" else 0
    return "/".join(dirs[: lead + 2]) + "/"


# ------------------------------------------------------------------ provenance (report.json)
@dataclass
class Provenance:
    """Which nodes each rewrite replaced (``created`` → the nodes its fired remark names)."""

    made_from: dict[str, list[str]] = field(default_factory=dict)
    missed: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, report: dict | None):
        prov = cls()
        for r in (report or {}).get("remarks") or []:
            if not isinstance(r, dict):
                continue
            nodes = [n for n in r.get("nodes") or [] if isinstance(n, str)]
            if r.get("kind") == "passed":
                for made in (r.get("args") or {}).get("created") or []:
                    if isinstance(made, str):
                        have = prov.made_from.setdefault(made, [])
                        have.extend(n for n in nodes if n != made and n not in have)
            elif r.get("kind") == "missed" and nodes:
                prov.missed.append(r)
        return prov

    def lineage(self, name: str) -> tuple[set[str], list[str]]:
        """Every name on ``name``'s way back (itself included) and the original nodes at its
        end (names no rewrite created)."""
        seen: set[str] = set()
        originals: list[str] = []
        stack = [name]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            parents = self.made_from.get(n)
            if parents:
                stack.extend(reversed(parents))
            else:
                originals.append(n)
        return seen, sorted(originals)


# ------------------------------------------------------------------ running the profiler
@dataclass(frozen=True)
class Profiled:
    """What one profiled session recorded."""

    events: list[dict]
    runs: list[tuple[int, int]]  # (ts, dur) in µs of each timed run (warm-up excluded)
    session: dict[str, Any]
    inputs: dict[str, list[int]]
    walls: list[float]  # µs of each run after the profiler stopped
    #: µs of each profiled ``session.run`` as Python timed it (warm-up excluded)
    profiled_walls: list[float] = field(default_factory=list)
    feeds: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run_profiled(
    open_profiled: Callable[[str], tuple[ort.InferenceSession, dict]],
    feeds: dict[str, np.ndarray] | None,
    shapes: dict[str, list[int]] | None,
    runs: int,
    seed: int = 0,
) -> Profiled:
    """Open a session with ``open_profiled(prefix)`` (profiling on), run it once to warm up and
    ``runs`` times on ``feeds`` (inputs not given: seeded random, ``shapes`` for symbolic dims),
    and read its profile back."""
    with tempfile.TemporaryDirectory(prefix="graphopt-profile-") as tmp:
        sess, info = open_profiled(os.path.join(tmp, "ort"))
        info = {**info, "providers": sess.get_providers()}
        names_in = [i.name for i in sess.get_inputs()]
        unknown = sorted(set(feeds or {}) - set(names_in))
        if unknown:
            raise UsageError(
                f"--inputs names unknown input(s): {', '.join(unknown)} "
                f"(model inputs: {', '.join(names_in) or 'none'})"
            )
        given = {k: v for k, v in (feeds or {}).items() if k in names_in}
        try:
            full = make_inputs(sess, dict(shapes or {}), seed, given)
        except ValueError as e:
            raise UsageError(f"cannot make inputs: {_first_line(e)}") from None
        outputs = [o.name for o in sess.get_outputs()]
        profiled_walls = []
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            try:
                sess.run(outputs, full)
            except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
                why = _first_line(e)
                raise GraphoptError(f"onnxruntime failed to run the model: {why}") from None
            profiled_walls.append((time.perf_counter() - t0) * 1e6)
        path = sess.end_profiling()
        walls = []  # the same session, its profiler stopped: a run as deployed
        for _ in range(runs):
            t0 = time.perf_counter()
            sess.run(outputs, full)
            walls.append((time.perf_counter() - t0) * 1e6)
        try:
            events = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise GraphoptError(f"cannot read onnxruntime's profile: {e}") from None
        del sess
    if isinstance(events, dict):
        events = events.get("traceEvents") or []
    run_events = sorted(
        (int(e["ts"]), int(e["dur"]))
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )
    shapes_used = {k: list(np.shape(v)) for k, v in sorted(full.items())}
    if len(run_events) != len(profiled_walls):  # a run the profile lost: no wall to pair with
        profiled_walls = []
    return Profiled(events, run_events[1:], info, shapes_used, walls, profiled_walls[1:], full)


# ------------------------------------------------------------------ the numbers
def _ms(us: float) -> float:
    return round(us / 1000.0, 4)


def _share(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole > 0 else 0.0


#: the rows of a run's time that belong to no node, in the order the table prints them
EXECUTOR_EDGES = "(executor: before the first kernel, after the last)"
RUN_OUTSIDE_EXECUTOR = "(onnxruntime run: outside the executor)"
PYTHON_BINDING = "(session.run: outside onnxruntime's run)"
UNOWNED_ROWS = (EXECUTOR_EDGES, RUN_OUTSIDE_EXECUTOR, PYTHON_BINDING)
_EXECUTE = "SequentialExecutor::Execute"


@dataclass
class _Run:
    """One timed run's events: its span, the executor's span, its kernels in start order."""

    ts: int
    dur: int
    execute: tuple[int, int] | None = None
    kernels: list[dict] = field(default_factory=list)


def _timeline(profiled: Profiled) -> list[_Run]:
    """Each timed run with the executor event and the kernel events that lie inside it."""
    runs = [_Run(ts, dur) for ts, dur in profiled.runs]
    starts = [ts for ts, _ in profiled.runs]
    for e in profiled.events:
        name = e.get("name", "")
        is_kernel = e.get("cat") == "Node" and name.endswith(KERNEL_SUFFIX)
        if not is_kernel and not (e.get("cat") == "Session" and name == _EXECUTE):
            continue
        ts = int(e.get("ts", 0))
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > starts[i] + profiled.runs[i][1]:
            continue
        if is_kernel:
            runs[i].kernels.append(e)
        else:  # a subgraph's executor runs inside the run's own: keep the outermost
            dur = int(e.get("dur", 0))
            if runs[i].execute is None or dur > runs[i].execute[1]:
                runs[i].execute = (ts, dur)
    for run in runs:
        run.kernels.sort(key=lambda e: int(e.get("ts", 0)))
    return runs


def _nest(kernels: list[dict]) -> list[tuple[dict, list]]:
    """The run's kernels as a forest: a kernel that lies inside another's interval is a node of
    that one's subgraph (If, Loop, Scan run their bodies inside their own kernel time)."""
    roots: list[tuple[dict, list]] = []
    stack: list[tuple[int, list]] = []  # (end, children) of the kernels still open
    for e in sorted(kernels, key=lambda e: (int(e["ts"]), -int(e.get("dur", 0)))):
        ts = int(e["ts"])
        end = ts + int(e.get("dur", 0))
        while stack and not (ts < stack[-1][0] and end <= stack[-1][0]):
            stack.pop()
        item: tuple[dict, list] = (e, [])
        (stack[-1][1] if stack else roots).append(item)
        stack.append((end, item[1]))
    return roots


def _level(items: list[tuple[dict, list]], out: list) -> float:
    """Appends (event, own kernel time, span) for ``items`` (siblings in start order) and
    their subgraphs' kernels, and returns the sum of the siblings' spans.  A span is the
    kernel's own time and the gap after it, up to the next sibling's start; a kernel's own time
    is its time less its subgraph's kernels' spans.  Overlapping siblings (the parallel
    executor) share no gap: a gap starts where the latest sibling so far ended."""
    total = 0.0
    end = None
    for j, (e, children) in enumerate(items):
        ts, dur = int(e["ts"]), int(e.get("dur", 0))
        end = ts + dur if end is None else max(end, ts + dur)
        own = max(0.0, dur - _level(children, out))
        gap = max(0.0, int(items[j + 1][0]["ts"]) - end) if j + 1 < len(items) else 0.0
        out.append((e, own, own + gap))
        total += own + gap
    return total


def _spans(run: _Run) -> tuple[list[tuple[dict, float, float]], float]:
    """Each kernel of the run with its own time and its span, the time the executor spends on
    its node: the kernel and the gap after it, up to the next kernel's start (recording the
    kernel's event, releasing the values it was the last to read, starting the next node).
    And the executor's time outside every span: before the first kernel and after the last."""
    ex_ts, ex_dur = run.execute or (run.ts, run.dur)
    if not run.kernels:
        return [], float(ex_dur)
    out: list[tuple[dict, float, float]] = []
    roots = _nest(run.kernels)
    _level(roots, out)
    first = min(int(e["ts"]) for e, _ in roots)
    last = max(int(e["ts"]) + int(e.get("dur", 0)) for e, _ in roots)
    edges = max(0.0, first - ex_ts) + max(0.0, ex_ts + ex_dur - last)
    return out, edges


def summarize(
    profiled: Profiled, index: ModelIndex, prov: Provenance, *, top: int | None = None
) -> dict[str, Any]:
    """Per node, per op type, per region and per missed remark: the median time over the runs,
    its share of the measured run, and every row of that run that belongs to no node, so the
    rows add up to the run with the residual shown."""
    n_runs = len(profiled.runs)
    if n_runs == 0:
        raise GraphoptError("onnxruntime's profile has no timed run")
    per_row: dict[tuple[str, str], list[float]] = {}
    per_kernel: dict[tuple[str, str], list[float]] = {}
    info: dict[tuple[str, str], dict] = {}
    unowned = {name: [0.0] * n_runs for name in UNOWNED_ROWS}
    kernel_runs = [0.0] * n_runs
    kernel_events = 0
    walls = profiled.profiled_walls if len(profiled.profiled_walls) == n_runs else []
    for i, run in enumerate(_timeline(profiled)):
        spans, edges = _spans(run)
        unowned[EXECUTOR_EDGES][i] = edges
        if run.execute is not None:
            unowned[RUN_OUTSIDE_EXECUTOR][i] = max(0.0, run.dur - run.execute[1])
        if walls:
            unowned[PYTHON_BINDING][i] = max(0.0, walls[i] - run.dur)
        kernel_events += len(spans)
        for e, dur, span in spans:
            kernel = e["name"][: -len(KERNEL_SUFFIX)]
            args = e.get("args") or {}
            node = index.node_of(kernel)
            key = (node, "") if node is not None else (INSERTED, kernel)
            per_row.setdefault(key, [0.0] * n_runs)[i] += span
            per_kernel.setdefault(key, [0.0] * n_runs)[i] += dur
            kernel_runs[i] += dur
            row = info.setdefault(key, {"kernels": [], "kernel_ops": [], "providers": []})
            for field_, value in (
                ("kernels", kernel),
                ("kernel_ops", args.get("op_name")),
                ("providers", args.get("provider")),
            ):
                if value and value not in row[field_]:
                    row[field_].append(value)
    totals = walls or [float(d) for _, d in profiled.runs]
    central = _central(totals)

    def typical(times: list[float]) -> float:
        return _ms(sum(times[i] for i in central) / len(central))

    rows = []
    for key, times in per_row.items():
        node, kernel = key
        timing = {"ms": typical(times), "kernel_ms": typical(per_kernel[key])}
        extra = info[key]
        if node == INSERTED:
            rows.append(
                {
                    "node": kernel,
                    "op": (extra["kernel_ops"] or ["?"])[0],
                    "owner": INSERTED,
                    "originals": [],
                    "rule": None,
                    "region": INSERTED,
                    **timing,
                    **extra,
                }
            )
            continue
        _, originals = prov.lineage(node)
        rows.append(
            {
                "node": node,
                "op": index.ops[node],
                "owner": "model",
                "originals": originals,
                "rule": index.rules.get(node),
                "region": region_of(node),
                **timing,
                **extra,
            }
        )
    rows.sort(key=lambda r: (-r["ms"], r["node"]))
    op_runs: dict[str, list[float]] = {}  # each op type's time in each run (its intervals)
    for r in rows:
        key = (r["node"], "") if r["owner"] == "model" else (INSERTED, r["node"])
        runs_of_op = op_runs.setdefault(r["op"], [0.0] * n_runs)
        for i, t in enumerate(per_row[key]):
            runs_of_op[i] += t
    node_ms = round(sum(r["ms"] for r in rows), 4)
    kernel_ms = round(sum(r["kernel_ms"] for r in rows), 4)
    run_ms = _ms(statistics.median(d for _, d in profiled.runs))
    measured = _ms(statistics.median(walls)) if walls else run_ms
    other = [
        {"row": name, "ms": typical(times)}
        for name, times in unowned.items()
        if walls or name != PYTHON_BINDING
    ]
    rows_ms = round(node_ms + sum(o["ms"] for o in other), 4)
    for o in other:
        o["share"] = _share(o["ms"], measured)
    attributed = sum(r["ms"] for r in rows if r["owner"] == "model")
    for r in rows:
        r["share"] = _share(r["ms"], measured)
    missed = _missed(rows, prov, measured)
    by_node = {r["node"]: r for r in rows if r["owner"] == "model"}
    for m in missed:
        for n in m["node_names"]:
            by_node[n].setdefault("missed", []).append(f"{m['rule']}: {m['code']}")
    unprofiled = _ms(statistics.median(profiled.walls)) if profiled.walls else None
    return {
        "schema": SCHEMA,
        "session": profiled.session,
        "inputs": profiled.inputs,
        "runs": n_runs,
        "run_ms": run_ms,
        "run_ms_all": [_ms(d) for _, d in profiled.runs],
        "central_runs": len(central),
        "unprofiled_run_ms": unprofiled,
        "account": {
            "measured_ms": measured,
            "measured_by": "session.run wall time" if walls else "onnxruntime's model_run",
            "measured_quartiles_ms": [_ms(q) for q in _quartiles(totals)],
            "node_ms": node_ms,
            "other": other,
            "rows_ms": rows_ms,
            "residual_ms": round(measured - rows_ms, 4),
            "residual_share": _share(measured - rows_ms, measured),
            "profiler_ms": round(measured - unprofiled, 4) if unprofiled is not None else None,
            "kernel_events": round(kernel_events / n_runs),
        },
        "kernel_ms": kernel_ms,
        "kernel_ratio": round(statistics.median(kernel_runs) / 1000.0 / run_ms, 4)
        if run_ms > 0
        else None,
        "ratio": round(rows_ms / measured, 4) if measured > 0 else None,
        "coverage": _share(attributed, node_ms),
        "run_coverage": _share(attributed, rows_ms),
        "ops": _with_intervals(_group(rows, "op", measured), op_runs),
        "regions": _group(rows, "region", measured),
        "missed": missed,
        "nodes": rows if top is None else rows[:top],
        "node_count": len(rows),
    }


#: the confidence of each op type's interval (``low_ms``, ``high_ms``): a ``gate`` against a
#: per-op baseline compares them
OP_CONFIDENCE = 0.95


def _with_intervals(groups: list[dict], op_runs: dict[str, list[float]]) -> list[dict]:
    """Each op type's distribution-free interval of its median time per run (order
    statistics over the runs; with few runs it is their whole range)."""
    from .perf import median_interval

    for g in groups:
        _, low, high = median_interval(np.asarray(op_runs[g["op"]]), OP_CONFIDENCE)
        g["low_ms"], g["high_ms"] = _ms(low), _ms(high)
    return groups


def _central(totals: list[float]) -> list[int]:
    """The half of the runs whose time lies nearest the median run's: each row's time is its
    mean over them.  Per-row medians do not add up: on a loaded machine every run is slow in
    a few nodes, different ones each time, so each node's median leaves that out and their sum
    fell to 0.55 of the median run (resnet18, 2 busy cores).  A mean over the same runs adds
    up to those runs' mean; nearest by time, not by rank, because a loaded machine's runs fall
    in two groups (a thread pool whose other thread lost its core runs 10 times slower), and
    the runs between the quartiles then mix both."""
    median = statistics.median(totals)
    order = sorted(range(len(totals)), key=lambda i: (abs(totals[i] - median), i))
    return sorted(order[: max(1, (len(order) + 1) // 2)])


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (0.0, 0.0, 0.0)
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _group(rows: list[dict], key: str, total: float) -> list[dict]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r)
    out = []
    for name, members in groups.items():
        ms = round(sum(r["ms"] for r in members), 4)
        kernel = round(sum(r["kernel_ms"] for r in members), 4)
        out.append(
            {
                key: name,
                "count": len(members),
                "ms": ms,
                "kernel_ms": kernel,
                "share": _share(ms, total),
            }
        )
    out.sort(key=lambda g: (-g["ms"], g[key]))
    return out


def _missed(rows: list[dict], prov: Provenance, total: float) -> list[dict]:
    """Missed remarks grouped by (rule, code), each with the profiled nodes it names, ranked by
    their measured time.  A node counts only under its own name: a node a remark names that a
    later rewrite fused (an attention's MatMul, missed by matmul-add-to-gemm, then part of
    MultiHeadAttention) is not time that fusion would win back."""
    by_name: dict[str, set[str]] = defaultdict(set)
    ms_of: dict[str, float] = {}
    for r in rows:
        if r["owner"] == "model":
            ms_of[r["node"]] = r["ms"]
            by_name[r["node"]].add(r["node"])
    groups: dict[tuple[str, str], dict] = {}
    for remark in prov.missed:
        hit: set[str] = set()
        for name in remark.get("nodes") or []:
            hit |= by_name.get(name, set())
        if not hit:
            continue
        key = (str(remark.get("rule")), str(remark.get("code")))
        g = groups.setdefault(
            key, {"nodes": set(), "sites": [], "message": str(remark.get("message") or "")}
        )
        g["nodes"] |= hit
        site = (remark.get("nodes") or ["?"])[0]
        if site not in g["sites"]:
            g["sites"].append(site)
    out = []
    for (rule, code), g in groups.items():
        nodes = sorted(g["nodes"], key=lambda n: (-ms_of[n], n))
        ms = round(sum(ms_of[n] for n in nodes), 4)
        out.append(
            {
                "rule": rule,
                "code": code,
                "ms": ms,
                "share": _share(ms, total),
                "nodes": len(nodes),
                "node_names": nodes,
                "regions": sorted({region_of(n) for n in nodes}),
                "sites": g["sites"],
                "message": g["message"],
            }
        )
    out.sort(key=lambda m: (-m["ms"], m["rule"], m["code"]))
    return out


def _interval(group: dict | None, ms: float) -> list[float]:
    """An op type's interval of its median time per run (``[ms, ms]`` where it did not run)."""
    if not group or "low_ms" not in group:
        return [ms, ms]
    return [group["low_ms"], group["high_ms"]]


def compare(optimized: dict, original: dict) -> dict[str, Any]:
    """Per op type, the optimized model's time against the original's (``delta_ms`` < 0: time
    won back), each with its 95 % interval, and the two runs."""
    a = {g["op"]: g for g in optimized["ops"]}
    b = {g["op"]: g for g in original["ops"]}
    rows = []
    for op in sorted(set(a) | set(b)):
        ms_a, ms_b = (a.get(op) or {}).get("ms", 0.0), (b.get(op) or {}).get("ms", 0.0)
        rows.append(
            {
                "op": op,
                "count_original": (b.get(op) or {}).get("count", 0),
                "count_optimized": (a.get(op) or {}).get("count", 0),
                "ms_original": ms_b,
                "ms_optimized": ms_a,
                "interval_original": _interval(b.get(op), ms_b),
                "interval_optimized": _interval(a.get(op), ms_a),
                "delta_ms": round(ms_a - ms_b, 4),
            }
        )
    rows.sort(key=lambda r: (r["delta_ms"], r["op"]))
    ratio = optimized["run_ms"] / original["run_ms"] if original["run_ms"] > 0 else None
    return {
        "run_ms_original": original["run_ms"],
        "run_ms_optimized": optimized["run_ms"],
        "ratio": round(ratio, 4) if ratio is not None else None,
        "ops": rows,
    }


# ------------------------------------------------------------------ the trace file
def trace(profiled: Profiled, index: ModelIndex, prov: Provenance, summary: dict) -> dict:
    """onnxruntime's trace events (Chrome trace format), kernels renamed to graphopt's node
    names and op types, with their owner and missed remarks in ``args.graphopt``."""
    missed = {r["node"]: r.get("missed", []) for r in summary["nodes"]}
    for m in summary["missed"]:
        for n in m["node_names"]:
            missed.setdefault(n, [])
            tag = f"{m['rule']}: {m['code']}"
            if tag not in missed[n]:
                missed[n].append(tag)
    events = []
    for e in profiled.events:
        name = e.get("name", "")
        if e.get("cat") != "Node" or not name.endswith(KERNEL_SUFFIX):
            events.append(e)
            continue
        kernel = name[: -len(KERNEL_SUFFIX)]
        node = index.node_of(kernel)
        args = dict(e.get("args") or {})
        if node is None:
            op = args.get("op_name", "?")
            args["graphopt"] = {"node": kernel, "op": op, "owner": INSERTED}
            events.append(e | {"name": f"{kernel} ({op})", "args": args})
            continue
        _, originals = prov.lineage(node)
        args["graphopt"] = {
            "node": node,
            "op": index.ops[node],
            "owner": "model",
            "originals": originals,
            "rule": index.rules.get(node),
            "missed": missed.get(node, []),
            "kernel": kernel,
        }
        events.append(e | {"name": f"{node} ({index.ops[node]})", "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schema": SCHEMA}}


# ------------------------------------------------------------------ the whole profile
def plain_opener(
    path: Path | None, model: onnx.ModelProto, providers: list[str] | None = None
) -> Callable[[str], tuple]:
    """A profiling session of a model file as users run it (``path`` None: ``model`` itself,
    serialized; under 2 GB): ORT_ENABLE_ALL, the CPU provider unless ``providers`` says
    otherwise."""
    from .customops import register_libraries

    providers = list(providers or ["CPUExecutionProvider"])
    name = path.name if path is not None else "the optimized model"

    def open_profiled(prefix: str):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.enable_profiling = True
        so.profile_file_prefix = prefix
        register_libraries(so, model)
        source = str(path) if path is not None else model.SerializeToString()
        try:
            sess = ort.InferenceSession(source, so, providers=providers)
        except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
            raise GraphoptError(f"onnxruntime cannot load {name}: {_first_line(e)}") from None
        return sess, {"model": name, "level": "ORT_ENABLE_ALL", "fast_path": False}

    return open_profiled


def profile(
    open_profiled: Callable[[str], tuple[ort.InferenceSession, dict]],
    model: onnx.ModelProto,
    *,
    session_model: Callable[[dict], onnx.ModelProto | None] | None = None,
    report: dict | None = None,
    feeds: dict[str, np.ndarray] | None = None,
    shapes: dict[str, list[int]] | None = None,
    runs: int = 10,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:
    """Profile ``model`` (the portable model; its session opened by ``open_profiled``) and
    return the summary, the Chrome trace and the inputs it ran on.  ``session_model(info)``:
    the file the session actually loaded, when it is not ``model`` (the bundle's fast path);
    ``report``: the bundle's report.json (owners and missed remarks)."""
    if shapes or not feeds:  # one size per dim_param across the inputs, as parity draws them
        validate_args(model, shapes, feeds)
        shapes = (candidate_shapes(model, shapes, feeds) or [shapes or {}])[0]
    profiled = run_profiled(open_profiled, feeds, shapes, runs)
    loaded = session_model(profiled.session) if session_model else None
    index = ModelIndex.of(model, loaded)
    prov = Provenance.of(report)
    summary = summarize(profiled, index, prov)
    return summary, trace(profiled, index, prov, summary), profiled.feeds
