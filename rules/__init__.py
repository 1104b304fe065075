"""Local rewrite rules by family; importing this package registers them (target_rewrites
extends activation's GELU rule, so it comes after it)."""

from . import (  # noqa: F401
    activation,
    attention,
    cleanup,
    control_flow,
    conv,
    einsum,
    matmul,
    norm,
    quant,
    rotary,
    shape,
    target_rewrites,
    weights_int4,
)
