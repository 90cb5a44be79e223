"""streaming_llm: the first ``sinks`` positions (attention sinks) plus the last B - sinks."""

from dataclasses import dataclass

import torch

from rmm.policies.base import PositionRule, register


@register
@dataclass
class StreamingLLM(PositionRule):
    sinks: int = 4

    name = "streaming_llm"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"policy.sinks must be >= 0, got {self.sinks}")
        if self.budget is not None and self.budget <= self.sinks:
            raise ValueError(
                f"budget ({self.budget}) cannot hold the {self.sinks} sinks plus a recent window; "
                f"set budget > {self.sinks} or lower policy.sinks"
            )

    @property
    def sink_positions(self) -> int:
        return self.sinks

    def allowed(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        recent = key_pos[..., None, :] >= query_pos[..., :, None] - (self.budget - self.sinks)
        return recent | (key_pos[..., None, :] < self.sinks)
