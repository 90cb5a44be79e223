"""h2o (Heavy-Hitter Oracle): a recent window plus the heavy hitters of accumulated attention.

At a boundary with room for B' entries, keep the r = floor(rho * B') most recent positions and, of
the older ones, the B' - r with the highest A_j = sum_{s >= j, s saw j} a_s(j) (own query included,
GQA group summed, no normalisation). Commit is immediate (lag 0 in the paper's terms).
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import QueryBatch, RecentRatioPolicy, protect_recent, weighted_attention


@dataclass
class H2O(RecentRatioPolicy):
    name = "h2o"
    needs_attention = True
    state_names = ("acc",)

    def observe(
        self, state: dict[str, torch.Tensor], attn: torch.Tensor, key_pos: torch.Tensor, queries: QueryBatch
    ) -> None:
        state["acc"] += weighted_attention(attn, torch.ones_like(queries.prob))

    def score(self, state: dict[str, torch.Tensor], key_pos: torch.Tensor, now: int) -> torch.Tensor:
        return protect_recent(state["acc"].clone(), key_pos, now, self.protected)
