"""A GPT-style decoder with multi-GB external weights, written tensor by tensor (no torch).

The graph is spelled as exporters spell GPT-2 (opset 18): decomposed
LayerNorm, erf GELU, MatMul + bias Add linear layers, and attention through Reshape/Transpose,
MatMul, scale Div, a causal mask Add and Softmax.  Weights are random (seeded) and stream into
one external-data file (4 KiB aligned), so memory stays small while writing.

    python examples/large/make_gpt_decoder.py --out gpt_big/model.onnx   # ~5 GB
    python examples/large/make_gpt_decoder.py --out small/model.onnx --layers 2 --hidden 256
    python examples/large/make_gpt_decoder.py --out tied/model.onnx --tied   # 4.76 GiB

``--tied`` writes the LM head as GPT-2 ties it, ``MatMul(x, Transpose(wte))`` on the token
embedding the Gather reads, instead of a separate ``lm_head`` weight.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper


class Writer:
    """Appends tensors to an external-data file and returns initializers pointing into it."""

    def __init__(self, data_path: Path, seed: int):
        self.f = open(data_path, "wb")
        self.location = data_path.name
        self.rng = np.random.default_rng(seed)
        self.inits: list[onnx.TensorProto] = []

    def add(self, name: str, value: np.ndarray) -> str:
        value = np.ascontiguousarray(value, dtype=np.float32) if value.dtype.kind == "f" else value
        self.f.write(b"\0" * ((-self.f.tell()) % 4096))
        offset = self.f.tell()
        self.f.write(value.tobytes())
        t = onnx.TensorProto(
            name=name,
            dims=list(value.shape),
            data_type=helper.np_dtype_to_tensor_dtype(value.dtype),
        )
        t.data_location = TensorProto.EXTERNAL
        for k, v in (
            ("location", self.location),
            ("offset", str(offset)),
            ("length", str(value.nbytes)),
        ):
            t.external_data.add(key=k, value=v)
        self.inits.append(t)
        return name

    def random(self, name: str, shape: tuple[int, ...], scale: float = 0.02) -> str:
        out = np.empty(shape, np.float32)
        flat = out.reshape(-1)
        step = 1 << 24
        for i in range(0, flat.size, step):  # bounded temporaries
            flat[i : i + step] = self.rng.standard_normal(min(step, flat.size - i)) * scale
        return self.add(name, out)

    def small(self, name: str, value) -> str:
        t = onnx.numpy_helper.from_array(np.asarray(value), name)
        self.inits.append(t)
        return name


def build(
    out: Path, layers: int, hidden: int, heads: int, vocab: int, seed: int, tied: bool = False
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    w = Writer(out.with_name(out.stem + ".data"), seed)
    n = helper.make_node
    nodes: list[onnx.NodeProto] = []
    d, hd = hidden, hidden // heads
    w.small("axes_last", np.array([-1], np.int64))
    w.small("eps", np.array(1e-5, np.float32))
    w.small("two", np.array(2.0, np.float32))
    w.small("sqrt2", np.array(1.4142135, np.float32))
    w.small("one", np.array(1.0, np.float32))
    w.small("half", np.array(0.5, np.float32))
    w.small("scale", np.array(np.sqrt(hd), np.float32))
    w.small("heads_shape", np.array([0, 0, heads, hd], np.int64))
    w.small("merge_shape", np.array([0, 0, d], np.int64))
    wte = w.random("wte", (vocab, d))
    w.random("wpe", (1024, d))
    nodes += [
        n("Gather", [wte, "input_ids"], ["tok"]),
        n("Shape", ["input_ids"], ["ids_shape"]),
        n("Gather", ["ids_shape", "i1"], ["seq"], axis=0),
        n("Range", ["i0", "seq", "i1"], ["pos"]),
        n("Gather", ["wpe", "pos"], ["posemb"]),
        n("Add", ["tok", "posemb"], ["h0"]),
        # causal mask [seq, seq]: 0 on/below the diagonal, -1e4 above
        n("Unsqueeze", ["seq", "axes0"], ["seq1"]),
        n("Concat", ["seq1", "seq1"], ["mask_shape"], axis=0),
        n(
            "ConstantOfShape",
            ["mask_shape"],
            ["ones"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
        ),
        n("Trilu", ["ones"], ["tri"], upper=0),
        n("Sub", ["one", "tri"], ["inv"]),
        n("Mul", ["inv", "neg"], ["causal"]),
    ]
    w.small("i0", np.array(0, np.int64))
    w.small("i1", np.array(1, np.int64))
    w.small("axes0", np.array([0], np.int64))
    w.small("neg", np.array(-10000.0, np.float32))

    def layernorm(x: str, p: str) -> str:
        g = w.add(p + "g", np.ones(d, np.float32))
        b = w.add(p + "b", np.zeros(d, np.float32))
        nodes.extend(
            [
                n("ReduceMean", [x, "axes_last"], [p + "mu"]),
                n("Sub", [x, p + "mu"], [p + "dx"]),
                n("Pow", [p + "dx", "two"], [p + "sq"]),
                n("ReduceMean", [p + "sq", "axes_last"], [p + "var"]),
                n("Add", [p + "var", "eps"], [p + "ve"]),
                n("Sqrt", [p + "ve"], [p + "sd"]),
                n("Div", [p + "dx", p + "sd"], [p + "nx"]),
                n("Mul", [p + "nx", g], [p + "sx"]),
                n("Add", [p + "sx", b], [p + "out"]),
            ]
        )
        return p + "out"

    def linear(x: str, p: str, k: int, m: int) -> str:
        wt = w.random(p + "w", (k, m))
        bias = w.add(p + "bias", np.zeros(m, np.float32))
        nodes.extend([n("MatMul", [x, wt], [p + "mm"]), n("Add", [p + "mm", bias], [p + "out"])])
        return p + "out"

    h = "h0"
    for i in range(layers):
        p = f"l{i}_"
        a = layernorm(h, p + "ln1_")
        q = linear(a, p + "q_", d, d)
        k = linear(a, p + "k_", d, d)
        v = linear(a, p + "v_", d, d)
        for name in (q, k, v):
            nodes.append(n("Reshape", [name, "heads_shape"], [name + "_h"]))
        nodes += [
            n("Transpose", [q + "_h"], [p + "qt"], perm=[0, 2, 1, 3]),
            n("Transpose", [k + "_h"], [p + "kt"], perm=[0, 2, 3, 1]),
            n("Transpose", [v + "_h"], [p + "vt"], perm=[0, 2, 1, 3]),
            n("MatMul", [p + "qt", p + "kt"], [p + "qk"]),
            n("Div", [p + "qk", "scale"], [p + "qks"]),
            n("Add", [p + "qks", "causal"], [p + "qkm"]),
            n("Softmax", [p + "qkm"], [p + "probs"], axis=-1),
            n("MatMul", [p + "probs", p + "vt"], [p + "ctx"]),
            n("Transpose", [p + "ctx"], [p + "ctxt"], perm=[0, 2, 1, 3]),
            n("Reshape", [p + "ctxt", "merge_shape"], [p + "merged"]),
        ]
        o = linear(p + "merged", p + "o_", d, d)
        nodes.append(n("Add", [h, o], [p + "res1"]))
        f = layernorm(p + "res1", p + "ln2_")
        up = linear(f, p + "up_", d, 4 * d)
        nodes += [
            n("Div", [up, "sqrt2"], [p + "gd"]),
            n("Erf", [p + "gd"], [p + "ge"]),
            n("Add", [p + "ge", "one"], [p + "ga"]),
            n("Mul", [up, p + "ga"], [p + "gm"]),
            n("Mul", [p + "gm", "half"], [p + "gelu"]),
        ]
        down = linear(p + "gelu", p + "down_", 4 * d, d)
        nodes.append(n("Add", [p + "res1", down], [p + "res2"]))
        h = p + "res2"
    final = layernorm(h, "lnf_")
    if tied:  # the LM head reads the token embedding transposed: one tensor, two readers
        nodes.append(n("Transpose", [wte], ["wte_t"], name="lm_head/transpose", perm=[1, 0]))
        nodes.append(n("MatMul", [final, "wte_t"], ["logits"], name="lm_head/matmul"))
    else:
        nodes.append(n("MatMul", [final, "lm_head"], ["logits"]))
        w.random("lm_head", (d, vocab))
    w.f.close()
    graph = helper.make_graph(
        nodes,
        "gpt_decoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])],
        w.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    with open(out, "wb") as f:
        f.write(model.SerializeToString())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tied",
        action="store_true",
        help="LM head MatMul(x, Transpose(wte)) sharing the token embedding",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    build(args.out, args.layers, args.hidden, args.heads, args.vocab, args.seed, args.tied)
    size = sum(p.stat().st_size for p in args.out.parent.glob(args.out.stem + "*"))
    print(
        f"{args.out}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f}s (pid {os.getpid()})"
    )


if __name__ == "__main__":
    main()
