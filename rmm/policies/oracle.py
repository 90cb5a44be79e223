"""oracle (Belady, lag = infinity): evict what is requested furthest in the future.

Future requests come from a reference pass (:mod:`rmm.future`): key j is requested by query s when
the reference attention a*_s(j) >= tau. ``next_use`` evicts the candidates whose next request is
latest (never-requested first); ``future_mass`` keeps the top by remaining reference attention mass.
"""

from dataclasses import dataclass, field

import torch

from rmm.future import FutureRequests
from rmm.policies.base import Policy

VARIANTS = ("next_use", "future_mass")


@dataclass
class Oracle(Policy):
    variant: str = "next_use"
    future: FutureRequests | None = field(default=None, repr=False)

    name = "oracle"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"policy.variant must be one of {VARIANTS}, got {self.variant!r}")

    @property
    def scope_reduce(self) -> str:
        """A shared set serves whichever head needs the key soonest; masses add up."""
        return "max" if self.variant == "next_use" else "sum"

    def score(self, state: dict[str, torch.Tensor], key_pos: torch.Tensor, now: int) -> torch.Tensor:
        if self.future is None:
            raise RuntimeError("oracle needs the reference pass's FutureRequests for this document")
        if self.variant == "future_mass":
            return self.future.remaining_mass(key_pos, now)
        return -self.future.next_request(key_pos, now).float()
