"""observed_attention: h2o's accumulated attention, normalised by how many queries saw each key.

At a boundary with room for B' entries, keep the r = floor(rho * B') most recent positions and, of the
older ones, the B' - r with the highest

    A_j / n_j,   A_j = sum_{s >= j, s saw j} a_s(j),   n_j = |{s >= j : s saw j}|,

(own query included, a_s(j) summed over the query heads of the KV head's group), as kvpress's
ObservedAttentionPress averages attention over the queries that observed a key. Against h2o it
isolates normalisation from accumulation: an old key is no longer favoured for having been seen longer.

``variant=kvpress`` is ObservedAttentionPress's normalisation: the mean over the query heads of the
group, A_j / (G n_j) (G: the row sum of a query's group-summed attention, rounded). With ``rho=0`` it is
the press (which keeps no recent window); the accumulation over the chunks of a stream is the harness's
(at the first boundary, after a prefill of C tokens, it is the press's single state).
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import (
    Observation,
    RecentRatioPolicy,
    check_variant,
    group_size,
    protect_recent,
    register,
    seen_count,
)


@register
@dataclass
class ObservedAttention(RecentRatioPolicy):
    variant: str = "harness"

    name = "observed_attention"
    needs = frozenset({"attention"})
    state_names = ("acc", "seen")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        state["acc"] += obs.attention.sum(dim=-2)
        state["seen"] += seen_count(obs)

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        mean = state["acc"] / state["seen"].clamp(min=1.0)
        if self.variant == "kvpress":  # the mean over the group's query heads
            mean = mean / group_size(obs.attention)[..., None]
        return protect_recent(mean, obs.key_pos, now, self.protected)
