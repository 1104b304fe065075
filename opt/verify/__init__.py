"""Checking and measuring what graphopt produced, with onnxruntime: inputs (``feeds``), parity
against the original and its own noise (``parity``), values too dangerous to run
(``hazards``), sessions with custom ops (``customops``), the performance safety net
(``perf``), benchmarks and CI gates (``bench``, ``gate``, ``verdict``), decoder generation
checks (``generation``) and the per-node profile (``profile``).

May import: ``opt.numerics``, ``opt.rewrite``, ``opt.graph``, ``opt.errors``, ``opt.remarks``,
``opt.clock`` and this package.
"""
