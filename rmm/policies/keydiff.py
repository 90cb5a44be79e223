"""keydiff: keep the keys least similar to the mean key direction (attention-free).

Over the valid candidates of a (layer, KV head), with unrotated keys k_j:

    u_j = k_j / ||k_j||,   m = mean_j u_j,   score_j = -<u_j, m> / ||m||

i.e. minus the cosine similarity of k_j to the mean normalised key (KeyDiff's anchor), compared at
``SCORE_DIGITS`` significant digits (equal keys tie; the more recent is kept); the B' most distinctive
keys are kept. No protected window.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rmm.policies.base import Observation, ScorePolicy, significant


@dataclass
class KeyDiff(ScorePolicy):
    name = "keydiff"
    needs = frozenset({"keys"})

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        valid = (obs.key_pos >= 0).double()[..., None]  # [L, H, S, 1]
        unit = F.normalize(obs.keys.double(), dim=-1) * valid
        anchor = F.normalize(unit.sum(dim=-2) / valid.sum(dim=-2).clamp(min=1.0), dim=-1)  # [L, H, D]
        return -significant((unit @ anchor[..., None])[..., 0])
