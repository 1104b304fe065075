"""Numbers graphopt computes or promises: fp16 rounding of folded values (``halfcast``,
``float16_fold``, the optional native ``_rounding``), the precision guards of fusions
(``precision``) and the float64 reference model (``reference``).

May import: ``opt.rewrite``, ``opt.graph``, ``opt.errors``, ``opt.remarks`` and this package.
"""
