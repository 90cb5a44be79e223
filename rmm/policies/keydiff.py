"""keydiff: keep the keys least similar to the mean key direction (attention-free).

Over the valid candidates of a (layer, KV head), with unrotated keys k_j:

    u_j = k_j / ||k_j||,   m = mean_j u_j,   score_j = -<u_j, m> / ||m||

i.e. minus the cosine similarity of k_j to the mean normalised key (KeyDiff's anchor), compared at
``SCORE_DIGITS`` significant digits (equal keys tie; the more recent is kept); the B' most distinctive
keys are kept. No protected window.

``variant=kvpress`` is KeyDiffPress's score: the same formula over the keys as the cache holds them,
rotated at their original positions (``cached_keys``; ``positions=original`` only), not rounded.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rmm.policies.base import SCORE_DIGITS, Observation, ScorePolicy, check_variant, register, significant


@register
@dataclass
class KeyDiff(ScorePolicy):
    variant: str = "harness"

    name = "keydiff"
    needs = frozenset({"keys"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)

    @property
    def cached_keys(self) -> bool:
        return self.variant == "kvpress"

    @property
    def score_digits(self) -> int | None:
        return None if self.variant == "kvpress" else SCORE_DIGITS

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        valid = (obs.key_pos >= 0).double()[..., None]  # [L, H, S, 1]
        unit = F.normalize(obs.keys.double(), dim=-1) * valid
        if self.variant == "kvpress":  # the press: -cosine_similarity(keys, mean of the normalised keys)
            mean = unit.sum(dim=-2, keepdim=True) / valid.sum(dim=-2, keepdim=True).clamp(min=1.0)
            return -F.cosine_similarity(obs.keys.double(), mean, dim=-1)
        anchor = F.normalize(unit.sum(dim=-2) / valid.sum(dim=-2).clamp(min=1.0), dim=-1)  # [L, H, D]
        return -significant((unit @ anchor[..., None])[..., 0])
