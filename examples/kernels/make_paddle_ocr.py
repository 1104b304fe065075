"""Export PP-OCR (PP-OCRv3 mobile) text detection and recognition nets to ONNX via Paddle2ONNX.

What it builds (from the config dicts below, modelled on PaddleOCR's
ch_PP-OCRv3_det_student.yml and ch_PP-OCRv3_rec.yml):
  * ppocr_det: DB text detector = MobileNetV3-large x0.5 (disable_se) backbone
    + RSEFPN neck (96 ch) + DBHead (k=50); input "x" [N, 3, 640, 640],
    output the shrink (probability) map [N, 1, 640, 640].
  * ppocr_rec: SVTR_LCNet recogniser = MobileNetV1Enhance x0.5 backbone
    + SequenceEncoder "svtr" neck + CTCHead (6625 classes, softmax);
    input "x" [N, 3, 48, 320], output [N, 40, 6625].

The layers are re-written here in plain paddle.nn following PaddleOCR's
ppocr/modeling code, because no PaddleOCR wheel on PyPI (2.0 - 2.10) ships
ppocr.modeling. WEIGHTS ARE RANDOM (paddle.seed(0), KaimingNormal convs as in
PaddleOCR's rec backbone, fresh BatchNorm stats); nothing is downloaded. The
graphs are meant for runtime/kernel benchmarks, not for reading text.

Each net goes through paddle.jit.to_static + paddle.jit.save and then
paddle2onnx.export at opset 11 (the PaddleOCR default). There is no HardSwish
op before opset 14: paddle2onnx 2.1.0 writes hardswish as HardSigmoid(1/6, 0.5)
followed by Mul(x, .); SE gates are a plain HardSigmoid. LayerNorm is decomposed
(ReduceMean/Sub/Pow/Sqrt/Div). Batch dim is dynamic, the rest is fixed.

Writes DIR/ppocr_{det,rec}.onnx and DIR/ppocr_{det,rec}.json ({"inputs": {name: shape}}).

Made with Python 3.11 and: paddlepaddle 3.3.1 (CPU), paddle2onnx 2.1.0 (+ polygraphy
0.53.6, onnx_graphsurgeon 0.6.1, sympy 1.14.0 for its constant folding), onnx 1.17.0,
onnxruntime 1.32.0.

Usage: python examples/kernels/make_paddle_ocr.py --out DIR
"""

import argparse
import json
import os
import tempfile

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

DET_CONFIG = {
    "Architecture": {"model_type": "det", "algorithm": "DB"},
    "Backbone": {"name": "MobileNetV3", "scale": 0.5, "model_name": "large", "disable_se": True},
    "Neck": {"name": "RSEFPN", "out_channels": 96, "shortcut": True},
    "Head": {"name": "DBHead", "k": 50},
    "input_shape": [1, 3, 640, 640],
}
REC_CONFIG = {
    "Architecture": {"model_type": "rec", "algorithm": "SVTR_LCNet"},
    "Backbone": {
        "name": "MobileNetV1Enhance",
        "scale": 0.5,
        "last_conv_stride": [1, 2],
        "last_pool_type": "avg",
    },
    "Neck": {
        "name": "SequenceEncoder",
        "encoder_type": "svtr",
        "dims": 64,
        "depth": 2,
        "hidden_dims": 120,
        "use_guide": True,
    },
    "Head": {"name": "CTCHead", "out_channels": 6625},  # ppocr_keys_v1 + blank + space
    "input_shape": [1, 3, 48, 320],
}


def act_fn(name):
    return {"relu": F.relu, "hardswish": F.hardswish, "swish": F.swish, None: lambda x: x}[name]


class ConvBN(nn.Layer):
    """Conv2D (no bias) + BatchNorm + optional activation."""

    def __init__(self, cin, cout, k, stride=1, groups=1, act=None, padding=None):
        super().__init__()
        if padding is None:
            padding = [k[0] // 2, k[1] // 2] if isinstance(k, (list, tuple)) else k // 2
        self.conv = nn.Conv2D(
            cin,
            cout,
            k,
            stride,
            padding,
            groups=groups,
            bias_attr=False,
            weight_attr=nn.initializer.KaimingNormal(),
        )  # as in PaddleOCR
        self.bn = nn.BatchNorm2D(cout)
        self.act = act_fn(act)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class SEModule(nn.Layer):
    def __init__(self, c, reduction=4):
        super().__init__()
        self.conv1 = nn.Conv2D(c, c // reduction, 1)
        self.conv2 = nn.Conv2D(c // reduction, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        s = F.hardsigmoid(self.conv2(F.relu(self.conv1(s))))  # slope 1/6, offset 0.5
        return x * s


# ---------------------------------------------------------------- detection
def make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class ResidualUnit(nn.Layer):
    def __init__(self, cin, mid, cout, k, stride, use_se, act):
        super().__init__()
        self.shortcut = stride == 1 and cin == cout
        self.expand = ConvBN(cin, mid, 1, act=act)
        self.dw = ConvBN(mid, mid, k, stride, groups=mid, act=act)
        self.se = SEModule(mid) if use_se else None
        self.linear = ConvBN(mid, cout, 1)

    def forward(self, x):
        y = self.dw(self.expand(x))
        if self.se is not None:
            y = self.se(y)
        y = self.linear(y)
        return x + y if self.shortcut else y


class MobileNetV3(nn.Layer):
    """Detection backbone; returns the 4 feature maps at strides 4, 8, 16, 32."""

    LARGE = [  # k, exp, c, se, act, stride
        [3, 16, 16, False, "relu", 1],
        [3, 64, 24, False, "relu", 2],
        [3, 72, 24, False, "relu", 1],
        [5, 72, 40, True, "relu", 2],
        [5, 120, 40, True, "relu", 1],
        [5, 120, 40, True, "relu", 1],
        [3, 240, 80, False, "hardswish", 2],
        [3, 200, 80, False, "hardswish", 1],
        [3, 184, 80, False, "hardswish", 1],
        [3, 184, 80, False, "hardswish", 1],
        [3, 480, 112, True, "hardswish", 1],
        [3, 672, 112, True, "hardswish", 1],
        [5, 672, 160, True, "hardswish", 2],
        [5, 960, 160, True, "hardswish", 1],
        [5, 960, 160, True, "hardswish", 1],
    ]

    def __init__(self, scale=0.5, model_name="large", disable_se=False):
        super().__init__()
        assert model_name == "large"
        c = make_divisible(16 * scale)
        self.conv = ConvBN(3, c, 3, 2, act="hardswish")
        stages, blocks, self.out_channels = [], [], []
        for i, (k, exp, out, se, act, s) in enumerate(self.LARGE):
            if s == 2 and i > 2:  # close a stage before each downsampling block
                stages.append(nn.Sequential(*blocks))
                self.out_channels.append(c)
                blocks = []
            out = make_divisible(scale * out)
            blocks.append(
                ResidualUnit(c, make_divisible(scale * exp), out, k, s, se and not disable_se, act)
            )
            c = out
        last = make_divisible(scale * 960)
        blocks.append(ConvBN(c, last, 1, act="hardswish"))
        stages.append(nn.Sequential(*blocks))
        self.out_channels.append(last)
        self.stages = nn.LayerList(stages)

    def forward(self, x):
        x = self.conv(x)
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        return feats


class RSELayer(nn.Layer):
    def __init__(self, cin, cout, k, shortcut=True):
        super().__init__()
        self.conv = nn.Conv2D(cin, cout, k, padding=k // 2, bias_attr=False)
        self.se = SEModule(cout)
        self.shortcut = shortcut

    def forward(self, x):
        x = self.conv(x)
        return x + self.se(x) if self.shortcut else self.se(x)


class RSEFPN(nn.Layer):
    def __init__(self, in_channels, out_channels, shortcut=True):
        super().__init__()
        self.ins = nn.LayerList([RSELayer(c, out_channels, 1, shortcut) for c in in_channels])
        self.inp = nn.LayerList(
            [RSELayer(out_channels, out_channels // 4, 3, shortcut) for _ in in_channels]
        )
        self.out_channels = out_channels

    def forward(self, feats):
        in2, in3, in4, in5 = [conv(f) for conv, f in zip(self.ins, feats)]

        # nearest upsampling to an explicit size: paddle2onnx 2.1.0 cannot parse the f64
        # "scale" attribute that paddle 3.3 writes when scale_factor is given
        def up(t, ref):
            return F.interpolate(t, size=ref.shape[2:], mode="nearest")

        out4 = in4 + up(in5, in4)
        out3 = in3 + up(out4, in3)
        out2 = in2 + up(out3, in2)
        p5, p4, p3, p2 = (self.inp[3](in5), self.inp[2](out4), self.inp[1](out3), self.inp[0](out2))
        return paddle.concat([up(p5, p2), up(p4, p2), up(p3, p2), p2], axis=1)


class DBBranch(nn.Layer):
    def __init__(self, c):
        super().__init__()
        self.conv1 = ConvBN(c, c // 4, 3, act="relu")
        self.up1 = nn.Conv2DTranspose(c // 4, c // 4, 2, stride=2)
        self.bn = nn.BatchNorm2D(c // 4)
        self.up2 = nn.Conv2DTranspose(c // 4, 1, 2, stride=2)

    def forward(self, x):
        x = F.relu(self.bn(self.up1(self.conv1(x))))
        return F.sigmoid(self.up2(x))


class DBHead(nn.Layer):
    def __init__(self, in_channels, k=50):
        super().__init__()
        self.k = k
        self.binarize = DBBranch(in_channels)
        self.thresh = DBBranch(in_channels)  # training only

    def forward(self, x):
        shrink = self.binarize(x)
        if not self.training:
            return shrink
        thresh = self.thresh(x)
        binary = paddle.reciprocal(1 + paddle.exp(-self.k * (shrink - thresh)))
        return paddle.concat([shrink, thresh, binary], axis=1)


# -------------------------------------------------------------- recognition
class DepthwiseSeparable(nn.Layer):
    def __init__(self, cin, c1, c2, stride, scale, dw=3, use_se=False):
        super().__init__()
        c1, c2 = int(c1 * scale), int(c2 * scale)
        self.dw = ConvBN(cin, c1, dw, stride, groups=c1, act="hardswish")
        self.se = SEModule(c1) if use_se else None
        self.pw = ConvBN(c1, c2, 1, act="hardswish")

    def forward(self, x):
        x = self.dw(x)
        if self.se is not None:
            x = self.se(x)
        return self.pw(x)


class MobileNetV1Enhance(nn.Layer):
    def __init__(self, scale=0.5, last_conv_stride=1, last_pool_type="max"):
        super().__init__()
        plan = [  # c1, c2, stride, dw, se
            (32, 64, 1, 3, False),
            (64, 128, 1, 3, False),
            (128, 128, 1, 3, False),
            (128, 256, (2, 1), 3, False),
            (256, 256, 1, 3, False),
            (256, 512, (2, 1), 3, False),
            *[(512, 512, 1, 5, False)] * 5,
            (512, 1024, (2, 1), 5, True),
            (1024, 1024, tuple(last_conv_stride), 5, True),
        ]
        self.conv1 = ConvBN(3, int(32 * scale), 3, 2, act="hardswish")
        blocks, c = [], int(32 * scale)
        for c1, c2, s, dw, se in plan:
            blocks.append(DepthwiseSeparable(c, c1, c2, s, scale, dw, se))
            c = int(c2 * scale)
        self.blocks = nn.Sequential(*blocks)
        self.pool = (nn.AvgPool2D if last_pool_type == "avg" else nn.MaxPool2D)(2, 2)
        self.out_channels = c

    def forward(self, x):
        return self.pool(self.blocks(self.conv1(x)))


class Attention(nn.Layer):
    def __init__(self, dim, heads=8, qkv_bias=True):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.scale = self.hd**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias_attr=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.dim = dim

    def forward(self, x):
        qkv = self.qkv(x).reshape([0, -1, 3, self.heads, self.hd]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = F.softmax(q.matmul(k.transpose([0, 1, 3, 2])), axis=-1)
        x = attn.matmul(v).transpose([0, 2, 1, 3]).reshape([0, -1, self.dim])
        return self.proj(x)


class SVTRBlock(nn.Layer):
    """Global-mixer SVTR block, post-norm (prenorm=False), Swish MLP."""

    def __init__(self, dim, heads=8, mlp_ratio=2.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, epsilon=1e-5)
        self.mixer = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, epsilon=1e-5)
        self.fc1 = nn.Linear(dim, int(dim * mlp_ratio))
        self.fc2 = nn.Linear(int(dim * mlp_ratio), dim)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.fc2(F.swish(self.fc1(self.norm2(x))))


class SequenceEncoder(nn.Layer):
    """encoder_type 'svtr' (EncoderWithSVTR) followed by Im2Seq."""

    def __init__(
        self,
        in_channels,
        encoder_type="svtr",
        dims=64,
        depth=2,
        hidden_dims=120,
        use_guide=False,
        kernel_size=(3, 3),
    ):
        super().__init__()
        assert encoder_type == "svtr"
        c = in_channels
        self.use_guide = use_guide
        self.conv1 = ConvBN(c, c // 8, list(kernel_size), act="swish")
        self.conv2 = ConvBN(c // 8, hidden_dims, 1, act="swish")
        self.blocks = nn.LayerList([SVTRBlock(hidden_dims) for _ in range(depth)])
        self.norm = nn.LayerNorm(hidden_dims, epsilon=1e-6)
        self.conv3 = ConvBN(hidden_dims, c, 1, act="swish")
        self.conv4 = ConvBN(2 * c, c // 8, list(kernel_size), act="swish")
        self.conv1x1 = ConvBN(c // 8, dims, 1, act="swish")
        self.out_channels = dims

    def forward(self, x):
        h = x
        z = self.conv2(self.conv1(x))
        _, C, H, W = z.shape
        z = z.flatten(2).transpose([0, 2, 1])
        for blk in self.blocks:
            z = blk(z)
        z = self.norm(z).reshape([0, H, W, C]).transpose([0, 3, 1, 2])
        z = self.conv1x1(self.conv4(paddle.concat([h, self.conv3(z)], axis=1)))
        return z.squeeze(axis=2).transpose([0, 2, 1])  # Im2Seq: [N, W, C]


class CTCHead(nn.Layer):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.fc = nn.Linear(in_channels, out_channels)

    def forward(self, x):
        y = self.fc(x)
        return y if self.training else F.softmax(y, axis=2)


# ------------------------------------------------------------------ builder
REGISTRY = {
    c.__name__: c
    for c in (MobileNetV3, RSEFPN, DBHead, MobileNetV1Enhance, SequenceEncoder, CTCHead)
}


class BaseModel(nn.Layer):
    def __init__(self, config):
        super().__init__()

        def kw(part):
            return {k: v for k, v in config[part].items() if k != "name"}

        self.backbone = REGISTRY[config["Backbone"]["name"]](**kw("Backbone"))
        self.neck = REGISTRY[config["Neck"]["name"]](self.backbone.out_channels, **kw("Neck"))
        self.head = REGISTRY[config["Head"]["name"]](self.neck.out_channels, **kw("Head"))

    def forward(self, x):
        return self.head(self.neck(self.backbone(x)))


def export(config, name, out_dir, opset=11):
    # paddle2onnx forces POLYGRAPHY_AUTOINSTALL_DEPS=1 (a pip install with an extra
    # index) when these are missing; insist that they are installed beforehand.
    import onnx_graphsurgeon  # noqa: F401
    import paddle2onnx
    import sympy  # noqa: F401

    paddle.seed(0)
    model = BaseModel(config)
    model.eval()
    shape = config["input_shape"]
    spec = [paddle.static.InputSpec([None] + shape[1:], "float32", name="x")]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "inference")
        paddle.jit.save(paddle.jit.to_static(model, input_spec=spec, full_graph=True), prefix)
        model_file = prefix + (".json" if os.path.exists(prefix + ".json") else ".pdmodel")
        onnx_path = os.path.join(out_dir, name + ".onnx")
        paddle2onnx.export(
            model_file,
            prefix + ".pdiparams",
            onnx_path,
            opset_version=opset,
            auto_upgrade_opset=False,
        )
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"inputs": {"x": shape}}, f)
        f.write("\n")
    print("wrote", onnx_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--opset", type=int, default=11)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    export(DET_CONFIG, "ppocr_det", args.out, args.opset)
    export(REC_CONFIG, "ppocr_rec", args.out, args.opset)


if __name__ == "__main__":
    main()
