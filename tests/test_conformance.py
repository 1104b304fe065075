"""ONNX backend node tests through graphopt: every case onnxruntime passes must still pass.

The whole suite (about 1,900 cases, two modes) runs in well under a minute, so it is part of
the default run.  ``python tests/backend_cases.py`` prints the summary table.
"""

import warnings

import pytest

from backend_cases import cases, run_case

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    CASES = cases()


@pytest.mark.parametrize("mode", ["inputs", "folded"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_backend_case(case, mode):
    outcome = run_case(case, mode)
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    assert outcome.status == "pass", outcome.detail


def test_folded_mode_folds_most_cases_to_zero_nodes():
    """With inputs as initializers, constant folding must compute (nearly) every op."""
    sample = CASES[::4]
    outcomes = [run_case(c, "folded") for c in sample]
    passed = [o for o in outcomes if o.status == "pass"]
    zero = [o for o in passed if o.nodes_after == 0]
    assert len(zero) >= 0.9 * len(passed), (len(zero), len(passed))
