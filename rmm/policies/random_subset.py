"""random: a recent window plus a seeded, uniformly random subset of older positions.

Each (layer, head, position) gets a fixed pseudo-random priority from a hash of ``seed`` (the run's
``seed``, through ``conf/policy/random.yaml``), so the choice is reproducible, independent of the chunk
size, and eviction stays permanent.
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import Observation, RecentRatioPolicy, protect_recent, register

_MASK52 = (1 << 52) - 1


def hashed_uniform(seed: int, key_pos: torch.Tensor) -> torch.Tensor:
    """A uniform [0, 1) priority per (layer, head, position) for ``key_pos`` [L, H, S] (splitmix64)."""
    n_layers, n_heads, _ = key_pos.shape
    layer = torch.arange(n_layers, device=key_pos.device)[:, None, None]
    head = torch.arange(n_heads, device=key_pos.device)[None, :, None]
    x = ((seed * 1_000_003 + layer) * 1_000_003 + head) * 1_000_003 + key_pos
    x = x + 0x1E3779B97F4A7C15  # int64 arithmetic wraps, as splitmix64 expects
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * 0x3F58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * 0x14D049BB133111EB
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 11) & _MASK52).double() / float(1 << 52)


@register
@dataclass
class RandomSubset(RecentRatioPolicy):
    seed: int = 0

    name = "random"

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        priority = hashed_uniform(self.seed, obs.key_pos).float()
        return protect_recent(priority, obs.key_pos, now, self.protected)
