"""Local rewrite rules by family; importing this package registers them."""

from . import cleanup, conv, matmul, shape  # noqa: F401
from . import control_flow  # noqa: F401
