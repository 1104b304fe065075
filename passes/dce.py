"""Dead-code elimination: drop nodes and constants that no graph output depends on.

Graph inputs are never removed (that would change the model's interface).  Nodes with side
effects do not exist in inference ONNX, so reachability from the outputs is the whole story.
"""

from __future__ import annotations

from graphopt.opt.ir import ModelIR, walk_nodes
from graphopt.opt.manager import Pass, PassContext, register_pass


@register_pass
class DeadCodeElimination(Pass):
    name = "dce"
    summary = "remove nodes whose results reach no graph output"
    level = 1

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        before = sum(1 for _ in walk_nodes(ir.graph))
        ir.graph.cleanup(remove_unused_graph_inputs=False)
        removed = before - sum(1 for _ in walk_nodes(ir.graph))
        if removed:
            cx.rule_stats(self.name).fired += removed
        return removed > 0
