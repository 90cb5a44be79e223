"""window: query t sees the last B positions, R_t = {t-B .. t-1}."""

from dataclasses import dataclass

import torch

from rmm.policies.base import PositionRule, register


@register
@dataclass
class Window(PositionRule):
    name = "window"

    def allowed(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        return key_pos[..., None, :] >= query_pos[..., :, None] - self.budget
