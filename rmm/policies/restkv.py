"""restkv: ReST-KV's layer-wise output reconstruction (arXiv 2605.08840), over the chunk that just ended.

Removing entry j from a query head whose attention on it is a and whose output is o changes the output
to (o - a v_j) / (1 - a), by a / (1 - a) (o - v_j); through the layer's output projection W_o that is the
change of the layer's output. The score keeps the entries whose removal would change it most. Per
(layer, KV head) with G query heads, at a boundary after the chunk's queries s_1 < ... < s_Q:

    abar_s(j) = a_s(j) / G                        (the group's mean attention; a is group summed)
    m_j = sum_i w_i abar_{s_i}(j),  w_1 = beta^(Q-1),  w_i = (1 - beta) beta^(Q-i) for i >= 2
                                                  (the EMA m_i = beta m_{i-1} + (1 - beta) abar_{s_i})
    o = sum_j m_j v_j                             (the EMA of the group's mean output)
    p_j = (1 / k) sum_{|i| <= k // 2} m_{j_i}     (average pooling over position-sorted candidates,
                                                   a missing neighbour counting 0)
    score_j = p_j / max(1 - p_j, 1e-6) * || Wbar_h (o - v_j) ||_2,   Wbar_h = sum_g W_o^{(h G + g)}

where W_o^{(q)} [hidden, D] are the columns of W_o that query head q feeds (the same change o - v_j
applied to every query head of the group); a norm of at most 1e-5 (||Wbar o|| + ||Wbar v_j||) counts as 0
(o = v_j up to rounding, e.g. attention only on equal values). The B' largest are kept, ties to the more
recent position;
no protected window. Nothing accumulates across chunks. ``beta`` (default 0.8) and ``kernel`` (odd,
default 5) are the temporal and spatial smoothing.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rmm.policies.base import Observation, ScorePolicy, position_order, register

RATIO_FLOOR = 1e-6  # 1 - p_j below this counts as this (p_j = 1: all of the attention on one entry)
# ||Wbar (o - v_j)|| at most this fraction of ||Wbar o|| + ||Wbar v_j|| counts as 0: o = v_j in exact
# arithmetic (a repeated token's equal values) must tie, and rounding would otherwise rank them
CHANGE_PRECISION = 1e-5


@register
@dataclass
class ReSTKV(ScorePolicy):
    beta: float = 0.8
    kernel: int = 5

    name = "restkv"
    needs = frozenset({"attention", "values", "output_projection"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"policy.beta must be in [0, 1), got {self.beta}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"policy.kernel must be an odd integer >= 1, got {self.kernel}")
        self._gram_of: torch.Tensor | None = None  # the output projection the cached Gram matrices are of
        self._gram: torch.Tensor | None = None

    def gram(self, projection: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Wbar_h^T Wbar_h [L, H, D, D] in float64, once per output projection (the same every chunk)."""
        if self._gram_of is not projection:
            per_head = projection.double().unflatten(-1, (-1, head_dim)).sum(dim=-2)  # [L, H, hidden, D]
            self._gram, self._gram_of = per_head.transpose(-1, -2) @ per_head, projection
        return self._gram

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        values = obs.values.double()  # [L, H, S, D]
        projection = obs.output_projection
        group = projection.shape[-1] // values.shape[-1]
        attention = obs.attention.double() / group  # [L, H, Q, S]
        n_q = attention.shape[-2]
        steps = torch.arange(n_q - 1, -1, -1, dtype=torch.float64, device=attention.device)
        weights = (1.0 - self.beta) * self.beta**steps
        weights[0] = self.beta ** (n_q - 1)
        ema = (attention * weights[:, None]).sum(dim=-2)  # [L, H, S]
        output = (ema[..., None] * values).sum(dim=-2)  # [L, H, D]
        key_pos = obs.key_pos
        valid = key_pos >= 0
        order = position_order(key_pos)
        in_order = torch.gather(torch.where(valid, ema, 0.0), -1, order).flatten(0, 1)[:, None]
        pooled = F.avg_pool1d(in_order, self.kernel, stride=1, padding=self.kernel // 2).view_as(ema)
        p = torch.empty_like(ema).scatter_(-1, order, pooled)
        gram = self.gram(projection, values.shape[-1])
        size = _norm(output[..., None, :] - values, gram)  # [L, H, S]
        scale = _norm(output[..., None, :], gram) + _norm(values, gram)
        size = torch.where(size <= CHANGE_PRECISION * scale, 0.0, size)  # o = v_j up to rounding: no change
        return p / (1.0 - p).clamp(min=RATIO_FLOOR) * size


def _norm(x: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """||Wbar x|| = sqrt(x^T Wbar^T Wbar x) for x [L, H, S, D] and the Gram matrices [L, H, D, D]."""
    return ((x @ gram) * x).sum(dim=-1).clamp(min=0.0).sqrt()
