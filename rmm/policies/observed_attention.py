"""observed_attention: h2o's accumulated attention, normalised by how many queries saw each key.

At a boundary with room for B' entries, keep the r = floor(rho * B') most recent positions and, of the
older ones, the B' - r with the highest

    A_j / n_j,   A_j = sum_{s >= j, s saw j} a_s(j),   n_j = |{s >= j : s saw j}|,

(own query included, a_s(j) summed over the query heads of the KV head's group), as kvpress's
ObservedAttentionPress averages attention over the queries that observed a key. Against h2o it
isolates normalisation from accumulation: an old key is no longer favoured for having been seen longer.
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import Observation, RecentRatioPolicy, protect_recent, seen_count


@dataclass
class ObservedAttention(RecentRatioPolicy):
    name = "observed_attention"
    needs = frozenset({"attention"})
    state_names = ("acc", "seen")

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        state["acc"] += obs.attention.sum(dim=-2)
        state["seen"] += seen_count(obs)

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        mean = state["acc"] / state["seen"].clamp(min=1.0)
        return protect_recent(mean, obs.key_pos, now, self.protected)
