"""Selection at a chunk boundary: which candidate slots the memory keeps, as pure functions.

A score-based policy's scores [L, H, S] go through :func:`select` (shared over heads or layers by
``scope``, then the ``capacity`` best valid slots kept, ties to the more recent position); a position
rule keeps what it allows the next query to see (:func:`rule_keep`, every row of a batch at once). Both
return a keep mask (per stream [L, H, S]) that the engine hands to :meth:`rmm.memory.SlotMemory.compact`.

Budget allocation (``allocation``, docs/semantics.md): :func:`capacities` gives every (layer, KV head)
its capacity [L, H] once per stream (``uniform``: B' everywhere; ``pyramid``: c_l falling with depth);
``adaptive`` keeps a floor f per head (:func:`adaptive_floor`) and lets a layer's heads compete for
the rest of the layer's slots (``floor`` of :func:`select`). :func:`retained_slots` is the memory's R,
the largest number of entries one head can hold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rmm.options import ALLOCATIONS, POSITIONS
from rmm.policies.base import Policy, ScorePolicy


def select(
    scores: torch.Tensor,
    key_pos: torch.Tensor,
    valid: torch.Tensor,
    capacity: int | torch.Tensor,
    scope: str = "head",
    reduce: str = "sum",
    floor: int | None = None,
) -> torch.Tensor:
    """Keep mask [L, H, S]: the ``capacity`` best-ranked valid slots of ``scores`` [L, H, S].

    key_pos : [L, H, S] original positions; valid : [L, H, S] bool, the slots that hold an entry.
    capacity : B' for every (layer, head), or per (layer, head) [L, H] (:func:`capacities`).
    scope, reduce : how scores combine over heads (``layer``) or layers and heads (``global``):
        the policy's ``scope_reduce``, ``sum`` or ``max``.
    floor : adaptive allocation (scope head): each head keeps its ``floor`` best, then the layer's
        remaining sum_h (capacity - floor) slots go to the best other valid slots of all its heads
        (higher score, then more recent position, then lower head index).
    """
    shared = share(scores.float(), scope, reduce)
    ranks = rank(shared, key_pos, valid)
    if isinstance(capacity, torch.Tensor):
        capacity = capacity.to(ranks.device)[..., None]
    if floor is None:
        return valid & (ranks < capacity)
    return valid & ((ranks < floor) | _layer_best(shared, key_pos, valid & (ranks >= floor), capacity, floor))


def decision_margin(
    scores: torch.Tensor,
    key_pos: torch.Tensor,
    valid: torch.Tensor,
    keep: torch.Tensor,
    scope: str = "head",
    reduce: str = "sum",
    floor: int | None = None,
) -> torch.Tensor:
    """Relative margin [L, H] of the decision ``keep`` [L, H, S] that :func:`select` took on ``scores``:
    (lowest kept score - highest evicted score) / max(|kept|, |evicted|), on the scores as ranked (shared
    by ``scope``, float32). 0 is a tie broken by recency; +inf where nothing valid was evicted, or where the
    gap is exact (a protected +inf entry kept, or -inf entries on both sides). Under ``adaptive``
    allocation (``floor``) a head's margin is also at most its layer's: the gap between the lowest slot
    kept by competition across the layer's heads and the highest evicted one. A decision whose margin is
    below :data:`rmm.divergence.TIE_MARGIN` may flip with the rounding of another machine's kernels."""
    shared = share(scores.float(), scope, reduce)
    evicted = valid & ~keep
    kept = valid & keep
    if floor is not None:
        ranks = rank(shared, key_pos, valid)
        won = kept & (ranks >= floor)
        n_layers = shared.shape[0]
        layer = _relative_gap(
            torch.where(won, shared, torch.inf).reshape(n_layers, -1).amin(-1),
            torch.where(evicted, shared, -torch.inf).reshape(n_layers, -1).amax(-1),
        )
    else:
        layer = None
    margin = _relative_gap(
        torch.where(kept, shared, torch.inf).amin(-1), torch.where(evicted, shared, -torch.inf).amax(-1)
    )
    return margin if layer is None else torch.minimum(margin, layer[:, None])


def threshold_margin(
    bounds: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    valid: torch.Tensor,
    keep: torch.Tensor,
    scope: str = "head",
    reduce: str = "sum",
    floor: int | None = None,
) -> torch.Tensor:
    """The threshold part [L, H] of the margin of the decision ``keep`` [L, H, S] of a policy with score
    bounds (low, high, distance [L, H, S]: :meth:`rmm.policies.ScorePolicy.score_bounds`): the smallest
    distance of a slot that may change sides (its bounds differ, and a kept slot's low score reaches the
    highest evicted high score, or an evicted slot's high score the lowest kept low score; under
    ``floor`` over the layer); +inf where none may. At least the smallest positive float: a statistic
    exactly at its threshold is a near-tie too."""
    low, high = (share(x.float(), scope, reduce) for x in bounds[:2])
    distance = -share(-bounds[2].float(), scope, "max")
    kept, evicted = valid & keep, valid & ~keep
    lowest = torch.where(kept, low, torch.inf).amin(-1, keepdim=True)
    highest = torch.where(evicted, high, -torch.inf).amax(-1, keepdim=True)
    if floor is not None:  # adaptive allocation: a layer's heads compete for its slots
        lowest, highest = lowest.amin(1, keepdim=True), highest.amax(1, keepdim=True)
    moves = (low < high) & ((kept & (low <= highest)) | (evicted & (high >= lowest)))
    margin = torch.where(moves, distance, torch.inf).amin(-1)
    return margin.clamp(min=torch.finfo(margin.dtype).tiny)


def threshold_margins(
    margin: torch.Tensor,
    bounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None],
    valid: torch.Tensor,
    keep: torch.Tensor,
    scope: str = "head",
    reduce: str = "sum",
    floor: int | None = None,
) -> torch.Tensor:
    """``margin`` [N, L, H] of N rows' decisions ``keep`` [N, L, H, S] (``valid`` alike), each at most its
    :func:`threshold_margin` where its policy has score ``bounds`` (per row, [L, H, S'] with S' <= S); an
    exact tie (margin 0) whose sides a near comparison may change takes the threshold part too."""
    if bounds[0] is None:
        return margin
    width = keep.shape[-1]
    parts = [
        threshold_margin(
            tuple(torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in row),
            valid[j],
            keep[j],
            scope,
            reduce,
            floor,
        )
        for j, row in enumerate(bounds)
    ]
    part = torch.stack(parts).to(margin.dtype)
    return torch.where(margin > 0, torch.minimum(margin, part), torch.where(part < torch.inf, part, margin))


_PRIME = 2**31 - 1


def kept_digest(keep: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """A fingerprint [L, H] int64 in [0, 2^31) of the set ``keep`` [L, H, S] keeps of positions ``key_pos``
    in every (layer, KV head): equal sets give equal digests, different ones differ but for a chance of
    about 2^-31. Two computations of a stream first took different decisions where their digests differ."""
    mixed = ((key_pos.long() + 1) * 2654435761) % _PRIME  # a position, scattered over [0, 2^31)
    return torch.where(keep, mixed, 0).sum(-1) % _PRIME  # < 2^31 * S before the modulo


def _relative_gap(low_kept: torch.Tensor, high_evicted: torch.Tensor) -> torch.Tensor:
    """(low_kept - high_evicted) / max(|low_kept|, |high_evicted|); +inf where a side is infinite (an exact
    decision), 0 where both are 0 (an exact tie, broken by recency)."""
    gap = low_kept - high_evicted
    scale = torch.maximum(low_kept.abs(), high_evicted.abs())
    relative = torch.where(scale > 0, gap / scale, torch.zeros_like(gap))
    exact = ~(torch.isfinite(low_kept) & torch.isfinite(high_evicted))
    return torch.where(exact, torch.inf, relative)


def _layer_best(
    scores: torch.Tensor,
    key_pos: torch.Tensor,
    eligible: torch.Tensor,
    capacity: int | torch.Tensor,
    floor: int,
) -> torch.Tensor:
    """Mask [L, H, S] of the best ``sum_h (capacity - floor)`` ``eligible`` slots of each layer, compared
    across its heads: higher score, then more recent position, then lower head index."""
    n_layers, n_heads, n_slots = scores.shape
    if isinstance(capacity, int):  # a host number: no copy to the device (a wait for it on a GPU)
        room = torch.full((n_layers,), n_heads * (capacity - floor), device=scores.device)
    else:
        room = (capacity.to(scores.device).expand(n_layers, n_heads, 1) - floor).sum(dim=(1, 2))
    flat = lambda x: x.reshape(n_layers, n_heads * n_slots)  # noqa: E731 (head-major: lower heads first)
    order = torch.arange(n_heads * n_slots, device=scores.device).expand(n_layers, -1)
    for key in (flat(key_pos), flat(scores), flat(eligible).to(torch.int8)):  # least significant first
        step = torch.argsort(torch.gather(key, -1, order), dim=-1, descending=True, stable=True)
        order = torch.gather(order, -1, step)
    ranks = torch.argsort(order, dim=-1)  # the inverse permutation: a slot's place in ``order``
    return flat(eligible).logical_and(ranks < room[:, None]).reshape(n_layers, n_heads, n_slots)


def adaptive_floor(capacity: int) -> int:
    """f = ceil(0.2 B'): the entries every head keeps under ``adaptive`` allocation (in integers, so
    that no float rounding can decide it)."""
    return -(-capacity // 5)


def pyramid_capacities(capacity: int, always_kept: int, n_layers: int) -> list[int]:
    """c_l, l = 0..L-1: c_{L-1} = max(ceil(B'/4), always_kept + 1) (the policy's
    :attr:`~rmm.policies.ScorePolicy.always_kept`: every layer has room to rank), c_0 = 2 B' - c_{L-1}, the
    layers between linearly interpolated and rounded down, then the residue L B' - sum given one slot each
    to the layers 0, 1, 2, ..., so that sum_l c_l = L B'. One layer keeps B'."""
    if n_layers == 1:
        return [capacity]
    last = max(-(-capacity // 4), always_kept + 1)
    first = 2 * capacity - last
    steps = n_layers - 1
    caps = [first] + [(first * steps + (last - first) * layer) // steps for layer in range(1, steps)] + [last]
    for layer in range(n_layers * capacity - sum(caps)):
        caps[layer] += 1
    return caps


def capacities(allocation: str, capacity: int, always_kept: int, n_layers: int, n_heads: int) -> torch.Tensor:
    """Capacity [L, H] long of every (layer, KV head): B' (``uniform`` and ``adaptive``, whose per-head
    counts are decided jointly at each boundary) or the pyramid's c_l."""
    if allocation == "pyramid":
        caps = torch.tensor(pyramid_capacities(capacity, always_kept, n_layers), dtype=torch.long)
        return caps[:, None].expand(n_layers, n_heads).clone()
    return torch.full((n_layers, n_heads), capacity, dtype=torch.long)


def retained_slots(allocation: str, capacity: int, always_kept: int, n_layers: int, n_heads: int) -> int:
    """R: the most entries one (layer, head) can hold across a boundary under ``allocation``
    (adaptive: B' + (H - 1)(B' - f); pyramid: c_0; uniform: B')."""
    if allocation == "adaptive":
        return capacity + (n_heads - 1) * (capacity - adaptive_floor(capacity))
    if allocation == "pyramid":
        return pyramid_capacities(capacity, always_kept, n_layers)[0]
    return capacity


def rule_keep(
    allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], now: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    """Keep mask [L, N, H, S] of a position rule ``allowed``: the valid slots of ``key_pos`` [L, N, H, S]
    that each row's next query ``now`` [N] may see."""
    visible = allowed(now[:, None, None], key_pos)[..., 0, :]  # queries [N, 1, 1] against keys [L, N, H, S]
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
    return torch.argsort(order, dim=-1)  # the inverse permutation: a slot's place in ``order``


def check_allocation(allocation: str, scope: str, positions: str, policy: Policy) -> None:
    """Refuse a budget allocation that does not apply: raises ValueError naming the fix.

    ``uniform`` always applies. ``adaptive`` needs scope=head, ``pyramid`` scope head or layer; both need
    positions=original (under ``cache`` different per-head counts would need per-head query ranks) and
    a :class:`~rmm.policies.base.ScorePolicy` (a position rule keeps by position and has nothing to allocate).
    """
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    if allocation == "uniform":
        return
    if not isinstance(policy, ScorePolicy):
        raise ValueError(
            f"allocation={allocation} does not apply to the position rule {policy.name!r} (it keeps by "
            "position, with no scores to allocate): use allocation=uniform, or a score-based policy"
        )
    if positions != "original":
        raise ValueError(
            f"allocation={allocation} needs positions=original (under positions={positions} heads holding "
            "different numbers of entries would need per-head query ranks): set positions=original, or "
            "allocation=uniform"
        )
    if allocation == "adaptive" and scope != "head":
        raise ValueError(
            f"allocation=adaptive lets a layer's heads compete for the layer's slots, so it needs "
            f"scope=head, got scope={scope}: set scope=head, or allocation=uniform|pyramid"
        )
    if allocation == "pyramid" and scope == "global":
        raise ValueError(
            "allocation=pyramid gives each layer its own budget, so it needs scope=head or scope=layer, "
            "got scope=global: set scope=head|layer, or allocation=uniform"
        )


def check_positions(policy: Policy, positions: str) -> None:
    """Refuse an unknown ``positions``, and ``positions=cache`` for a policy that reads keys as cached
    (:attr:`ScorePolicy.cached_keys`): there the memory holds keys unrotated and rotates them to a new rank
    at every chunk."""
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
    if positions == "cache" and isinstance(policy, ScorePolicy) and policy.cached_keys:
        raise ValueError(
            f"policy {policy.name} with policy.variant={getattr(policy, 'variant', None)} scores the keys "
            "as the cache holds them at their original positions, which positions=cache does not keep; "
            "use positions=original"
        )
