"""knorm: keep the keys with the smallest L2 norm (attention-free, no protected window).

score_j = -||k_j||_2 over every candidate j, so the B' keys of smallest norm are kept (low-norm keys
tend to draw high attention). RoPE is a rotation, so the norm is the same for rotated and unrotated
keys; equal keys at different positions differ only by the rounding of the rotations, so norms are
compared at ``SCORE_DIGITS`` significant digits and ties go to the more recent position. The policy
never needs attention probabilities, so the engine keeps its fused attention path.

``variant=kvpress`` is KnormPress's score: the same norm, not rounded (the press ranks the exact
norms; an exact tie still goes to the more recent position here).
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import SCORE_DIGITS, Observation, ScorePolicy, check_variant, register, significant


@register
@dataclass
class KNorm(ScorePolicy):
    variant: str = "harness"

    name = "knorm"
    needs = frozenset({"keys"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)

    @property
    def score_digits(self) -> int | None:
        return None if self.variant == "kvpress" else SCORE_DIGITS

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        norm = torch.linalg.vector_norm(obs.keys.double(), dim=-1)
        return -norm if self.variant == "kvpress" else -significant(norm)
