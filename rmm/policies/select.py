"""Selection at a chunk boundary: which candidate slots the memory keeps, as pure functions.

A score-based policy's scores [L, H, S] go through :func:`select` (shared over heads or layers by
``scope``, then the ``capacity`` best valid slots kept, ties to the more recent position); a position
rule keeps what it allows the next query to see (:func:`rule_keep`). Both return a keep mask [L, H, S]
that the engine hands to :meth:`rmm.memory.SlotMemory.compact`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SCOPES = ("head", "layer", "global")  # as rmm.config.SCOPES, which checks configs without torch


def select(
    scores: torch.Tensor,
    key_pos: torch.Tensor,
    valid: torch.Tensor,
    capacity: int,
    scope: str = "head",
    reduce: str = "sum",
) -> torch.Tensor:
    """Keep mask [L, H, S]: the ``capacity`` best-ranked valid slots of ``scores`` [L, H, S].

    key_pos : [L, H, S] original positions; valid : [L, H, S] bool, the slots that hold an entry.
    scope, reduce : how scores combine over heads (``layer``) or layers and heads (``global``):
        the policy's ``scope_reduce``, ``sum`` or ``max``.
    """
    shared = share(scores.float(), scope, reduce)
    return valid & (rank(shared, key_pos, valid) < capacity)


def rule_keep(
    allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], now: int, key_pos: torch.Tensor
) -> torch.Tensor:
    """Keep mask [L, H, S] of a position rule ``allowed``: the valid slots that query ``now`` may see."""
    visible = allowed(torch.tensor([now], device=key_pos.device), key_pos)[..., 0, :]
    return (key_pos >= 0) & visible


def share(scores: torch.Tensor, scope: str, reduce: str) -> torch.Tensor:
    """Combine scores [L, H, S] over heads (scope=layer) or layers and heads (scope=global)."""
    if scope == "head":
        return scores
    dims = (1,) if scope == "layer" else (0, 1)
    if reduce == "max":
        shared = scores.amax(dim=dims, keepdim=True)
    else:
        shared = scores.sum(dim=dims, keepdim=True)
    return shared.expand_as(scores)


def rank(scores: torch.Tensor, key_pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rank of every slot [L, H, S]: valid first, then higher score, then more recent position."""
    order = torch.argsort(key_pos, dim=-1, descending=True, stable=True)
    order = torch.gather(
        order, -1, torch.argsort(torch.gather(scores, -1, order), dim=-1, descending=True, stable=True)
    )
    order = torch.gather(
        order,
        -1,
        torch.argsort(torch.gather(valid, -1, order).to(torch.int8), dim=-1, descending=True, stable=True),
    )
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks
