"""lagkv: LagKV's attention-free fixed-lag scorer; each partition is judged by the one that follows it.

After the first ``sinks`` positions of the stream (always kept, as in LagKV), positions are cut into
partitions of P = ``partition`` consecutive positions: partition k holds [S + kP, S + (k + 1)P). When
partition k + 1 is complete (S + (k + 2)P tokens have arrived), every j of partition k is scored once,
against partition k + 1 as reference: with x = k_j (unrotated key) or v_j, and min_c, max_c over the P
positions of partition k + 1,

    x'_c = (x_c - min_c) / max(max_c - min_c, 1e-6)
    sigma(x) = std_c x'_c            (over the D channels, unbiased)
    score_j = softmax_{i in k} sigma(k_i) [j] + softmax_{i in k} sigma(v_i) [j]

(softmax over the P positions of partition k, so every partition spends the same total score), compared
at ``SCORE_DIGITS`` significant digits (equal tokens tie; the more recent is kept). The score then stays
fixed. Positions not yet scored (the newest P to 2P - 1) are always kept, so both
partitions are whole when they are scored; this needs sinks + 2P - 1 < B'. A token whose channels
stray from the range of its successors carries information they do not: like rmm's lag, each token
is judged by what follows it, here without attention.

``variant=kvpress`` is LagKVPress's score (``cross_scoring=False``, its default), recomputed from the
candidates at every boundary as the press scores a prefilled cache: the valid candidates sorted by
position are the cache, indexed 0..n-1; the first S indices are sinks, partitions of P cache indices
follow, and every whole partition but the last is scored against the next one, by its keys as the cache
holds them (rotated at their original positions: ``cached_keys``, ``positions=original`` only) and its
values, with the press's min-max normalisation (no floor on max - min) and
score = rank within the partition of (softmax sigma(k) + softmax sigma(v)) / 2, divided by P (0, 1/P, ...,
(P - 1)/P; equal values ranked by index). Sinks and the tail (the last whole partition and what follows
it, P to 2P - 1 indices) score 1. Under n < S + 2P cache entries the press scores index i >= S as
(i - S) / (n - S) (recency) and the sinks 1. Scores are not rounded; ties (equal ranks in different
partitions) go to the more recent position, where the press's top-k leaves them to the kernel.
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import (
    NEVER,
    SCORE_DIGITS,
    Observation,
    ScorePolicy,
    check_protected,
    check_variant,
    position_order,
    register,
    significant,
)

EPS = 1e-6


@register
@dataclass
class LagKV(ScorePolicy):
    partition: int = 16
    sinks: int = 4
    variant: str = "harness"

    name = "lagkv"
    needs = frozenset({"keys", "values"})
    state_names = ("lag_score",)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)
        if self.partition < 2:
            raise ValueError(
                f"policy.partition must be >= 2 (min and max need two values), got {self.partition}"
            )
        if self.sinks < 0:
            raise ValueError(f"policy.sinks must be >= 0, got {self.sinks}")
        if self.budget is not None:
            check_protected("policy.sinks + 2 * policy.partition - 1", self.always_kept, self.capacity)

    @property
    def protected(self) -> int:
        """The newest positions are unscored: between P and 2P - 1 of them (the upper bound)."""
        return 2 * self.partition - 1

    @property
    def always_kept(self) -> int:
        """The sinks and the unscored newest positions (at most 2P - 1)."""
        return self.sinks + self.protected

    @property
    def lookback(self) -> int:
        """A partition is scored with its successor once that one is whole: up to 2P - 1 positions
        behind the previous boundary (``kvpress``: 0, it reads the candidates at the boundary only)."""
        return 0 if self.variant == "kvpress" else 2 * self.partition - 1

    @property
    def cached_keys(self) -> bool:
        return self.variant == "kvpress"

    def scored_partitions(self, tokens: int) -> int:
        """How many partitions are scored once ``tokens`` tokens have arrived (their successor is whole)."""
        return max(0, (tokens - self.sinks) // self.partition - 1)

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        """Score the partitions whose successor the chunk completed."""
        if self.variant == "kvpress":  # scored afresh at every boundary
            return
        start, now = int(obs.query_pos[0]), int(obs.query_pos[-1]) + 1
        first, stop = self.scored_partitions(start), self.scored_partitions(now)
        if stop <= first:
            return
        size = self.partition
        begin = self.sinks + first * size  # positions [begin, now) are all candidates: none was scored yet
        n_valid = (obs.key_pos >= 0).sum(dim=-1, keepdim=True)  # [L, H, 1]: a windowed layer holds fewer
        first_slot = n_valid - (now - begin) + torch.arange((stop - first + 1) * size, device=n_valid.device)
        window = torch.gather(position_order(obs.key_pos), -1, first_slot)
        total = _spread_softmax(obs.keys, window, size) + _spread_softmax(obs.values, window, size)
        state["lag_score"].scatter_(-1, window[..., : (stop - first) * size], total)

    @property
    def score_digits(self) -> int | None:
        return None if self.variant == "kvpress" else SCORE_DIGITS

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        if self.variant == "kvpress":
            return self.press_scores(obs)
        unscored = self.sinks + self.scored_partitions(now) * self.partition
        keep = (obs.key_pos < self.sinks) | (obs.key_pos >= unscored)
        scores = significant(state["lag_score"])  # compared at SCORE_DIGITS digits: equal keys tie
        return torch.where(keep, torch.full_like(scores, NEVER), scores)

    def press_scores(self, obs: Observation) -> torch.Tensor:
        """LagKVPress's scores [L, H, S] of the valid candidates (the cache: sorted by position)."""
        key_pos = obs.key_pos
        order = position_order(key_pos)  # valid oldest first, empty slots last
        n_valid = (key_pos >= 0).sum(dim=-1).flatten()  # [L * H]: a windowed layer holds fewer
        dim = obs.keys.shape[-1]
        index = order[..., None].expand(-1, -1, -1, dim)
        keys = torch.gather(obs.keys.float(), 2, index).flatten(0, 1)  # [L * H, S, D], cache order
        values = torch.gather(obs.values.float(), 2, index).flatten(0, 1)
        in_order = torch.zeros(n_valid.numel(), key_pos.shape[-1], device=key_pos.device)
        for n in n_valid.unique().tolist():
            heads = n_valid == n
            in_order[heads, :n] = _press_scores(
                keys[heads, :n], values[heads, :n], self.sinks, self.partition
            )
        return torch.empty_like(in_order).view_as(key_pos).scatter_(-1, order, in_order.view_as(key_pos))


def _press_scores(keys: torch.Tensor, values: torch.Tensor, sinks: int, size: int) -> torch.Tensor:
    """LagKVPress.score (cross_scoring=False) of caches keys, values [B, n, D] -> [B, n]."""
    batch, n, dim = keys.shape
    if n < sinks + 2 * size:  # too short to score: the sinks, then recency
        score = torch.ones(batch, n, device=keys.device)
        if n > sinks:
            score[:, sinks:] = torch.arange(n - sinks, device=keys.device) / (n - sinks)
        return score
    end = sinks + (n - sinks) // size * size
    halves = [_press_states(x[:, sinks:end].view(batch, -1, size, dim), size) for x in (keys, values)]
    ranks = ((halves[0] + halves[1]) / 2).argsort(dim=-1, stable=True).argsort(dim=-1) / size
    sink, tail = (
        torch.ones(batch, sinks, device=keys.device),
        torch.ones(batch, size + n - end, device=keys.device),
    )
    return torch.cat([sink, ranks.flatten(1), tail], dim=-1)


def _press_states(x: torch.Tensor, size: int) -> torch.Tensor:
    """softmax over a partition of sigma(x'), x' min-max normalised by the next partition: x [B, m, P, D] ->
    [B, m - 1, P] (LagKVPress._get_states_score)."""
    low, high = torch.aminmax(x[:, 1:], dim=-2, keepdim=True)
    return ((x[:, :-1] - low) / (high - low)).std(dim=-1).softmax(dim=-1)


def _spread_softmax(x: torch.Tensor, window: torch.Tensor, size: int) -> torch.Tensor:
    """x [L, H, S, D]; window [L, H, (m + 1) * size] slots of m + 1 whole partitions, oldest first.

    Returns the score part [L, H, m * size] of the first m partitions, each against the next one.
    """
    parts = torch.gather(x.float(), 2, window[..., None].expand(-1, -1, -1, x.shape[-1])).unflatten(
        2, (-1, size)
    )
    low, high = torch.aminmax(parts[:, :, 1:], dim=-2, keepdim=True)  # [L, H, m, 1, D]
    spread = ((parts[:, :, :-1] - low) / (high - low).clamp(min=EPS)).std(dim=-1)  # [L, H, m, P]
    return torch.softmax(spread, dim=-1).flatten(2)
