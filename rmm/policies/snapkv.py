"""snapkv: the attention of an observation window of recent queries, pooled over neighbouring keys.

At a boundary ``now`` the observation window is the last w' = min(``window``, Q) queries of the chunk
that just ended (Q = C except at a stream's end). For every candidate j:

    m_j = (1 / w') * sum_{s in window} a_s(j)        (a_s(j) = 0 where s cannot see j)
    score_j = pool_{|i| <= kernel // 2} m_{j_i}

where j_i is the candidate i places away from j when the candidates are sorted by position (empty
slots excluded); a missing neighbour at either end counts as 0. ``pooling=avg`` divides the sum over
the ``kernel`` places by ``kernel`` (zero padding counted, as ``avg_pool1d`` does), ``max`` takes the
largest. The ``window`` most recent positions (j >= now - window) are always kept. Like SnapKV, the
score is recomputed from scratch at every boundary (no accumulation across chunks).

``variant=kvpress`` is SnapKVPress's score: m_j is averaged over the query heads of the group (the
group-summed attention divided by G, the number of query heads per KV head: the row sum of a query's
group-summed attention, rounded), and only the candidates older than the window (j < now - window)
are pooled, by ``avg_pool1d`` over the k places centred on j with zeros beyond them at both ends (the
window's own keys are not pooled into the two keys just before it). ``pooling=avg`` only. The window is
kept, as the press keeps it (with its maximum score + 1).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rmm.policies.base import (
    Observation,
    ScorePolicy,
    check_protected,
    check_variant,
    group_size,
    position_order,
    protect_recent,
    register,
)

POOLINGS = ("avg", "max")


@register
@dataclass
class SnapKV(ScorePolicy):
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    variant: str = "harness"

    name = "snapkv"
    needs = frozenset({"attention"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"policy.window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"policy.kernel must be an odd integer >= 1, got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"policy.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        check_variant(self.variant)
        if self.variant == "kvpress" and self.pooling != "avg":
            raise ValueError(
                "policy.variant=kvpress pools as SnapKVPress does (avg_pool1d): set policy.pooling=avg"
            )
        if self.budget is not None:
            check_protected("policy.window", self.window, self.capacity)

    @property
    def protected(self) -> int:
        return self.window

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        key_pos = obs.key_pos
        mean = obs.attention[:, :, -self.window :, :].mean(dim=-2)  # [L, H, S]
        if self.variant == "kvpress":  # the group's mean; only the keys before the window are pooled
            mean = mean / group_size(obs.attention)[..., None]
            key_pos = torch.where(key_pos < now - self.window, key_pos, -1)
        mean = torch.where(key_pos >= 0, mean, torch.zeros_like(mean))
        order = position_order(key_pos)
        in_order = torch.gather(mean, -1, order).flatten(0, 1)[:, None]  # [L * H, 1, S]
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        pooled = pool(in_order, self.kernel, stride=1, padding=self.kernel // 2).view_as(mean)
        scores = torch.empty_like(mean).scatter_(-1, order, pooled)
        return protect_recent(scores, obs.key_pos, now, self.window)
