"""lagkv: LagKV's attention-free fixed-lag scorer; each partition is judged against the next one.

At a boundary the valid candidates of a (layer, KV head), except the ``sinks`` first positions of the
stream (always kept, as in LagKV), are sorted by position and cut into partitions of P = ``partition``
candidates counted from the most recent end: partition 0 holds the P most recent (always kept),
partition 1 the P before them, and so on; the oldest partition may hold fewer than P. For a candidate
j in partition p >= 1, with x = k_j (unrotated key) or v_j and the next, more recent, partition p - 1 as
reference:

    x'_c = (x_c - min_{i in p-1} x_{i,c}) / max(max_{i in p-1} x_{i,c} - min_{i in p-1} x_{i,c}, 1e-6)
    sigma(x) = std_c x'_c            (over the D channels, unbiased)
    score_j = softmax_{i in p} sigma(k_i) [j] + softmax_{i in p} sigma(v_i) [j]

(softmax over the candidates of j's own partition, so every partition spends the same total score). A
token whose channels stray far from the range of its successors carries information they do not; it
is the closest attention-free relative of rmm's lag: each token is judged by what follows it.
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import NEVER, Observation, Policy, check_protected, position_order

EPS = 1e-6


@dataclass
class LagKV(Policy):
    partition: int = 32
    sinks: int = 4

    name = "lagkv"
    needs = frozenset({"keys", "values"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.partition < 2:
            raise ValueError(
                f"policy.partition must be >= 2 (a reference needs two values), got {self.partition}"
            )
        if self.sinks < 0:
            raise ValueError(f"policy.sinks must be >= 0, got {self.sinks}")
        if self.budget is not None:
            check_protected("policy.sinks + policy.partition", self.sinks + self.partition, self.capacity)

    @property
    def protected(self) -> int:
        return self.partition

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        key_pos = obs.key_pos
        scores = torch.full(key_pos.shape, NEVER, device=key_pos.device)
        first = key_pos[0, 0]  # every (layer, head) holds the same number of valid and of sink candidates
        n_valid, n_sinks = int((first >= 0).sum()), int(((first >= 0) & (first < self.sinks)).sum())
        n_parts = -(-(n_valid - n_sinks) // self.partition)
        if n_parts < 2:
            return scores
        size = n_parts * self.partition
        # slot of the i-th most recent non-sink candidate, i < size (padding repeats the oldest one)
        newest_first = position_order(key_pos)[..., n_sinks:n_valid].flip(-1)
        pad = size - newest_first.shape[-1]
        index = torch.cat([newest_first, newest_first[..., -1:].expand(-1, -1, pad)], dim=-1)
        real = torch.arange(size, device=key_pos.device) < n_valid - n_sinks  # [size]
        partial = _spread_softmax(obs.keys, index, real, self.partition)
        partial += _spread_softmax(obs.values, index, real, self.partition)
        ranked = index[..., self.partition :][..., real[self.partition :]]
        return scores.scatter_(-1, ranked, partial[..., real[self.partition :]])


def _spread_softmax(x: torch.Tensor, index: torch.Tensor, real: torch.Tensor, size: int) -> torch.Tensor:
    """Softmax within each partition of the normalised channel spread: [L, H, (n_parts - 1) * size].

    x : [L, H, S, D]; index : [L, H, n_parts * size] slots, most recent first; real : [n_parts * size].
    """
    gathered = torch.gather(x.float(), 2, index[..., None].expand(-1, -1, -1, x.shape[-1]))
    parts = gathered.unflatten(2, (-1, size))  # [L, H, n_parts, P, D]
    low, high = parts.amin(dim=-2, keepdim=True), parts.amax(dim=-2, keepdim=True)
    normed = (parts[:, :, 1:] - low[:, :, :-1]) / (high - low)[:, :, :-1].clamp(min=EPS)
    spread = normed.std(dim=-1)  # [L, H, n_parts - 1, P]
    spread = spread.masked_fill(~real.view(-1, size)[1:], float("-inf"))
    return torch.softmax(spread, dim=-1).flatten(2)
