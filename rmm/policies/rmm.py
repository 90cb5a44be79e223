"""rmm: eviction as fixed-lag smoothing, ranked by demonstrated utility.

The H most recent positions (``lag``) form a provisional buffer that is always kept and never ranked.
Older positions are committed and ranked by demonstrated utility DU_j = sum_s a_s(j) * w_s, where w_s
is 1 when query s predicted x_{s+1} correctly (``weight=correct``), p(x_{s+1} | s) (``prob``) or 1
(``uniform``). ``weight=gradient`` measures harder: DU_j = sum_s u_s(j), the first-order utility
u_s(j) = -dl/dz_{s,j} = a_s(j) * (<g_s, o_s> - <g_s, v_j>) of the entry to the loss l (g_s = dl/do_s at
the head's attention output, summed over the KV head's query heads; see ``Observation.gradient``). It is
positive when attending to j lowered the loss. At chunk 1, l is the query's own NLL; for C > 1 it is the
chunk's summed NLL (one backward pass per chunk), so u also counts j's effect on later queries of the
chunk through their hidden states. ``after_commit=accumulate`` keeps summing after commit; ``freeze``
sums only queries s in [j, j + H]. With ``uniform`` and ``accumulate``, rmm with lag H is exactly h2o
with r = H.

The gradient utility is a difference of two nearly equal products summed over many queries, so its last
digits depend on how the kernels block the sums (thread count, CPU): between kernel sets a decision's
relative margin moves by up to about 1e-2 on SmolLM2 (``python checks/capabilities.py``), past the 2e-3
near-tie margin of 4 digits. Its utilities are therefore compared at ``GRADIENT_DIGITS`` = 3 significant
digits (near-tie margin 2e-2), ties to the more recent position.

``lag`` has no default here: the one default is the top-level ``lag`` of ``conf/config.yaml``, which
``conf/policy/rmm.yaml`` forwards (so ``python run.py policy=rmm lag=64`` works).
"""

from dataclasses import dataclass
from typing import Any

import torch

from rmm.policies.base import (
    Observation,
    ScorePolicy,
    check_protected,
    protect_recent,
    register,
    significant,
    weighted_attention,
)

WEIGHTS = ("correct", "prob", "uniform", "gradient")
GRADIENT_DIGITS = 3  # significant digits at which gradient utilities are compared (the module docstring)
AFTER_COMMIT = ("accumulate", "freeze")


@register
@dataclass
class RMM(ScorePolicy):
    lag: int
    weight: str = "correct"
    after_commit: str = "accumulate"

    name = "rmm"
    needs = frozenset({"attention", "outcomes"})
    state_names = ("utility",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight not in WEIGHTS:
            raise ValueError(f"policy.weight must be one of {WEIGHTS}, got {self.weight!r}")
        if self.after_commit not in AFTER_COMMIT:
            raise ValueError(f"policy.after_commit must be one of {AFTER_COMMIT}, got {self.after_commit!r}")
        if self.lag < 0:
            raise ValueError(f"lag must be >= 0, got {self.lag}")
        check_protected("lag", self.lag, self.capacity)
        if self.weight == "gradient":  # the utility replaces attention and outcomes
            self.needs = frozenset({"gradient"})

    @property
    def protected(self) -> int:
        return self.lag

    @property
    def score_digits(self) -> int | None:
        return GRADIENT_DIGITS if self.weight == "gradient" else None

    def metric_fields(self) -> dict[str, Any]:
        return {"lag": self.lag}

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        if self.weight == "gradient":
            contribution, weight = obs.gradient, torch.ones_like(obs.query_pos, dtype=torch.float32)
        else:
            contribution = obs.attention
            weight = {"correct": obs.correct, "prob": obs.prob}.get(self.weight)
            if weight is None:
                weight = torch.ones_like(obs.query_pos, dtype=torch.float32)
        if self.after_commit == "freeze":
            age = obs.query_pos[:, None] - obs.key_pos[..., None, :]  # [L, H, Q, S]
            contribution = contribution * (age <= self.lag)
        state["utility"] += weighted_attention(contribution, weight)

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        utility = state["utility"].clone()
        if self.weight == "gradient":  # compared at a stated precision (the module docstring)
            utility = significant(utility, GRADIENT_DIGITS)
        return protect_recent(utility, obs.key_pos, now, self.lag)
