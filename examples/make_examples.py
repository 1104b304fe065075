"""Write the three small example models committed in examples/.

    .venv-torch/bin/python examples/make_examples.py [--out examples]

mobilenet_bn.onnx  MobileNetV2/V3-style CNN, Conv->BatchNormalization pairs kept, [N,3,64,64]
bert_tiny.onnx     transformers BertModel, 2 layers, hidden 128, [batch, seq] int64 inputs
esrgan_tiny.onnx   ESRGAN-style super-resolution, x2 PixelShuffle spelled
                   Reshape->Transpose->Reshape

All TorchScript exporter (dynamo=False), opset 17, seeded random weights, dynamic batch axis.
Each is checked with onnx.checker and run in onnxruntime against torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from export_utils import (
    Net,
    Wrapper,
    check_model,
    export_torchscript,
    image_inputs,
    model_size,
    perturb_constant_params,
    quiet_warnings,
    randomize_batchnorm,
    seed_all,
    seed_for,
    summarize,
    text_inputs,
    verify,
    write_shapes,
)
from torch import nn

# ---------------------------------------------------------------------------- MobileNet


def _activation(kind: str) -> nn.Module:
    return {"relu6": nn.ReLU6, "hswish": nn.Hardswish}[kind]()


def conv_bn_act(
    cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: str | None = None
):
    layers = [
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act:
        layers.append(_activation(act))
    return nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduction: int = 4):
        super().__init__()
        hidden = max(8, channels // reduction)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, hidden, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(hidden, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class InvertedResidual(nn.Module):
    """1x1 expand -> kxk depthwise -> (SE) -> 1x1 project, residual when shapes allow."""

    def __init__(self, cin: int, expand: int, cout: int, k: int, stride: int, se: bool, act: str):
        super().__init__()
        layers = []
        if expand != cin:
            layers.append(conv_bn_act(cin, expand, 1, act=act))
        layers.append(conv_bn_act(expand, expand, k, stride, groups=expand, act=act))
        if se:
            layers.append(SqueezeExcite(expand))
        layers.append(conv_bn_act(expand, cout, 1))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class TinyMobileNet(nn.Module):
    # in, expand, out, kernel, stride, SE, activation
    BLOCKS = [
        (16, 16, 16, 3, 2, True, "relu6"),
        (16, 64, 24, 3, 2, False, "relu6"),
        (24, 72, 24, 3, 1, False, "relu6"),
        (24, 96, 40, 5, 2, True, "hswish"),
        (40, 240, 40, 5, 1, True, "hswish"),
        (40, 120, 48, 5, 1, True, "hswish"),
    ]

    def __init__(self, num_classes: int = 100):
        super().__init__()
        self.stem = conv_bn_act(3, 16, 3, 2, act="hswish")
        self.blocks = nn.Sequential(*(InvertedResidual(*cfg) for cfg in self.BLOCKS))
        self.head_conv = conv_bn_act(48, 288, 1, act="hswish")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(288, 256), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(256, num_classes)
        )

    def forward(self, x):
        x = self.pool(self.head_conv(self.blocks(self.stem(x))))
        return self.classifier(torch.flatten(x, 1))


# ---------------------------------------------------------------------------- ESRGAN


class ResidualDenseBlock(nn.Module):
    """Five 3x3 convs with dense connections, LeakyReLU, scaled residual."""

    def __init__(self, nf: int, gc: int):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(nf + i * gc, gc if i < 4 else nf, 3, 1, 1) for i in range(5)
        )
        self.lrelu = nn.LeakyReLU(0.2)

    def forward(self, x):
        feats = [x]
        for conv in self.convs[:-1]:
            feats.append(self.lrelu(conv(torch.cat(feats, 1))))
        return x + 0.2 * self.convs[-1](torch.cat(feats, 1))


class RRDB(nn.Module):
    """Residual-in-residual dense block (three dense blocks)."""

    def __init__(self, nf: int, gc: int):
        super().__init__()
        self.rdbs = nn.Sequential(*(ResidualDenseBlock(nf, gc) for _ in range(3)))

    def forward(self, x):
        return x + 0.2 * self.rdbs(x)


class PixelShuffleCRD(nn.Module):
    """nn.PixelShuffle written with view/permute, as many hand-written models do, so the
    graph holds Reshape -> Transpose -> Reshape instead of DepthToSpace. Channel, height and
    width are taken as constants at trace time; the batch axis stays dynamic (-1)."""

    def __init__(self, r: int):
        super().__init__()
        self.r = r

    def forward(self, x):
        r = self.r
        c, h, w = (int(d) for d in x.shape[1:])
        x = x.reshape(-1, c // (r * r), r, r, h, w).permute(0, 1, 4, 2, 5, 3)
        return x.reshape(-1, c // (r * r), h * r, w * r)


class ESRGAN(nn.Module):
    """RRDB trunk, then `scale` = 2**k upsampling by k (conv, pixel shuffle x2, LeakyReLU)."""

    def __init__(self, nf: int = 32, gc: int = 16, nb: int = 2, scale: int = 2):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*(RRDB(nf, gc) for _ in range(nb)))
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        stages = []
        for _ in range(scale.bit_length() - 1):
            stages += [nn.Conv2d(nf, nf * 4, 3, 1, 1), PixelShuffleCRD(2), nn.LeakyReLU(0.2)]
        self.upsample = nn.Sequential(*stages)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.upsample(feat)
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


def check_pixel_shuffle() -> None:
    x = torch.randn(2, 16, 5, 7)
    assert torch.equal(PixelShuffleCRD(2)(x), nn.PixelShuffle(2)(x)), "CRD spelling mismatch"


# ---------------------------------------------------------------------------- builders


def image_net(module: nn.Module, size: int, output: str, export_batch: int = 2) -> Net:
    return Net(
        module=module,
        inputs=image_inputs(3, size),
        output_names=[output],
        dynamic_axes={"input": {0: "batch"}, output: {0: "batch"}},
        export_shape=(export_batch, 0),
        test_shape=(1, 0),
        alt_shape=(2, 0),
    )


def build_mobilenet_bn() -> Net:
    model = TinyMobileNet()
    perturb_constant_params(model)
    randomize_batchnorm(model, lambda: torch.randn(16, 3, 64, 64), passes=3)
    return image_net(model, 64, "logits")


def build_bert_tiny() -> Net:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=2,
        intermediate_size=512,
        vocab_size=1000,
    )
    model = BertModel(config)
    perturb_constant_params(model)
    names = ["input_ids", "attention_mask"]
    return Net(
        module=Wrapper(model, names, ["last_hidden_state", "pooler_output"]),
        inputs=text_inputs(config.vocab_size, tuple(names)),
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "seq"},
            "attention_mask": {0: "batch", 1: "seq"},
            "last_hidden_state": {0: "batch", 1: "seq"},
            "pooler_output": {0: "batch"},
        },
    )


def build_esrgan_tiny() -> Net:
    check_pixel_shuffle()
    model = ESRGAN(nf=32, gc=16, nb=2, scale=2)
    perturb_constant_params(model)
    return image_net(model.eval(), 32, "output", export_batch=1)


EXAMPLES = {
    # name: (builder, keep BatchNormalization nodes)
    "mobilenet_bn": (build_mobilenet_bn, True),
    "bert_tiny": (build_bert_tiny, False),
    "esrgan_tiny": (build_esrgan_tiny, False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    quiet_warnings()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    failed = []
    rows = []
    for name, (build, keep_bn) in EXAMPLES.items():
        path = os.path.join(args.out, name + ".onnx")
        start = time.time()
        try:
            seed_all(seed_for(name))
            net = build()
            export_torchscript(net, path, opset=17, keep_bn=keep_bn)
            check_model(path)
            errors = verify(path, net, tolerance=1e-4)
            write_shapes(path, net)
        except Exception as exc:  # report and continue with the next model
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        nodes, top = summarize(path)
        rows.append((name, nodes, model_size(path), time.time() - start, errors, top))

    print(f"{'name':<14} {'nodes':>6} {'size KB':>9} {'sec':>6}  rel.err(test/alt)  top ops")
    for name, nodes, size, secs, errors, top in rows:
        err = "/".join(f"{v:.1e}" for v in errors.values())
        ops = ", ".join(f"{op} {n}" for op, n in top)
        print(f"{name:<14} {nodes:>6} {size / 1024:>9.0f} {secs:>6.1f}  {err:<17}  {ops}")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
