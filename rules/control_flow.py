"""Control flow (level 1): an If whose condition is a constant is replaced by the taken branch.

Exporters emit such Ifs for Python-level branches on static values (Silero VAD ships 25 of
them).  The branch's nodes move into the enclosing graph; its local values are renamed to fresh
names (outer-scope values are shared objects and keep theirs); the If's outputs are replaced by
the branch's outputs.
"""

from __future__ import annotations

from graphopt.opt.graph.ir import constant_value, subgraphs, walk_nodes
from graphopt.opt.rewrite.engine import Op, Rule, applies_only_if, require
from graphopt.opt.rewrite.manager import register_rule


@register_rule
class InlineConstantIf(Rule):
    name = "inline-constant-if"
    root = "If"
    level = 1
    exclusive = False
    summary = "If with a constant condition → the taken branch, inlined"
    pattern = Op("If", "cond")

    def structure(self, m, cx):
        applies_only_if(constant_value(m.cond) is not None)

    def check(self, m, cx):
        cond = constant_value(m.cond)
        require(cond.size == 1, "condition-shape", f"the condition has {cond.size} elements")
        branch = m.root.attrs["then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"]
        require(
            len(branch.outputs) == len(m.root.outputs),
            "branch-outputs",
            "the taken branch does not produce one value per If output",
        )
        m.stash(branch=branch)

    def rewrite(self, m, b):
        branch, ir = m.branch, b.ir
        seen = _visible_outside(ir.root, branch)  # values of every enclosing scope keep their names
        for node in walk_nodes(branch):
            for t in list(node.inputs) + list(node.outputs):
                if id(t) not in seen and t.name:
                    seen.add(id(t))
                    t.name = ir.fresh_name(f"{m.root.name or 'if'}/{t.name}")
        for node in list(branch.nodes):
            node.name = ir.fresh_name(f"{m.root.name or 'if'}/{node.name or node.op}")
            ir.graph.nodes.append(node)
            ir.provenance[node.name] = self.name
            b.created.append(node)
        outputs = list(branch.outputs)
        branch.nodes.clear()
        return outputs


def _visible_outside(root, branch) -> set[int]:
    """Ids of every tensor the model uses outside ``branch`` (its own nested bodies excluded):
    the values of all enclosing scopes, which a branch may read at any depth."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        graph = stack.pop()
        seen.update(id(t) for t in list(graph.inputs) + list(graph.outputs))
        for node in graph.nodes:
            seen.update(id(t) for t in list(node.inputs) + list(node.outputs))
            stack.extend(g for g in subgraphs(node) if g is not branch)
    return seen
