"""The policy interface: pure tensor logic over slot positions and slot statistics.

Shapes use L layers, H KV heads, S candidate slots, Q queries of the current chunk. A slot whose
position is -1 is empty. Two families exist:

- position rules (``per_query = True``): ``allowed`` says, for every query, which positions it may see;
  the engine applies it per query, so the result does not depend on the chunk size.
- score-based policies: at each chunk boundary the engine keeps the ``capacity = B - C + 1`` valid
  slots with the highest ``score`` (ties go to the more recent position). ``observe`` updates
  per-slot statistics (``state``) from the chunk's attention probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

NEVER = float("inf")


@dataclass
class QueryBatch:
    """What the engine knows about the chunk's queries once their logits are computed.

    positions : [Q] original positions s of the queries.
    correct : [Q] 1.0 where argmax p(. | s) == x_{s+1}, else 0.0 (0.0 for the document's last token).
    prob : [Q] p(x_{s+1} | s) (0.0 for the document's last token).
    """

    positions: torch.Tensor
    correct: torch.Tensor
    prob: torch.Tensor


@dataclass
class Policy:
    """Base class. ``budget`` is B (None for unbounded), ``chunk`` is C."""

    budget: int | None
    chunk: int

    name: ClassVar[str] = ""
    per_query: ClassVar[bool] = False
    needs_attention: ClassVar[bool] = False
    state_names: ClassVar[tuple[str, ...]] = ()
    scope_reduce: ClassVar[str] = "sum"  # how scores combine when heads/layers share one set

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.budget is None:
            return
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.chunk > self.budget:
            raise ValueError(
                f"chunk ({self.chunk}) must not exceed budget ({self.budget}); set chunk<={self.budget}"
            )

    @property
    def capacity(self) -> int:
        """B': entries kept at a boundary, so that the chunk's last query sees at most B."""
        assert self.budget is not None
        return self.budget if self.per_query else self.budget - self.chunk + 1

    @property
    def protected(self) -> int:
        """Number of most recent positions that are never ranked (a provisional buffer); 0 by default."""
        return 0

    def allowed(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Position rule: bool [..., Q, S] for queries [Q] over keys [..., S] (per-query policies)."""
        raise NotImplementedError

    def observe(
        self, state: dict[str, torch.Tensor], attn: torch.Tensor, key_pos: torch.Tensor, queries: QueryBatch
    ) -> None:
        """Update ``state`` ([L, H, S] each) in place from attention ``attn`` [L, H, Q, S]."""

    def score(self, state: dict[str, torch.Tensor], key_pos: torch.Tensor, now: int) -> torch.Tensor:
        """Retention priority [L, H, S] at boundary ``now`` (the next query's position); higher keeps."""
        raise NotImplementedError


@dataclass
class RecentRatioPolicy(Policy):
    """A score-based policy that always keeps its r = floor(rho * B') most recent positions."""

    rho: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.rho < 1.0:
            raise ValueError(f"policy.rho must be in [0, 1), got {self.rho}")

    @property
    def protected(self) -> int:
        return int(self.rho * self.capacity)


def protect_recent(scores: torch.Tensor, key_pos: torch.Tensor, now: int, recent: int) -> torch.Tensor:
    """Give the ``recent`` most recent positions (``now - recent <= j``) infinite priority."""
    return torch.where(key_pos >= now - recent, torch.full_like(scores, NEVER), scores)


def weighted_attention(attn: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_s attn[..., s, j] * weight[s]: attn [L, H, Q, S], weight [Q] -> [L, H, S]."""
    return (attn * weight[:, None]).sum(dim=-2)
