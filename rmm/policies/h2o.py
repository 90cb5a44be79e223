"""h2o (Heavy-Hitter Oracle): a recent window plus the heavy hitters of accumulated attention.

At a boundary with room for B' entries, keep the r = floor(rho * B') most recent positions and, of
the older ones, the B' - r with the highest A_j = sum_{s >= j, s saw j} a_s(j) (own query included,
GQA group summed, no normalisation). Commit is immediate (lag 0 in the paper's terms).
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import Observation, RecentRatioPolicy, protect_recent, register


@register
@dataclass
class H2O(RecentRatioPolicy):
    name = "h2o"
    needs = frozenset({"attention"})
    state_names = ("acc",)

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        state["acc"] += obs.attention.sum(dim=-2)

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        return protect_recent(state["acc"].clone(), obs.key_pos, now, self.protected)
