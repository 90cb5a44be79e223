"""lru: least recently used, with "used" meaning attention of at least ``tau``.

score_j = max({j} ∪ {s : a_s(j) >= tau}), the last query position s whose attention on j (summed over
the query heads of the KV head's group, as in h2o) reached ``tau``, or j itself if none did. The B'
highest scores are kept; ties go to the more recent position. It is the recency-of-use baseline: a
key stays while it keeps being used, whatever the size of the use. When heads or layers share one
set, the shared score is the latest use over them (``max``).

Beside the score it keeps the bounds of the decision's threshold part (:meth:`score_bounds`): the last use
had every comparison within :data:`rmm.divergence.TIE_MARGIN` of tau gone against the use
(``last_use_low``) or for it (``last_use_high``), and the largest ``TIE_MARGIN - |a/tau - 1|`` of such a
comparison (``tau_slack``, 0 where none).
"""

from dataclasses import dataclass

import torch

from rmm.divergence import TIE_MARGIN
from rmm.policies.base import Observation, ScorePolicy, register, threshold_distance


@register
@dataclass
class LRU(ScorePolicy):
    tau: float = 0.02

    name = "lru"
    needs = frozenset({"attention"})
    state_names = ("last_use", "last_use_low", "last_use_high", "tau_slack")
    scope_reduce = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau <= 0:
            raise ValueError(f"policy.tau must be > 0, got {self.tau}")

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        distance = threshold_distance(obs.attention, self.tau)  # [L, H, Q, S]
        near = distance < TIE_MARGIN
        used = obs.attention >= self.tau
        for name, uses in (
            ("last_use", used),
            ("last_use_low", used & ~near),
            ("last_use_high", used | near),
        ):
            torch.maximum(state[name], _latest(uses, obs), out=state[name])
        slack = torch.where(near, TIE_MARGIN - distance, 0.0).amax(dim=-2).float()
        torch.maximum(state["tau_slack"], slack, out=state["tau_slack"])

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        return state["last_use"].clone()

    def score_bounds(
        self, state: dict[str, torch.Tensor], obs: Observation, now: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slack = state["tau_slack"]
        distance = torch.where(slack > 0, TIE_MARGIN - slack, torch.inf)
        return state["last_use_low"].clone(), state["last_use_high"].clone(), distance


def _latest(uses: torch.Tensor, obs: Observation) -> torch.Tensor:
    """[L, H, S]: the last query position s that ``uses`` [L, H, Q, S] each slot, or its own position."""
    at = torch.where(uses, obs.query_pos[:, None].float(), -1.0)
    return torch.maximum(at.amax(dim=-2), obs.key_pos.float())
