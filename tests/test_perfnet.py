"""The performance safety net: decisions on synthetic timings, and a model made slower on purpose
by a test-only rule, found and reverted within a stated budget."""

from __future__ import annotations

import json
import time

import numpy as np
import onnx
import pytest
from onnx import helper

import graphopt
from cli_runner import CliRunner
from conftest import const, model, ops, vi
from graphopt.cli import app
from graphopt.opt.optimizer import run_of
from graphopt.opt.rewrite.engine import Op, Rule
from graphopt.opt.rewrite.manager import RULES
from graphopt.opt.verify import perf
from graphopt.opt.verify.parity import check_parity
from graphopt.opt.verify.perf import Timing, find_slow_rules, ratio_interval

# ------------------------------------------------------------------------ synthetic timings


def timing(ratio: float, spread: float = 0.005) -> Timing:
    return Timing(ratio, ratio - spread, ratio + spread, 100, 0.1)


class Fake:
    """ratio = 1 + the effects of the rules left enabled; each measurement costs ``step`` s."""

    def __init__(self, effects: dict[str, float], base: float = 1.0, step: float = 0.0):
        self.effects, self.base, self.step = effects, base, step
        self.now, self.calls = 0.0, []

    def clock(self) -> float:
        return self.now

    def measure(self, reverted: frozenset, share: float) -> Timing:
        assert share >= 0
        self.calls.append(reverted)
        self.now += self.step
        kept = [r for r in self.effects if r not in reverted]
        return timing(self.base + sum(self.effects[r] for r in kept))

    def search(self, budget: float = 100.0, **kw):
        rules = list(self.effects)
        return find_slow_rules(rules, self.measure, budget, clock=self.clock, **kw)


def test_ratio_interval_constant_and_noisy():
    assert ratio_interval([1.25] * 40) == (1.25, 1.25, 1.25)
    rng = np.random.default_rng(1)
    r = 1.1 + rng.normal(0, 0.05, 400)
    med, low, high = ratio_interval(r)
    assert low < med < high and low > 1.08 and high < 1.12
    with pytest.raises(ValueError):
        ratio_interval([])


def test_not_slower_is_one_measurement():
    fake = Fake({"a": 0.0, "b": 0.01, "c": -0.05})
    net = fake.search()
    assert net.reverted == [] and net.stopped is None and len(fake.calls) == 1
    assert fake.calls[0] == frozenset()


def test_one_slow_rule_found_by_bisection():
    effects = {r: 0.0 for r in "abcdefgh"}
    effects["f"] = 0.3
    fake = Fake(effects)
    net = fake.search()
    assert [r for r, _ in net.reverted] == ["f"]
    assert net.first.ratio == pytest.approx(1.3) and net.final.ratio == pytest.approx(1.0)
    # first + log2(8) bisection steps + the confirmation
    assert net.measurements == len(fake.calls) == 1 + 3 + 1
    assert net.stopped is None


def test_two_slow_rules_reverted_in_turn():
    fake = Fake({"a": 0.0, "b": 0.1, "c": -0.02, "d": 0.1, "e": 0.0})
    net = fake.search()
    assert sorted(r for r, _ in net.reverted) == ["b", "d"]
    assert net.final.ratio == pytest.approx(0.98)


def test_slow_not_from_a_rule_reverts_nothing():
    fake = Fake({"a": 0.0, "b": 0.0}, base=1.2)
    net = fake.search()
    assert net.reverted == [] and "did not make it faster" in net.stopped


def test_budget_bounds_the_search():
    effects = {f"r{i}": 0.0 for i in range(64)}
    effects["r40"] = 0.5
    fake = Fake(effects, step=1.0)
    net = fake.search(budget=3.0)
    assert net.reverted == [] and "budget" in net.stopped
    assert len(fake.calls) <= 4  # the measurement under way finishes, nothing after
    assert net.seconds <= 4.0


def test_a_revert_within_noise_is_not_kept():
    """Reverting the bisection's culprit must be faster beyond both intervals, or it stays."""

    class Noisy(Fake):
        def measure(self, reverted, share):
            t = super().measure(reverted, share)
            return Timing(t.ratio, t.ratio - 0.5, t.ratio + 0.5, 20, 0.1) if reverted else t

    net = Noisy({"a": 0.2, "b": 0.2}).search()
    assert net.reverted == [] and "did not make it faster" in net.stopped


def test_bisection_is_not_fooled_by_a_little_noise():
    """A 1.05 reading with the slowdown already reverted is noise when the model ran 3x slower."""

    class Noisy(Fake):
        def measure(self, reverted, share):
            t = super().measure(reverted, share)
            return timing(t.ratio + 0.05) if t.ratio < 1.01 else t

    net = Noisy({"a": 0.0, "b": 2.0}).search()
    assert [r for r, _ in net.reverted] == ["b"]


def test_a_slow_session_does_not_revert_a_harmless_rule():
    """One fresh session may run a tiny model a few % slower throughout: what remains slower
    after a revert is confirmed in another session before a further rule is reverted."""

    class SessionBias(Fake):
        def measure(self, reverted, share):
            t = super().measure(reverted, share)
            # the bisection measures {slow} once, the revert's own measurement is the 2nd
            biased = reverted == {"slow"} and self.calls.count(reverted) == 2
            return timing(t.ratio + 0.04) if biased else t

    fake = SessionBias({"harmless": -0.01, "slow": 2.0})
    net = fake.search()
    assert [r for r, _ in net.reverted] == ["slow"] and net.stopped is None
    assert fake.calls.count(frozenset({"slow"})) == 3
    assert frozenset({"slow", "harmless"}) not in fake.calls


def test_reverts_are_bounded():
    fake = Fake({r: 0.1 for r in "abcdef"})
    net = fake.search(max_reverts=2)
    assert len(net.reverted) == 2 and "the most tried" in net.stopped


def test_summary_and_remarks_carry_the_numbers():
    fake = Fake({"a": 0.0, "slow": 0.4})
    net = fake.search()
    applied = [(1, "a", "n1"), (2, "slow", "n2"), (3, "slow", "n3")]
    s = perf.summary(net, 10.0)
    assert s["measured"] and s["reverted"][0]["rule"] == "slow"
    assert s["reverted"][0]["before"]["ratio"] == pytest.approx(1.4)
    assert {"ratio", "low", "high", "rounds", "seconds"} <= set(s)
    rs = perf.remarks(net, applied, 10.0)
    missed = [r for r in rs if r.kind == "missed"]
    assert [(r.rule, r.code, r.nodes) for r in missed] == [
        ("slow", "slower-on-target", ("n2", "n3"))
    ]
    assert "1.400x" in missed[0].message and "rounds" in missed[0].message
    assert [r.code for r in rs if r.kind == "analysis"] == ["measured"]


# ------------------------------------------------------------------------ end to end


class SlowNeg(Rule):
    """Deliberately slow but exact: Neg(x) → (0 − x) + 0·(x·W·W·…·W)."""

    name = "test-slow-neg"
    root = "Neg"
    level = 2
    summary = "deliberately slow rewrite (tests only)"
    pattern = Op("Neg", "x")
    exclusive = False
    n = 64

    def rewrite(self, m, b):
        w = np.random.default_rng(0).random((self.n, self.n)).astype(np.float32) / self.n
        chain = m.x
        for _ in range(12):
            chain = b.op("MatMul", [chain, b.const(w, "w")])
        zero = b.const(np.zeros((), np.float32), "zero")
        waste = b.op("Mul", [chain, zero])
        neg = b.op("Sub", [zero, m.x], like=m.root.outputs[0])
        return [b.op("Add", [neg, waste], like=m.root.outputs[0])]


@pytest.fixture
def slow_rule(monkeypatch):
    monkeypatch.setitem(RULES, SlowNeg.name, SlowNeg())


@pytest.fixture
def measuring(monkeypatch):
    monkeypatch.delenv("GRAPHOPT_NO_MEASURE", raising=False)
    monkeypatch.setattr(perf, "MIN_BUDGET_S", BUDGET_S)


BUDGET_S = 8.0  # generous: a loaded CI machine must not make the search run out
PIPELINE = "eliminate-identity,test-slow-neg,dce"


def slow_model():
    n = SlowNeg.n
    nodes = [
        helper.make_node("Identity", ["x"], ["i"], name="id"),
        helper.make_node("Neg", ["i"], ["n"], name="neg"),
        helper.make_node("Add", ["n", "c"], ["y"], name="add"),
    ]
    c = np.random.default_rng(2).random(n).astype(np.float32)
    return model(nodes, [vi("x", [n, n])], [vi("y", [n, n])], [const("c", c)])


def test_slow_rule_is_found_and_reverted_within_budget(slow_rule, measuring):
    m = slow_model()
    t0 = time.perf_counter()
    out, report = graphopt.optimize(m, pipeline=PIPELINE)
    measured_s = report.seconds["measure"]
    assert measured_s < BUDGET_S + 2.0  # the measurement under way may finish past the budget
    assert time.perf_counter() - t0 < 3 * BUDGET_S
    perf_ = report.performance
    assert perf_["measured"] and perf_["budget_s"] == BUDGET_S
    reverted = [r["rule"] for r in perf_["reverted"]]
    assert reverted[0] == "test-slow-neg"
    # whether the harmless rule is reverted too depends on the machine's load (a loaded 2-core
    # CI machine timed this 64x64 model a few % slower without its Identity, in two fresh
    # sessions): the noise rules are tested on synthetic timings above
    assert set(reverted) <= {"test-slow-neg", "eliminate-identity"}
    assert perf_["reverted"][0]["before"]["low"] > 1 + perf.MARGIN
    # the 8-10x slowdown is gone (the tiny model's own ratio is within a few % of 1: how few
    # depends on the machine's load, so only "far from the slow one" is asserted)
    assert perf_["ratio"] < 1.2 and perf_["high"] < perf_["reverted"][0]["before"]["low"]
    # the slow rewrite is gone, the harmless one stays, parity holds on the final model
    identity = {"Identity": 1} if "eliminate-identity" in reverted else {}
    assert ops(out) == {"Neg": 1, "Add": 1, **identity}
    assert report.parity.ok and check_parity(m, out).ok
    missed = [
        r for r in report.remarks if r.code == "slower-on-target" and r.rule == "test-slow-neg"
    ]
    assert [(r.kind, r.rule, r.nodes) for r in missed] == [("missed", "test-slow-neg", ("neg",))]
    assert "x the original" in missed[0].message
    assert report.to_dict()["performance"] == perf_
    assert not any(rule == "test-slow-neg" for _, rule, _ in report.applied)


def test_off_switches_and_targets_not_here(monkeypatch, slow_rule):
    m = slow_model()
    _, report = graphopt.optimize(m, pipeline=PIPELINE)
    assert report.performance == {"measured": False, "why": "turned off by GRAPHOPT_NO_MEASURE"}
    monkeypatch.delenv("GRAPHOPT_NO_MEASURE")
    _, report = graphopt.optimize(m, pipeline=PIPELINE, measure=False)
    assert "--no-measure" in report.performance["why"]
    _, report = graphopt.optimize(m, pipeline=PIPELINE, check=False)
    assert "--no-check" in report.performance["why"]
    _, report = graphopt.optimize(m, pipeline=PIPELINE, target="cuda")
    assert not report.performance["measured"]
    assert "cuda target's device is not measured here" in report.performance["why"]


def test_cli_no_measure_and_manifest(tmp_path, monkeypatch, slow_rule):
    monkeypatch.delenv("GRAPHOPT_NO_MEASURE")
    src = tmp_path / "m.onnx"
    src.write_bytes(slow_model().SerializeToString())
    out = tmp_path / "b"
    args = ["optimize", str(src), "-o", str(out), "--pipeline", PIPELINE, "--no-measure"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert report["performance"]["measured"] is False
    assert manifest["performance"] == report["performance"]


def test_bisect_runs_do_not_time(monkeypatch, slow_rule):
    """graphopt bisect is a parity search: its optimize runs never start the net."""
    from graphopt.opt.bisect import bisect

    def no_duel(*_a, **_k):
        raise AssertionError("bisect started the performance safety net")

    monkeypatch.delenv("GRAPHOPT_NO_MEASURE")
    monkeypatch.setattr(perf, "Duel", no_duel)
    result = bisect(slow_model(), pipeline=PIPELINE)
    assert not result.found and result.parity_runs == 1


def test_a_suspect_first_measurement_is_extended_and_pooled():
    """Slower by its median, not beyond noise: a second measurement, pooled with the first."""
    spans = [(0.90, 1.16, 11), (1.025, 1.035, 41)]  # noisy, then a quieter machine
    calls = []

    def measure(reverted: frozenset, share: float) -> Timing:
        calls.append(reverted)
        samples = tuple(np.linspace(*spans[min(len(calls), 2) - 1]))
        med, low, high = ratio_interval(samples)
        return Timing(med, low, high, len(samples), 0.1, samples)

    first = measure(frozenset(), 1.0)
    assert first.suspect() and not first.slower()
    calls.clear()
    net = find_slow_rules([], measure, 10.0)
    assert calls == [frozenset(), frozenset()] and net.measurements == 2
    assert net.first.rounds == 52 and net.first.slower()
    assert "not from a rewrite" in net.stopped  # no rule fired: nothing to revert


def _saving_sessions(monkeypatch):
    """Every bundle session made to save onnxruntime's optimized graph (the fast path)."""
    from graphopt.targets import bundle

    calls = []
    session = bundle._session

    def traced(*args, **kw):
        save_to = args[7] if len(args) > 7 else kw.get("save_to")
        if save_to is not None:
            calls.append(save_to)
        return session(*args, **kw)

    monkeypatch.setattr(bundle, "_session", traced)
    return calls


def test_the_session_that_timed_the_final_model_saved_its_fast_path(
    measuring, monkeypatch, tmp_path
):
    from graphopt.targets import bundle

    saving = _saving_sessions(monkeypatch)
    # no rule to revert: the model timed first is the model returned, however noisy the timing
    out, report = graphopt.optimize(slow_model(), pipeline="dce")
    assert report.performance["measured"] and not report.performance["reverted"]
    presaved = run_of(report).context["fast_path"]
    assert presaved.model is out and presaved.path.is_file()
    written = graphopt.write_bundle(out, report, tmp_path / "b")
    fast = json.loads((written / "manifest.json").read_text())["fast_path"]
    assert fast["written"] and fast["verified"]["ok"] and fast["saved_by"] == bundle.PRESAVED_BY
    assert saving == []  # the bundle built no session of its own to save it
    assert not presaved.path.exists()  # moved into the bundle, nothing left behind
    sess, how = graphopt.open_session(written)
    assert how["fast_path"] and how["model"] == bundle.FAST_MODEL


def test_the_bundle_checks_the_fast_path_on_the_outputs_the_net_timed(
    measuring, monkeypatch, tmp_path
):
    """The net timed the fast path loaded back as it deploys: the bundle checks that session's
    outputs on the golden inputs; its one session loads the fast path from the bundle's own
    files, not run (none of model.onnx)."""
    from graphopt.targets import bundle

    out, report = graphopt.optimize(slow_model(), pipeline="dce")
    presaved = run_of(report).context["fast_path"]
    assert presaved.outputs is not None and presaved.feeds is report.parity.feeds
    sessions, session = [], bundle._session

    class NotRun:
        def __init__(self, sess):
            self.sess = sess

    def traced(*a, **k):
        sessions.append((a[3], k.get("once")))
        return NotRun(session(*a, **k))  # running it fails: nothing runs it

    monkeypatch.setattr(bundle, "_session", traced)
    written = graphopt.write_bundle(out, report, tmp_path / "b")
    manifest = json.loads((written / "manifest.json").read_text())
    assert sessions == [(bundle.FAST_MODEL, True)]
    fast, seen = manifest["fast_path"], manifest["verified"]["bundle_session"]
    assert fast["written"] and fast["verified"]["ok"]
    assert bundle.NET_RUN in fast["verified"]["against"]
    assert seen["golden_ok"] and bundle.NET_RUN in seen["what"]
    assert manifest["verified"]["deploy_parity"]["ok"]
    assert manifest["latency"]["session_create_ms"] > 0  # the fast path's load, as deployed
    monkeypatch.undo()
    sess, how = graphopt.open_session(written)
    assert how["fast_path"]


def test_a_fast_path_that_does_not_reload_from_the_bundle_goes(measuring, monkeypatch, tmp_path):
    from graphopt.opt.errors import GraphoptError
    from graphopt.targets import bundle

    out, report = graphopt.optimize(slow_model(), pipeline="dce")
    session = bundle._session

    def refuse(*a, **k):
        if a[3] == bundle.FAST_MODEL:
            raise GraphoptError("onnxruntime cannot load the bundle: no")
        return session(*a, **k)

    monkeypatch.setattr(bundle, "_session", refuse)
    written = graphopt.write_bundle(out, report, tmp_path / "b")
    manifest = json.loads((written / "manifest.json").read_text())
    assert not manifest["fast_path"]["written"]
    assert "could not reload it from the bundle" in manifest["fast_path"]["why"]
    assert manifest["verified"]["bundle_session"]["golden_ok"]  # the portable model ran instead
    assert not (written / bundle.FAST_MODEL).exists()


def test_fast_path_outputs_off_the_golden_ones_fall_back_to_the_portable_model(
    measuring, monkeypatch, tmp_path
):
    out, report = graphopt.optimize(slow_model(), pipeline="dce")
    presaved = run_of(report).context["fast_path"]
    presaved.outputs = {k: v + 1.0 for k, v in presaved.outputs.items()}  # a wrong fast path
    written = graphopt.write_bundle(out, report, tmp_path / "b")
    manifest = json.loads((written / "manifest.json").read_text())
    assert not manifest["fast_path"]["written"]
    assert "differ from the portable model's" in manifest["fast_path"]["why"]
    assert manifest["verified"]["bundle_session"]["golden_ok"]  # the portable model ran instead
    sess, how = graphopt.open_session(written)
    assert not how["fast_path"]


def test_a_fast_path_saved_for_another_model_is_not_used(measuring, monkeypatch, tmp_path):
    from graphopt.targets import bundle

    saving = _saving_sessions(monkeypatch)
    out, report = graphopt.optimize(slow_model(), pipeline="dce")
    assert run_of(report).context["fast_path"].model is out
    changed = type(out)()
    changed.CopyFrom(out)  # another model object (a caller's edited copy)
    written = graphopt.write_bundle(changed, report, tmp_path / "b")
    fast = json.loads((written / "manifest.json").read_text())["fast_path"]
    assert fast["written"] and fast["saved_by"] == bundle.SAVED_BY
    assert len(saving) == 1  # its own session saved it


def test_the_fast_path_is_the_final_models_after_a_revert(
    slow_rule, measuring, monkeypatch, tmp_path
):
    from graphopt.targets import bundle

    out, report = graphopt.optimize(slow_model(), pipeline=PIPELINE)
    assert "test-slow-neg" in [r["rule"] for r in report.performance["reverted"]]
    presaved = run_of(report).context["fast_path"]
    assert presaved is None or presaved.model is out
    written = graphopt.write_bundle(out, report, tmp_path / "b")
    fast = json.loads((written / "manifest.json").read_text())["fast_path"]
    assert fast["written"] and fast["verified"]["ok"]
    saved = onnx.load(str(written / bundle.FAST_MODEL), load_external_data=False)
    assert "MatMul" not in {n.op_type for n in saved.graph.node}  # not the slow candidate's


def test_the_timed_model_is_loaded_as_the_validity_check_wrote_it(measuring, monkeypatch):
    serialized = []
    real = perf.serialize
    monkeypatch.setattr(perf, "serialize", lambda m: serialized.append(m) or real(m))
    out, report = graphopt.optimize(slow_model(), pipeline="dce")
    assert report.performance["measured"]
    assert serialized and all(m is not out for m in serialized)  # the original's only


def test_a_model_with_external_data_is_timed(measuring, tmp_path):
    """Its output is not spooled (its weights stay in their data file): the safety net loads the
    bytes the validity check held, the weights resolved beside the input."""
    src = tmp_path / "m.onnx"
    onnx.save(slow_model(), src, save_as_external_data=True, location="m.data", size_threshold=0)
    out, report = graphopt.optimize(src, pipeline="dce")
    assert report.performance["measured"], report.performance
