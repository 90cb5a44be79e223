"""lru: least recently used, with "used" meaning attention of at least ``tau``.

score_j = max({j} ∪ {s : a_s(j) >= tau}), the last query position s whose attention on j (summed over
the query heads of the KV head's group, as in h2o) reached ``tau``, or j itself if none did. The B'
highest scores are kept; ties go to the more recent position. It is the recency-of-use baseline: a
key stays while it keeps being used, whatever the size of the use. When heads or layers share one
set, the shared score is the latest use over them (``max``).
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import Observation, ScorePolicy, register


@register
@dataclass
class LRU(ScorePolicy):
    tau: float = 0.02

    name = "lru"
    needs = frozenset({"attention"})
    state_names = ("last_use",)
    scope_reduce = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau <= 0:
            raise ValueError(f"policy.tau must be > 0, got {self.tau}")

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        used = obs.attention >= self.tau  # [L, H, Q, S]
        at = torch.where(used, obs.query_pos[:, None].float(), torch.full_like(obs.attention, -1.0))
        latest = torch.maximum(at.amax(dim=-2), obs.key_pos.float())
        torch.maximum(state["last_use"], latest, out=state["last_use"])

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        return state["last_use"].clone()
