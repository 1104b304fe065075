"""The native part of graphopt: optional, built where a C compiler is present (without it,
numpy computes the same values, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "graphopt.opt.numerics._rounding",
            ["opt/numerics/_rounding.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
