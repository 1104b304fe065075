"""Every flag of the ``graphopt`` command line, declared once: its names, help, bounds and type.

A command in :mod:`graphopt.cli` names its parameters with these types (``target: Target =
"cpu"``), so a flag shared by several commands reads and behaves the same in each.  Numbers that
the command line cannot bound (finite floats, ``--max-regression``) are checked by the command.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

from typer import Option

#: the targets ``--target`` takes, for its help (the profiles register themselves on first use;
#: a test checks this list against them)
TARGET_NAMES = ("cpu", "cuda", "tensorrt", "npu")
#: ``--debug`` anywhere on the command line: errors show their traceback.
STATE = {"debug": False}
MAX_THREADS = 1024
#: the most runs ``bench --runs``/``--warmup`` and ``run --repeat`` take: a count past it is a
#: typo (10**12 runs of a 1 ms model: 30 years), refused with exit 2
MAX_RUNS = 10**6


class Format(str, Enum):
    text = "text"
    json = "json"


class Verify(str, Enum):
    fingerprint = "fingerprint"
    full = "full"
    none = "none"


class Reference(str, Enum):
    original = "original"
    float64 = "float64"
    both = "both"


class DecoderSteps(str, Enum):
    generate = "generate"


class WeightFormat(str, Enum):
    int4 = "int4"
    int4_zp = "int4-zp"


def _set_debug(value: bool) -> bool:
    """``--debug`` after the command name: the same switch as before it."""
    if value:
        STATE["debug"] = True
    return value


# ------------------------------------------------------------------ shared by several commands
FORMAT = Option("--format", help="text or json (json: one document on stdout).")
TARGET = Option("--target", "-t", help=f"Target: {', '.join(TARGET_NAMES)}.")
DEBUG = Option(
    "--debug", help="Show tracebacks (also accepted before the command).", callback=_set_debug
)
SEED = Option("--seed", min=0, help="Seed of random parity inputs (>= 0).")
SHAPE = Option(
    "--shape",
    help="NAME=D0,D1,... sizes of an input's dynamic dims for the random inputs (repeatable).",
)
INPUTS = Option(
    "--inputs", help="Real inputs: an .npz (one array per input name) or an .npy (one input)."
)
QUIET_PROGRESS = Option("--quiet", "-q", help="No progress lines on stderr.")
TOLERANCE_HELP = "OUTPUT=RTOL,ATOL overriding the dtype default."

Fmt = Annotated[Format, FORMAT]
Debug = Annotated[bool, DEBUG]
Target = Annotated[str, TARGET]
Seed = Annotated[int, SEED]
Shapes = Annotated[list[str] | None, SHAPE]
Inputs = Annotated[Path | None, INPUTS]
Quiet = Annotated[bool, QUIET_PROGRESS]
Level = Annotated[int, Option("-O", "--level", min=0, max=3)]
Pipeline = Annotated[str | None, Option("--pipeline")]
PipelineText = Annotated[str | None, Option("--pipeline", help="Pipeline text (overrides -O).")]
Tolerances = Annotated[list[str] | None, Option("--tolerance", help=TOLERANCE_HELP)]
JUnit = Annotated[Path | None, Option("--junit", help="Write JUnit XML.")]
Threads = Annotated[int, Option("--threads", min=1, max=MAX_THREADS, help="intra-op threads.")]

# ------------------------------------------------------------------ optimize
BundleDir = Annotated[
    Path | None,
    Option(
        "-o",
        "--output",
        help="Output directory (default: <stem>.<target>.graphopt beside the input).",
    ),
]
OptLevel = Annotated[
    int,
    Option(
        "-O",
        "--level",
        min=0,
        max=3,
        help="0 none, 1 exact cleanups, 2 standard fusions, 3 guarded numerics-changing.",
    ),
]
ParityShapes = Annotated[
    list[str] | None, Option("--shape", help="NAME=D0,D1,... for parity inputs.")
]
ParityInputs = Annotated[Path | None, Option("--inputs", help=".npz of inputs for parity.")]
NoCheck = Annotated[bool, Option("--no-check", help="Skip the parity check.")]
NoMeasure = Annotated[
    bool, Option("--no-measure", help="Skip timing the bundle against the original (cpu).")
]
KeepInitializerInputs = Annotated[
    bool,
    Option(
        "--keep-initializer-inputs",
        help="Keep weights an export listed as graph inputs overridable (not folded).",
    ),
]
BisectLimit = Annotated[
    int | None,
    Option("--bisect-limit", min=0, help="Apply only the first N rewrites (opt-bisect)."),
]
VerifyEach = Annotated[bool, Option("--verify-each", help="Check the model after every pass.")]
FoldSizeLimit = Annotated[
    float,
    Option("--fold-size-limit", help="MiB a folded constant may grow to (finite, >= 0)."),
]
RemarksOut = Annotated[Path | None, Option("--remarks", help="Write remarks as JSONL.")]
ParityReference = Annotated[
    Reference,
    Option("--reference", help="Parity vs the original, its float64 upcast, or both."),
]
Expect = Annotated[
    list[str] | None,
    Option("--expect", help='Op-count assertions, e.g. "LayerNormalization>=25" (exit 4).'),
]
HtmlOut = Annotated[Path | None, Option("--html", help="Write a self-contained HTML report.")]
QuietAll = Annotated[bool, Option("--quiet", "-q", help="Print nothing on success.")]
Kernels = Annotated[
    bool | None,
    Option(
        "--kernels/--no-kernels",
        help="Fuse element-wise chains into generated C/CUDA kernels (fuse-elementwise; "
        "each kept only where its gates pass; the bundle ships kernels/). Default: on for "
        "the -O presets on cpu/cuda where a compiler is present (GRAPHOPT_NO_KERNELS=1 "
        "turns the default off); --kernels also adds it to a --pipeline.",
    ),
]
MachineTier = Annotated[
    bool,
    Option(
        "--machine-tier/--no-machine-tier",
        help="Write the bundle's machine tier beside the portable model.onnx: onnxruntime's "
        "optimized form for this machine (model.machine.onnx, cpu) and generated kernels. "
        "It holds its own copy of the weights (manifest.json -> tiers); --no-machine-tier "
        "writes the portable model alone.",
    ),
]
Weights = Annotated[
    WeightFormat | None,
    Option(
        "--weights",
        help="-O3: weight-only quantization of MatMul weights to com.microsoft.MatMulNBits "
        "(int4: symmetric; int4-zp: with zero points; block 32), each kept only while every "
        "output stays within 0.15 of its largest magnitude on the parity inputs; changes "
        "numerics, so parity is held to that tolerance.",
    ),
]
DecoderStepsFlag = Annotated[
    DecoderSteps | None,
    Option(
        "--decoder-steps",
        help="Declare that a decoder with a KV cache runs as a generation loop (every step "
        "given a past has one new token, or a batch of 1), so its attention may lower to "
        "GroupQueryAttention on a symbolic batch; recorded in report.json and the manifest.",
    ),
]
Opset = Annotated[
    int | None,
    Option(
        "--opset",
        min=1,
        help="Upgrade the model to this ONNX opset first (e.g. 23 for RMSNormalization); "
        "parity still compares with the original.",
    ),
]

StrictFallback = Annotated[
    bool,
    Option(
        "--strict-fallback",
        help="Exit 4 for every node that runs on the fallback provider (cuda -> CPU), also "
        "those the original model already ran there (by default only the fallbacks "
        "graphopt's rewrites introduced fail; the original's are warnings).",
    ),
]

# ------------------------------------------------------------------ check, bisect, explain, lint
CheckReference = Annotated[
    Reference,
    Option("--reference", help="Compare with ORIGINAL, its float64 upcast, or both."),
]
BisectDir = Annotated[
    Path | None,
    Option("-o", "--output", help="Directory for the minimal before/after models."),
]
RuleFilter = Annotated[str | None, Option("--rule", help="Only this rule.")]
NodeFilter = Annotated[str | None, Option("--node", help="Only remarks on this node.")]
CodeFilter = Annotated[str | None, Option("--code", help="Only this guard code.")]
OpFilter = Annotated[
    str | None,
    Option("--op", help="Only remarks on nodes of this op (FusedConv or its domain.op)."),
]
RemarksJsonl = Annotated[Path | None, Option("--remarks", help="Write JSONL.")]
FreezeInitializers = Annotated[
    bool,
    Option(
        "--freeze-initializers",
        help="Write a copy whose initializers are not graph inputs (changes the interface).",
    ),
]
FrozenOut = Annotated[
    Path | None,
    Option("-o", "--output", help="Where --freeze-initializers writes the model."),
]

# ------------------------------------------------------------------ bench, gate
OptimizedModel = Annotated[
    Path | None,
    Option("--optimized", help="Optimized model or bundle (default: optimize MODEL now)."),
]
Runs = Annotated[
    int, Option("--runs", min=1, max=MAX_RUNS, help=f"Timed runs (at most {MAX_RUNS:,}).")
]
Warmup = Annotated[int, Option("--warmup", min=0, max=MAX_RUNS)]
OrtLevel = Annotated[
    str,
    Option("--ort-level", help="onnxruntime session level: disable, basic, extended, all."),
]
BenchBaseline = Annotated[
    Path | None,
    Option("--baseline", help="Compare with this baseline; exit 5 past --max-regression."),
]
BenchSaveBaseline = Annotated[
    Path | None, Option("--save-baseline", help="Write this run as a baseline file.")
]
BenchMaxRegression = Annotated[str, Option("--max-regression")]
MinSeconds = Annotated[float, Option("--min-seconds", help="Keep measuring at least this long.")]
BenchJUnit = Annotated[Path | None, Option("--junit")]
GateExpect = Annotated[
    list[str] | None,
    Option("--expect", help='Op-count assertions, e.g. "FusedConv>=10" (exit 4).'),
]
GateBaseline = Annotated[
    Path | None,
    Option("--baseline", help="Gate baseline to compare with (exit 5 on regression)."),
]
GateSaveBaseline = Annotated[
    Path | None,
    Option(
        "--save-baseline",
        help="Write this run's latency as the baseline (refused, exit 4, when its interval "
        "is wider than --max-regression).",
    ),
]
GateMaxRegression = Annotated[
    str,
    Option(
        "--max-regression",
        help="Allowed slowdown of optimized/original vs the baseline, e.g. 5%.",
    ),
]
MaxSeconds = Annotated[
    float, Option("--max-seconds", help="Longest the latency measurement may take.")
]

# ------------------------------------------------------------------ run
RunInputs = Annotated[
    Path | None,
    Option(
        "--inputs",
        help=".npz of inputs (default: the bundle's golden inputs, "
        "compared with its golden outputs).",
    ),
]
RunOutput = Annotated[Path | None, Option("-o", "--output", help="Write the outputs to this .npz.")]
Providers = Annotated[
    list[str] | None,
    Option(
        "--provider",
        help="Override the bundle's providers (repeatable), e.g. "
        "CPUExecutionProvider to run a cuda/npu bundle's semantics on CPU.",
    ),
]
Repeat = Annotated[
    int, Option("--repeat", min=1, max=MAX_RUNS, help=f"Runs (timed; at most {MAX_RUNS:,}).")
]
VerifyFiles = Annotated[
    Verify,
    Option(
        "--verify",
        help="Integrity of the model files: fingerprint (size and sampled blocks), full "
        "(every byte against the sha256 taken when the bundle was written) or none.",
    ),
]
Portable = Annotated[
    bool,
    Option(
        "--portable",
        help="Run the portable model.onnx even where the machine-specific fast path applies.",
    ),
]

# ------------------------------------------------------------------ profile
#: the most ``profile --runs``: every run's kernel events are kept in memory and in the trace
MAX_PROFILE_RUNS = 10_000
ProfileTarget = Annotated[
    str | None,
    Option(
        "--target",
        "-t",
        help="Target of a model file (default cpu; a bundle has its own): "
        f"{', '.join(TARGET_NAMES)}.",
    ),
]
ProfileRuns = Annotated[
    int,
    Option(
        "--runs",
        min=1,
        max=MAX_PROFILE_RUNS,
        help=f"Profiled runs after one warm-up (at most {MAX_PROFILE_RUNS:,}).",
    ),
]
ProfileInputs = Annotated[
    Path | None,
    Option(
        "--inputs",
        help=".npz of inputs (default: a bundle's golden inputs, else seeded random ones).",
    ),
]
ProfileCompare = Annotated[
    Path | None,
    Option("--compare", help="The original model: profiled at ORT_ENABLE_ALL, delta per op."),
]
ProfileHtml = Annotated[Path | None, Option("--html", help="Write the profile as one HTML page.")]
ProfileTrace = Annotated[
    Path | None, Option("--trace", help="Write a Chrome trace (JSON) named by graphopt's nodes.")
]
OptimizeProfile = Annotated[
    bool,
    Option(
        "--profile",
        help="Profile the written bundle (graphopt profile on its golden inputs): the per-op "
        "account, coverage and missed rows in report.json and --html.",
    ),
]
OptimizeProfileRuns = Annotated[
    int,
    Option(
        "--profile-runs",
        min=1,
        max=MAX_PROFILE_RUNS,
        help="Profiled runs for --profile, after one warm-up.",
    ),
]
GateOpBaseline = Annotated[
    Path | None,
    Option(
        "--op-baseline",
        help="A profile JSON (graphopt profile --format json, or --save-op-baseline): exit 5 "
        "when one op type's time interval lies past its baseline's by --max-regression.",
    ),
]
GateSaveOpBaseline = Annotated[
    Path | None,
    Option("--save-op-baseline", help="Write the optimized model's profile as a per-op baseline."),
]
GateProfileRuns = Annotated[
    int,
    Option(
        "--profile-runs",
        min=2,
        max=MAX_PROFILE_RUNS,
        help="Profiled runs for --op-baseline / --save-op-baseline, after one warm-up.",
    ),
]
