"""full: every past position is visible, R_t = {0..t-1} (no budget: a given budget is ignored)."""

from dataclasses import dataclass

import torch

from rmm.policies.base import PositionRule, every_key, register


@register
@dataclass
class Full(PositionRule):
    name = "full"
    needs_budget = False

    def __post_init__(self) -> None:
        self.budget = None
        super().__post_init__()

    def allowed(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        return every_key(query_pos, key_pos)
