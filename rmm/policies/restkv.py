"""restkv: ReST-KV's layer-wise output reconstruction (arXiv 2605.08840), over the chunk that just ended.

Removing entry j from a query head whose attention on it is a and whose output is o changes the output
to (o - a v_j) / (1 - a), by a / (1 - a) (o - v_j); through the layer's output projection W_o that is the
change of the layer's output. The score keeps the entries whose removal would change it most.

``variant=harness`` (the default) follows its own formula. Per (layer, KV head) with G query heads, at a
boundary after the chunk's queries s_1 < ... < s_Q:

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

``variant=official`` is the score of ``RestKVCluster.update_kv`` in the authors' code (an-yongqi/rest-kv,
restkv/restkv_utils.py) in the paper's configuration (``--use_wo --use_ema --alpha 0.3 --metric_mode
after --pooling adaptive --scale 2000``, window 32, kernel 5, tau 1). That code repeats every KV head to
its G query heads (``repeat_kv``) before compressing and keeps one selection per query head; it never
reduces over a group. A per-(layer, KV head) memory holds that exactly only when G = 1, so the variant
refuses a model with G > 1 (ValueError at the first chunk); ``+model.repeat_kv=true`` loads a GQA model
with its KV heads repeated per query head (:mod:`rmm.kv_heads`), which is the official code's memory. With
W = ``window``, the chunk's last W queries s_1 < ... < s_W (W <= C) and K = B' - W, per (layer, head):

    scored: the valid candidates older than the window (j < now - W), sorted by position, n of them;
            the W most recent positions are always kept
    m_j = EMA over the window's queries: m <- a_{s_1}(j), then m <- alpha a_{s_i}(j) + (1 - alpha) m
    o = sum_{j scored} m_j v_j                      (the window's own keys left out)
    r_j = m_j / (1 - m_j) * || W_o^{(h)} (o - v_j) ||_2    (no clamp, no rounding to 0)
    t = mean over i < W/2 and the K highest-attended keys of (index of the rank's key under s_i
        minus under s_{W/2 + i}), indices in the position order of all valid candidates (window included)
        and keys ranked by attention, ties to the later index; its numerator is computed in integers
    k_h = max(kernel, 2 floor(|t| / scale) + 1),  shift_h = floor(t / scale) (t > 0), floor(t / scale) + 1
    score of the i-th scored candidate = (1 / k_h) sum_{|d| <= k_h // 2} r_{clamp(i + shift_h + d, 0, n - 1)}
                                       (replicate padding at both ends, as F.pad(mode='replicate'))

The official code compresses once, after the prefill, with the prompt as its cache; here it runs at every
boundary over the memory's candidates (docs/semantics.md). ``alpha`` (0.3), ``window`` (32, even),
``scale`` (2000) are the official variant's parameters; ``kernel`` both variants', ``beta`` the harness's.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rmm.policies.base import (
    Observation,
    ScorePolicy,
    check_protected,
    position_order,
    protect_recent,
    register,
)

RATIO_FLOOR = 1e-6  # 1 - p_j below this counts as this (p_j = 1: all of the attention on one entry)
# ||Wbar (o - v_j)|| at most this fraction of ||Wbar o|| + ||Wbar v_j|| counts as 0: o = v_j in exact
# arithmetic (a repeated token's equal values) must tie, and rounding would otherwise rank them
CHANGE_PRECISION = 1e-5
VARIANTS = ("harness", "official")
# the official variant's parameters at the paper's configuration (the authors' README and scripts)
OFFICIAL = {"window": 32, "alpha": 0.3, "scale": 2000}
HARNESS_BETA = 0.8


@register
@dataclass
class ReSTKV(ScorePolicy):
    beta: float = HARNESS_BETA
    kernel: int = 5
    variant: str = "harness"
    window: int = OFFICIAL["window"]
    alpha: float = OFFICIAL["alpha"]
    scale: int = OFFICIAL["scale"]

    name = "restkv"
    needs = frozenset({"attention", "values", "output_projection"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"policy.beta must be in [0, 1), got {self.beta}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"policy.kernel must be an odd integer >= 1, got {self.kernel}")
        if self.variant not in VARIANTS:
            raise ValueError(f"policy.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.variant == "harness":
            for key, default in OFFICIAL.items():
                if getattr(self, key) != default:
                    raise ValueError(
                        f"policy.{key} is a parameter of policy.variant=official; the harness variant "
                        f"has no {key}: set policy.variant=official or leave policy.{key}={default}"
                    )
        else:
            self._check_official()
        self._gram_of: torch.Tensor | None = None  # the output projection the cached Gram matrices are of
        self._gram: torch.Tensor | None = None

    def _check_official(self) -> None:
        if self.beta != HARNESS_BETA:
            raise ValueError(
                "policy.beta is the harness variant's EMA factor; policy.variant=official smooths with "
                f"policy.alpha: leave policy.beta={HARNESS_BETA}"
            )
        if self.window < 2 or self.window % 2:
            raise ValueError(
                f"policy.window must be an even integer >= 2 for policy.variant=official (its adaptive "
                f"pooling compares the window's two halves), got {self.window}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"policy.alpha must be in [0, 1], got {self.alpha}")
        if type(self.scale) is not int or self.scale < 1:
            raise ValueError(f"policy.scale must be an integer >= 1, got {self.scale!r}")
        if self.window > self.chunk:
            raise ValueError(
                f"policy.window ({self.window}) must not exceed chunk ({self.chunk}) for "
                "policy.variant=official: its EMA reads the window's queries, which must all be in the "
                f"chunk; set chunk>={self.window} or lower policy.window"
            )
        if self.budget is not None:
            check_protected("policy.window", self.window, self.capacity)

    @property
    def protected(self) -> int:
        return self.window if self.variant == "official" else 0

    def gram(self, projection: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Wbar_h^T Wbar_h [L, H, D, D] in float64, once per output projection (the same every chunk)."""
        if self._gram_of is not projection:
            per_head = projection.double().unflatten(-1, (-1, head_dim)).sum(dim=-2)  # [L, H, hidden, D]
            self._gram, self._gram_of = per_head.transpose(-1, -2) @ per_head, projection
        return self._gram

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        if self.variant == "official":
            _check_group(obs.output_projection, obs.values.shape[-1])

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        if self.variant == "official":
            return self._official(obs, now)
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

    def _official(self, obs: Observation, now: int) -> torch.Tensor:
        """RestKVCluster's score (metric_mode=after, use_wo, use_ema, adaptive pooling, tau 1) per head."""
        values = obs.values.double()  # [L, H, S, D]
        projection = obs.output_projection
        _check_group(projection, values.shape[-1])
        window, key_pos = self.window, obs.key_pos
        if obs.attention.shape[-2] < window:
            raise ValueError(f"policy.variant=official needs the window's {window} queries in the chunk")
        attention = obs.attention[..., -window:, :].double()  # [L, H, W, S]: the window's queries
        valid = key_pos >= 0
        scored = valid & (key_pos < now - window)
        # the EMA over the window's queries, oldest first: m <- alpha a_i + (1 - alpha) m, started at a_1
        steps = torch.arange(window - 1, -1, -1, dtype=torch.float64, device=attention.device)
        weights = self.alpha * (1.0 - self.alpha) ** steps
        weights[0] = (1.0 - self.alpha) ** (window - 1)
        ema = torch.where(scored, (attention * weights[:, None]).sum(dim=-2), 0.0)  # [L, H, S]
        output = (ema[..., None] * values).sum(dim=-2)  # [L, H, D], over the scored candidates only
        size = _norm(output[..., None, :] - values, self.gram(projection, values.shape[-1]))
        raw = ema / (1.0 - ema) * size  # [L, H, S]
        # adaptive pooling over the scored candidates in position order (they come first: the oldest)
        order = position_order(key_pos)
        kernel, shift = self._adaptive(attention, valid, order)  # [L, H] each
        n = scored.sum(dim=-1, keepdim=True)  # [L, H, 1]
        in_order = torch.gather(raw, -1, order)
        index = torch.arange(raw.shape[-1], device=raw.device)
        pooled = torch.zeros_like(raw)
        half = kernel // 2  # at most max(k // 2, (S - 1) // scale): t is a mean of index differences < S
        widest = max(self.kernel // 2, (raw.shape[-1] - 1) // self.scale)  # a host bound: no read of half
        for d in range(-widest, widest + 1):
            at = (index + shift[..., None] + d).clamp(min=0)
            at = torch.minimum(at, (n - 1).clamp(min=0))
            term = torch.gather(in_order, -1, at)
            pooled += torch.where(half[..., None] >= abs(d), term, 0.0)
        pooled = pooled / kernel[..., None]
        scores = torch.empty_like(raw).scatter_(-1, order, pooled)
        scores = torch.where(scored, scores, 0.0)
        return protect_recent(scores, key_pos, now, window)

    def _adaptive(
        self, attention: torch.Tensor, valid: torch.Tensor, order: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (layer, head) kernel size and shift from how the window's two halves rank the keys."""
        window = self.window
        in_order = torch.gather(attention, -1, order[..., None, :].expand_as(attention))  # [L, H, W, S]
        valid_in_order = torch.gather(valid, -1, order)[..., None, :]
        in_order = torch.where(valid_in_order, in_order, -torch.inf)
        ranked = torch.sort(in_order, dim=-1, stable=True).indices  # ascending; ties: the later index last
        n_valid = valid.sum(dim=-1)  # [L, H]
        top = torch.clamp(n_valid, max=self.capacity - window)  # K = B' - W (fewer keys: all of them)
        place = torch.arange(ranked.shape[-1], device=ranked.device)
        chosen = place >= ranked.shape[-1] - top[..., None, None]  # the last K of the ascending order
        sums = torch.where(chosen, ranked, 0).sum(dim=-1)  # [L, H, W]: summed indices of the K keys
        first, second = sums[..., : window // 2], sums[..., window // 2 :]
        numerator = (first - second).sum(dim=-1)  # [L, H], t = numerator / count
        denominator = (window // 2) * top * self.scale
        floor = torch.div(numerator, denominator, rounding_mode="floor")
        shift = torch.where(numerator > 0, floor, floor + 1)
        grown = 2 * torch.div(numerator.abs(), denominator, rounding_mode="floor") + 1
        return grown.clamp(min=self.kernel), shift


def _check_group(projection: torch.Tensor, head_dim: int) -> None:
    group = projection.shape[-1] // head_dim
    if group != 1:
        raise ValueError(
            f"policy.variant=official keeps one selection per query head, as the official code does "
            f"(it repeats each KV head to its query heads before compressing); this model has {group} "
            "query heads per KV head, which a per-(layer, KV head) memory cannot hold: load it with one "
            "KV head per query head (+model.repeat_kv=true, as the official code's repeat_kv), use a model "
            "without grouped-query attention (G = 1), or policy.variant=harness"
        )


def _norm(x: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """||Wbar x|| = sqrt(x^T Wbar^T Wbar x) for x [L, H, S, D] and the Gram matrices [L, H, D, D]."""
    return ((x @ gram) * x).sum(dim=-1).clamp(min=0.0).sqrt()
