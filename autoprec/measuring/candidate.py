"""One evaluated assignment of precisions to layers: what the search records and verification takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoprec.runtime.policy import Policy

__all__ = ["Candidate"]


@dataclass
class Candidate:
    """One evaluated assignment (an Optuna trial)."""

    number: int
    assignment: dict[str, str]  # every profiled layer -> precision
    default: str
    predicted_ms: float
    metric: float
    sqnr_db: float
    violation: float
    error: str | None = None
    seed: str | None = None  # "fp32", "fastest", "preferred", "greedy", "heuristic:<name>", "refine", "walk-down"
    regions: dict[str, str] = field(default_factory=dict)  # module region (block, sub-block) -> precision
    params: dict[str, str] = field(default_factory=dict)  # the study parameters it came from

    @property
    def heuristic(self) -> bool:
        """Whether this is a structured policy people write by hand (e.g. first/last block fp32)."""
        return bool(self.seed and self.seed.startswith("heuristic:"))

    @property
    def feasible(self) -> bool:
        return self.violation <= 0

    @property
    def label(self) -> str:
        return f"trial #{self.number}" if self.number >= 0 else f"blanket {self.default} (not a trial)"

    def policy(self, **fields: Any) -> Policy:
        return Policy.from_assignment({**self.regions, **self.assignment}, self.default, **fields)

    def lowered(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for p in self.assignment.values():
            counts[p] = counts.get(p, 0) + 1
        return counts
