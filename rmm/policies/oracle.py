"""oracle (Belady, lag = infinity): evict what is requested furthest in the future.

Future requests come from the reference pass (:mod:`rmm.lookahead`), which :meth:`Oracle.prepare` runs
once per stream: key j is requested by query s when the reference attention a*_s(j) >= tau.
``next_use`` evicts the candidates whose next request is latest (never-requested first);
``future_mass`` keeps the top by remaining reference attention mass; ``future_utility`` (the smoother,
rmm's lag = infinity limit) keeps the top by remaining demonstrated utility, the requests' reference
attention weighted by the reference pass's own ``weight`` of each requesting query (``correct``,
``prob`` or ``uniform``, rmm's names; with ``uniform`` it is ``future_mass``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rmm.policies.base import Observation, ReferencePass, ScorePolicy, register

if TYPE_CHECKING:
    from rmm.future import FutureRequests

VARIANTS = ("next_use", "future_mass", "future_utility")
WEIGHTS = ("correct", "prob", "uniform")


@register
@dataclass
class Oracle(ScorePolicy):
    variant: str = "next_use"
    weight: str = "correct"  # future_utility's query weight w*_s
    future: FutureRequests | None = field(default=None, init=False, repr=False)

    name = "oracle"
    needs_reference = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"policy.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.weight not in WEIGHTS:
            raise ValueError(
                f"policy.weight must be one of {WEIGHTS} for the oracle (future_utility's query weight), "
                f"got {self.weight!r}"
            )

    @property
    def scope_reduce(self) -> str:
        """A shared set serves whichever head needs the key soonest; masses add up."""
        return "max" if self.variant == "next_use" else "sum"

    def prepare(self, tokens: torch.Tensor, reference: ReferencePass) -> None:
        self.future = reference(tokens)

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        return self._score(self._future(), obs.key_pos, now)

    def score_bounds(
        self, state: dict[str, torch.Tensor], obs: Observation, now: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The scores had every request within the near-tie margin of tau gone the other way
        (:meth:`rmm.future.FutureRequests.bounds`), and each key's nearest such request."""
        future = self._future()
        if future.tau is None:
            return None
        low, high = (self._score(f, obs.key_pos, now) for f in future.bounds())
        return low, high, future.threshold_distance(obs.key_pos, now)

    def _future(self) -> FutureRequests:
        if self.future is None:
            raise RuntimeError("oracle.prepare(tokens, reference) must run before the stream")
        return self.future

    def _score(self, future: FutureRequests, key_pos: torch.Tensor, now: int) -> torch.Tensor:
        if self.variant == "future_mass":
            return future.remaining_mass(key_pos, now)
        if self.variant == "future_utility":
            return future.remaining_utility(key_pos, now, self.weight)
        return -future.next_request(key_pos, now).float()
