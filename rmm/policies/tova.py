"""tova (Token Omission Via Attention): keep the top B' by the latest query's attention."""

from dataclasses import dataclass

import torch

from rmm.policies.base import Observation, ScorePolicy


@dataclass
class TOVA(ScorePolicy):
    name = "tova"
    needs = frozenset({"attention"})

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        return obs.attention[:, :, -1, :].clone()
