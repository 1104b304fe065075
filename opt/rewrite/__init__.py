"""The rewrite engine: the pattern language (``patterns``), rules and their driver (``engine``:
match, check, rewrite, remarks), the state a pass runs with (``context``), the pass manager
with its registries and fixpoints (``manager``), pipelines as text (``pipeline``) and what a
target is as data (``target``).

May import: ``opt.graph``, ``opt.errors``, ``opt.remarks`` and this package.
"""
