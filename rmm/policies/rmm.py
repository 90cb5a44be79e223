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

``lag=auto`` (weights correct, prob and uniform, ``accumulate``; docs/adaptive_lag.md) lets every (layer,
KV head) choose its ranking at every boundary from a fixed set of arms. Arm 0 is h2o: the uniform
statistic behind h2o's recent window r = floor(B' / 2), exactly ``policy=h2o``. Arm i >= 1 is rmm with the
configured weight at the i-th candidate lag, ``step`` x m for m = 2, 3, 4, 6, 8, 12, ... (2^k and 3 x 2^k)
while the committed pool keeps half the room, 2 H <= B' (:func:`candidate_lags`; none below B' = 4 step,
where lag=auto is h2o). Each arm keeps a shadow inside the memory: at most B' - C retained entries. Each
boundary adds the chunk's entries to it, and the arm drops, by its own ranking, all but the B' - C best
retained entries it holds; a dropped entry stays out, and an entry the memory evicts leaves every shadow.
Over the chunk that follows, an arm's loss grows by the attention its queries paid to retained entries
its shadow dropped, weighted as the utility is (sum_s w_s a_s(j)). At a boundary each (layer, KV head)
ranks by the arm with the least loss summed over the stream so far, the losses compared at 4 significant
digits, ties to the lower arm (so h2o until another arm has lost less).

``lag`` has no default here: the one default is the top-level ``lag`` of ``conf/config.yaml``, which
``conf/policy/rmm.yaml`` forwards (so ``python run.py policy=rmm lag=64`` works).
"""

from dataclasses import dataclass
from typing import Any

import torch

from rmm.policies.base import (
    SCORE_DIGITS,
    Observation,
    ReferencePass,
    ScorePolicy,
    check_protected,
    protect_recent,
    register,
    significant,
    weighted_attention,
)
from rmm.policies.select import rank
from rmm.transfer import to_device

WEIGHTS = ("correct", "prob", "uniform", "gradient")
GRADIENT_DIGITS = 3  # significant digits at which gradient utilities are compared (the module docstring)
AFTER_COMMIT = ("accumulate", "freeze")
AUTO = "auto"  # lag=auto: the lag chosen online (the module docstring)
H2O = "h2o"  # lag=auto's arm 0, in the record of the choices


def candidate_lags(capacity: int, step: int) -> list[int]:
    """lag=auto's candidate lags at B' = ``capacity``: ``step`` x m for m = 2, 3, 4, 6, 8, 12, ... (2^k and
    3 x 2^k) with 2 H <= B', so that the committed pool P = B' - H keeps at least half the room."""
    lags, m = [], 2
    while 2 * step * m <= capacity:
        lags.append(step * m)
        m = m * 3 // 2 if m & (m - 1) == 0 else m * 4 // 3
    return lags


@register
@dataclass
class RMM(ScorePolicy):
    lag: int | str
    weight: str = "correct"
    after_commit: str = "accumulate"
    step: int = 16  # lag=auto: the unit of the candidate lags

    name = "rmm"
    needs = frozenset({"attention", "outcomes"})
    state_names = ("utility",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight not in WEIGHTS:
            raise ValueError(f"policy.weight must be one of {WEIGHTS}, got {self.weight!r}")
        if self.after_commit not in AFTER_COMMIT:
            raise ValueError(f"policy.after_commit must be one of {AFTER_COMMIT}, got {self.after_commit!r}")
        if self.lag == AUTO:
            self._auto_post_init()
            return
        if type(self.lag) is not int or self.lag < 0:
            raise ValueError(f"lag must be an integer >= 0 or {AUTO}, got {self.lag!r}")
        check_protected("lag", self.lag, self.capacity)
        if self.weight == "gradient":  # the utility replaces attention and outcomes
            self.needs = frozenset({"gradient"})

    def _auto_post_init(self) -> None:
        """lag=auto: the arms, their per-slot shadows, and the record of the choices that the copies of
        this instance (one per document, :func:`rmm.api.stream_documents`) share."""
        if self.weight == "gradient" or self.after_commit != "accumulate":
            raise ValueError(
                f"lag={AUTO} chooses among h2o and rmm(accumulate) with weight correct, prob or uniform; got "
                f"weight={self.weight}, after_commit={self.after_commit}: use those, or a fixed lag"
            )
        if type(self.step) is not int or self.step < 1:
            raise ValueError(f"policy.step must be an integer >= 1, got {self.step!r}")
        self.lags = candidate_lags(self.capacity, self.step)
        self.shadow_capacity = max(self.capacity - self.chunk, 0)
        self.state_names = ("utility", "acc", *(f"dropped{a}" for a in range(len(self.lags) + 1)))
        self.records: list[dict[str, list]] = []  # one per prepared stream, shared by the copies
        self._record: dict[str, list] | None = None
        self._loss: torch.Tensor | None = None

    @property
    def auto(self) -> bool:
        return self.lag == AUTO

    @property
    def protected(self) -> int:
        """H; under lag=auto the most an arm protects, h2o's floor(B' / 2)."""
        return self.capacity // 2 if self.auto else self.lag

    @property
    def score_digits(self) -> int | None:
        return GRADIENT_DIGITS if self.weight == "gradient" else None

    def metric_fields(self) -> dict[str, Any]:
        """``lag`` (None under lag=auto) and, under lag=auto, ``lag_auto``: the arms (``h2o``, then the
        candidate lags) and per prepared stream its boundaries [K] and the count of (layer, KV head) that
        chose each arm there [K][arms]."""
        if not self.auto:
            return {"lag": self.lag}
        return {
            "lag": None,
            "lag_auto": {
                "arms": [H2O, *self.lags],
                "boundaries": [record["boundaries"] for record in self.records],
                "counts": [
                    torch.stack(record["counts"]).tolist() if record["counts"] else []
                    for record in self.records
                ],
            },
        }

    def prepare(self, tokens: torch.Tensor, reference: ReferencePass) -> None:
        """lag=auto: a stream starts with no loss and a record of its own."""
        if self.auto:
            self._loss = None
            self._record = {"boundaries": [], "counts": []}
            self.records.append(self._record)

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
        utility = weighted_attention(contribution, weight)  # [L, H, S]
        if self.auto:
            self._judge(state, obs, utility)
            state["acc"] += obs.attention.sum(dim=-2)
        state["utility"] += utility

    def _arms(
        self, state: dict[str, torch.Tensor], key_pos: torch.Tensor, now: torch.Tensor | int
    ) -> torch.Tensor:
        """Every arm's scores [A, L, H, S] at boundary ``now``: h2o's, then rmm's at each candidate lag."""
        protect = to_device([self.capacity // 2, *self.lags], key_pos.device)
        recent = key_pos >= now - protect[:, None, None, None]  # [A, L, H, S]
        scores = torch.stack([state["acc"], *[state["utility"]] * len(self.lags)])
        return torch.where(recent, torch.inf, scores)

    def _judge(self, state: dict[str, torch.Tensor], obs: Observation, utility: torch.Tensor) -> None:
        """lag=auto, before the chunk's statistics are added: update every arm's shadow for the boundary the
        chunk began at (``obs.query_pos[0]``), then add to its loss the weighted attention ``utility``
        [L, H, S] that the chunk paid to retained entries it dropped."""
        now = obs.query_pos[0]
        retained = (obs.key_pos >= 0) & (obs.key_pos < now)  # [L, H, S]
        names = [f"dropped{a}" for a in range(len(self.lags) + 1)]
        dropped = torch.stack([state[name] for name in names]) > 0  # [A, L, H, S]
        held = retained & ~dropped
        key_pos = obs.key_pos.expand_as(held)
        ranks = rank(torch.where(held, self._arms(state, obs.key_pos, now), -torch.inf), key_pos, held)
        dropped |= held & (ranks >= self.shadow_capacity)
        for name, mask in zip(names, dropped, strict=True):
            state[name].copy_(mask)
        loss = (utility * (dropped & retained)).sum(dim=-1).double()  # [A, L, H]
        self._loss = loss if self._loss is None else self._loss + loss

    def choice(self) -> torch.Tensor:
        """lag=auto: each (layer, KV head)'s arm [L, H] (long), the least loss at SCORE_DIGITS significant
        digits, ties to the lower arm."""
        assert self._loss is not None, "lag=auto chooses after observing a chunk"
        return torch.argmin(significant(self._loss, SCORE_DIGITS), dim=0)

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        if self.auto:
            choice = self.choice()
            if self._record is not None:
                self._record["boundaries"].append(now)
                # counted on the device (torch.bincount reads its input's range on the host: a GPU sync)
                each = torch.arange(len(self.lags) + 1, device=choice.device)
                self._record["counts"].append((choice.flatten()[:, None] == each).sum(dim=0))
            arms = self._arms(state, obs.key_pos, now)
            return torch.gather(arms, 0, choice[None, ..., None].expand_as(arms[:1]))[0]
        utility = state["utility"].clone()
        if self.weight == "gradient":  # compared at a stated precision (the module docstring)
            utility = significant(utility, GRADIENT_DIGITS)
        return protect_recent(utility, obs.key_pos, now, self.lag)
