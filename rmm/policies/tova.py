"""tova (Token Omission Via Attention): keep the top B' by the latest query's attention.

``variant=kvpress`` is TOVAPress's score: one score per position for the whole layer, the latest query's
attention averaged over all the layer's query heads (the group-summed attention summed over the KV heads
that hold the position, divided by the number of query heads: the row sums of the latest query,
rounded), the same in every KV head of the layer; the latest query's own key (position now - 1) is
always kept, as the press keeps it (with its maximum score + 1).
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import NEVER, Observation, ScorePolicy, check_variant, group_size, register


@register
@dataclass
class TOVA(ScorePolicy):
    variant: str = "harness"

    name = "tova"
    needs = frozenset({"attention"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        if self.variant == "kvpress":
            return self.press_scores(obs, now)
        return obs.attention[:, :, -1, :].clone()

    @staticmethod
    def press_scores(obs: Observation, now: int) -> torch.Tensor:
        """The layer's mean over query heads of the latest query's attention, per position [L, H, S]."""
        key_pos, latest = obs.key_pos, obs.attention[:, :, -1, :]
        valid = key_pos >= 0
        where = key_pos.clamp(min=0).flatten(1)  # [L, H * S]
        per_position = torch.zeros(key_pos.shape[0], now, dtype=torch.float64, device=key_pos.device)
        per_position.scatter_add_(1, where, torch.where(valid, latest, 0.0).double().flatten(1))
        heads = group_size(obs.attention).sum(dim=-1)  # [L]: query heads of the layer
        scores = torch.gather(per_position, 1, where).view_as(latest) / heads[:, None, None]
        return torch.where(key_pos == now - 1, NEVER, scores)
