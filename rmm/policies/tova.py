"""tova (Token Omission Via Attention): keep the top B' by the latest query's attention."""

from dataclasses import dataclass

import torch

from rmm.policies.base import Policy, QueryBatch


@dataclass
class TOVA(Policy):
    name = "tova"
    needs_attention = True
    state_names = ("last",)

    def observe(
        self, state: dict[str, torch.Tensor], attn: torch.Tensor, key_pos: torch.Tensor, queries: QueryBatch
    ) -> None:
        state["last"].copy_(attn[:, :, -1, :])

    def score(self, state: dict[str, torch.Tensor], key_pos: torch.Tensor, now: int) -> torch.Tensor:
        return state["last"].clone()
