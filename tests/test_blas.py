"""OpenBLAS at one thread while the passes run, its count restored after."""

from __future__ import annotations

import threading

import pytest

from graphopt.opt import blas


@pytest.fixture
def openblas():
    lib = blas._openblas()
    if lib is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS")
    get, put = lib
    before = get()
    put(2)
    yield get
    put(before)


def test_one_thread_inside_the_block_and_the_count_restored(openblas):
    with blas.one_blas_thread():
        assert openblas() == 1
        with blas.one_blas_thread():  # nested: still one, and not restored by the inner block
            assert openblas() == 1
        assert openblas() == 1
    assert openblas() == 2


def test_restored_after_an_exception_and_across_threads(openblas):
    with pytest.raises(ValueError), blas.one_blas_thread():
        raise ValueError("inside")
    assert openblas() == 2
    inside, go = threading.Event(), threading.Event()

    def other():
        with blas.one_blas_thread():
            inside.set()
            go.wait(5)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    with blas.one_blas_thread():
        pass
    assert openblas() == 1  # the other thread's block still runs
    go.set()
    t.join()
    assert openblas() == 2


def test_the_passes_run_with_one_blas_thread(openblas, monkeypatch):
    import numpy as np
    from onnx import helper

    import graphopt
    from conftest import const, model, vi
    from graphopt.opt import precision

    seen = []
    probe = precision.refold_probe

    def traced(*args, **kw):
        seen.append(openblas())
        return probe(*args, **kw)

    monkeypatch.setattr("graphopt.rules.conv.refold_probe", traced)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float16)
    stats = [rng.uniform(0.5, 2, 8).astype(np.float16) for _ in range(4)]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["y", "g", "b", "m", "v"], ["z"]),
    ]
    names = ["g", "b", "m", "v"]
    m = model(
        nodes,
        [vi("x", [1, 4, 8, 8], 10)],
        [vi("z", [1, 8, 8, 8], 10)],
        [const("w", w, np.float16)] + [const(n, s, np.float16) for n, s in zip(names, stats)],
    )
    graphopt.optimize(m, target="cpu", check=False)
    assert seen and set(seen) == {1}
    assert openblas() == 2
