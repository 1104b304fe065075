"""Dead-code elimination: drop nodes and constants that no graph output depends on.

Graph inputs are never removed (that would change the model's interface).  Nodes with side
effects do not exist in inference ONNX, so reachability from the outputs is the whole story.
A graph without If/Loop/Scan bodies or local functions is swept here in one walk back from its
outputs (by object identity, O(nodes + edges)); any other graph goes through graphsurgeon's
``cleanup``, which also handles values the bodies read from enclosing scopes.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from graphopt.opt.graph.ir import ModelIR, subgraphs, unlink_all, walk_nodes
from graphopt.opt.rewrite.context import Pass, PassContext
from graphopt.opt.rewrite.manager import register_pass


@register_pass
class DeadCodeElimination(Pass):
    name = "dce"
    summary = "remove nodes whose results reach no graph output"
    level = 1

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        graph = ir.graph
        if _flat(graph):
            removed = sweep(graph)
        else:
            before = sum(1 for _ in walk_nodes(graph))
            graph.cleanup(remove_unused_graph_inputs=False)
            removed = before - sum(1 for _ in walk_nodes(graph))
        if removed:
            cx.rule_stats(self.name).fired += removed
        return removed > 0


def _flat(graph: gs.Graph) -> bool:
    """No local functions and no node with a body: reachability needs no scope rules."""
    return not graph.functions and not any(subgraphs(n) for n in graph.nodes if n.attrs)


def sweep(graph: gs.Graph) -> int:
    """Drop the nodes of a flat graph that no output depends on (detached, as graphsurgeon's
    ``cleanup`` leaves them, order kept); the number dropped."""
    for inp in graph.inputs:  # a graph input has no producer in the graph
        unlink_all(inp.inputs)
    nodes = graph.nodes
    members = {id(n) for n in nodes}
    live: set[int] = set()
    seen: set[int] = set()
    stack = list(graph.outputs)
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        for node in t.inputs:
            if id(node) in members and id(node) not in live:
                live.add(id(node))
                stack.extend(node.inputs)
    if len(live) == len(members):
        return 0
    kept = []
    for node in nodes:
        if id(node) in live:
            kept.append(node)
        else:
            unlink_all(node.inputs)
            unlink_all(node.outputs)
    graph.nodes = kept
    return len(nodes) - len(kept)
