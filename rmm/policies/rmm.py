"""rmm: eviction as fixed-lag smoothing, ranked by demonstrated utility.

The H most recent positions form a provisional buffer that is always kept and never ranked. Older
positions are committed and ranked by demonstrated utility DU_j = sum_s a_s(j) * w_s, where w_s is
1 when query s predicted x_{s+1} correctly (``weight=correct``), p(x_{s+1} | s) (``prob``) or 1
(``uniform``). ``after_commit=accumulate`` keeps summing after commit; ``freeze`` sums only queries
s in [j, j + H]. With ``uniform`` and ``accumulate``, rmm with lag H is exactly h2o with r = H.
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import Policy, QueryBatch, protect_recent, weighted_attention

WEIGHTS = ("correct", "prob", "uniform")
AFTER_COMMIT = ("accumulate", "freeze")


@dataclass
class RMM(Policy):
    lag: int = 32
    weight: str = "correct"
    after_commit: str = "accumulate"

    name = "rmm"
    needs_attention = True
    state_names = ("utility",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight not in WEIGHTS:
            raise ValueError(f"policy.weight must be one of {WEIGHTS}, got {self.weight!r}")
        if self.after_commit not in AFTER_COMMIT:
            raise ValueError(f"policy.after_commit must be one of {AFTER_COMMIT}, got {self.after_commit!r}")
        if self.lag < 0:
            raise ValueError(f"lag must be >= 0, got {self.lag}")
        if self.lag >= self.capacity:
            raise ValueError(
                f"lag ({self.lag}) must be smaller than the room at a boundary, budget - chunk + 1 = "
                f"{self.capacity}; lower lag or chunk, or raise budget"
            )

    @property
    def protected(self) -> int:
        return self.lag

    def observe(
        self, state: dict[str, torch.Tensor], attn: torch.Tensor, key_pos: torch.Tensor, queries: QueryBatch
    ) -> None:
        weight = {"correct": queries.correct, "prob": queries.prob}.get(self.weight)
        if weight is None:
            weight = torch.ones_like(queries.prob)
        if self.after_commit == "freeze":
            age = queries.positions[:, None] - key_pos[..., None, :]  # [L, H, Q, S]
            attn = attn * (age <= self.lag)
        state["utility"] += weighted_attention(attn, weight)

    def score(self, state: dict[str, torch.Tensor], key_pos: torch.Tensor, now: int) -> torch.Tensor:
        return protect_recent(state["utility"].clone(), key_pos, now, self.lag)
