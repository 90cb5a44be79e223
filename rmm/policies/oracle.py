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
        if self.future is None:
            raise RuntimeError("oracle.prepare(tokens, reference) must run before the stream")
        if self.variant == "future_mass":
            return self.future.remaining_mass(obs.key_pos, now)
        if self.variant == "future_utility":
            return self.future.remaining_utility(obs.key_pos, now, self.weight)
        return -self.future.next_request(obs.key_pos, now).float()
