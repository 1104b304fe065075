"""The report.json schema: what one ``optimize`` call learned, as data only (the run's working
state is :class:`graphopt.opt.optimizer.Run`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..remarks import Remark
from ..verify.parity import ParityReport


@dataclass
class Report:
    """Everything ``optimize`` learned; ``to_dict`` is the report.json schema."""

    model: str
    target: str
    level: int
    pipeline: str
    nodes_before: int
    nodes_after: int
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    remarks: list[Remark]
    passes: list[dict[str, Any]]
    rules: dict[str, dict[str, Any]]
    parity: ParityReport
    parity_float64: ParityReport | None = None
    #: the bundle under its own session settings against the original under the same (set
    #: when the bundle is written and verified)
    parity_deployed: ParityReport | None = None
    #: the performance safety net (:mod:`graphopt.opt.verify.perf`): measured, ratio, interval,
    #: reverted
    performance: dict[str, Any] = field(default_factory=lambda: {"measured": False})
    seconds: dict[str, float] = field(default_factory=dict)
    rewrites: int = 0
    applied: list[tuple[int, str, str]] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    #: the generation check of a decoder with a KV cache (:mod:`graphopt.opt.verify.generation`),
    #: set when the bundle is written; None for other models
    generation: dict[str, Any] | None = None
    #: what the user declared about how the model is run (e.g. ``decoder_steps``) and the
    #: rewrites relied on; copied into the bundle's manifest
    declared: dict[str, Any] = field(default_factory=dict)

    @property
    def converged(self) -> bool:
        return not any(r.code == "did-not-converge" for r in self.remarks)

    @property
    def generation_failure(self) -> str | None:
        """One line when the generation check ran and failed (a failed verification, like
        failed parity: exit 3), else None."""
        from ..verify.generation import failure_line

        return failure_line(self.generation)

    @property
    def legal(self) -> bool:
        """No node the target cannot run (legalize reported no failure)."""
        return not any(r.kind == "failure" and r.pass_name == "legalize" for r in self.remarks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "graphopt.report/1",
            "model": self.model,
            "target": self.target,
            "level": self.level,
            "pipeline": self.pipeline,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "ops_before": self.ops_before,
            "ops_after": self.ops_after,
            "rewrites": self.rewrites,
            "applied": [list(a) for a in self.applied],
            "converged": self.converged,
            "legal": self.legal,
            "remarks": [r.to_dict() for r in self.remarks],
            "passes": self.passes,
            "rules": self.rules,
            "parity": self.parity.to_dict(),
            "parity_float64": self.parity_float64.to_dict() if self.parity_float64 else None,
            "parity_deployed": self.parity_deployed.to_dict() if self.parity_deployed else None,
            "performance": self.performance,
            "seconds": self.seconds,
            "outputs": self.outputs,
            "generation": self.generation,
            "declared": self.declared,
        }
