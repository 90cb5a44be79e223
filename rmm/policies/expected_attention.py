"""expected_attention: keys scored by the attention the next queries are expected to pay them (arXiv
2510.00636; kvpress's ExpectedAttentionPress, whose definition this follows), times the value norm.

At boundary ``now``, per (layer, KV head) and query head g of its group, from the chunk's unrotated
queries q_{g,s} at positions s >= ``sinks`` (N of them; kvpress's statistics of the queries since the
last compression, without the sink positions):

    mu_g = (1 / N) sum_s q_{g,s},   Sigma_g = (1 / N) sum_s (q_{g,s} - mu_g)(q_{g,s} - mu_g)^T
                                                                 (mu_g = Sigma_g = 0 when N = 0)
    Rbar = (1 / F) sum_{d=0}^{F-1} R_d                          (F = ``n_future_positions``)
    khat_j = R_{j - now} k_j                                    (k_j the unrotated key)
    z_{g,j} = (Rbar mu_g) . khat_j / sqrt(D) + khat_j^T (Rbar Sigma_g Rbar^T) khat_j / (2 D)
    e_{g,j} = softmax over the valid candidates j >= ``sinks`` of z_{g,.}
    score_j = (mean_g e_{g,j} + epsilon) * ||v_j||_2

with R_d the layer's own rotary rotation by d positions (its frequencies and pairing; partial rotary
leaves the other channels alone, a layer without positions is not rotated). This is kvpress's average
rotation over the next F positions, Rbar_now = mean_{p=now}^{now+F-1} R_p applied to the query
statistics against keys rotated at their positions j, written relative to ``now`` (R_now^T R_j =
R_{j-now}), which is equal in exact arithmetic and keeps the angles small. Positions are original
positions in both position modes. ``use_covariance=false`` drops the second term of z, ``use_vnorm=false``
scores mean_g e_{g,j} alone (epsilon unused). The first ``sinks`` positions are always kept. Attention
probabilities are never recorded: the policy keeps the fused attention path.
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import NEVER, Observation, ScorePolicy, check_protected, register


@register
@dataclass
class ExpectedAttention(ScorePolicy):
    n_future_positions: int = 512
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    name = "expected_attention"
    needs = frozenset({"queries", "keys", "values", "rotation"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future_positions < 1:
            raise ValueError(f"policy.n_future_positions must be >= 1, got {self.n_future_positions}")
        if self.sinks < 0:
            raise ValueError(f"policy.sinks must be >= 0, got {self.sinks}")
        if self.epsilon < 0:
            raise ValueError(f"policy.epsilon must be >= 0, got {self.epsilon}")
        if self.budget is not None and self.sinks:
            check_protected("policy.sinks", self.sinks, self.capacity)

    @property
    def always_kept(self) -> int:
        """Its sinks."""
        return self.sinks

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        rotary, key_pos = obs.rotary, obs.key_pos
        n_layers, _, _, head_dim = obs.keys.shape
        future = rotary.table(torch.arange(self.n_future_positions, device=key_pos.device))
        mean_rotation = {key: (cos.mean(dim=0), sin.mean(dim=0)) for key, (cos, sin) in future.items()}
        to_now = rotary.table(key_pos - now)  # [L, H, S, rot_dim / 2] per rotation
        used = (obs.query_pos >= self.sinks).double()  # [Q]
        n_used = used.sum().clamp(min=1.0)
        scores = []
        for layer in range(n_layers):
            per_layer = {key: (cos[layer], sin[layer]) for key, (cos, sin) in to_now.items()}
            keys = rotary.apply(obs.keys[layer].float(), per_layer, layer).double()  # [H, S, D]
            queries = obs.queries[layer].double()  # [H, G, Q, D]
            mean = (queries * used[:, None]).sum(dim=-2) / n_used  # [H, G, D]
            # Rbar x for the rows x of a matrix: Rotation.apply is linear in (cos, sin)
            logits = rotary.apply(mean.float(), mean_rotation, layer).double() @ keys.transpose(-1, -2)
            logits = logits / head_dim**0.5  # [H, G, S]
            if self.use_covariance:
                centred = (queries - mean[..., None, :]) * used[:, None]
                cov = centred.transpose(-1, -2) @ centred / n_used  # [H, G, D, D]
                cov = _rotate_rows(rotary, cov, mean_rotation, layer)  # Sigma Rbar^T
                cov = _rotate_rows(rotary, cov.transpose(-1, -2), mean_rotation, layer)  # Rbar Sigma Rbar^T
                logits = logits + ((keys[:, None] @ cov) * keys[:, None]).sum(dim=-1) / (2 * head_dim)
            ranked = (key_pos[layer] >= self.sinks)[:, None]  # [H, 1, S]
            expected = torch.softmax(logits.masked_fill(~ranked, float("-inf")), dim=-1).mean(dim=1)
            expected = torch.nan_to_num(expected, nan=0.0)  # a head with no ranked candidate
            if self.use_vnorm:
                norms = torch.linalg.vector_norm(obs.values[layer].double(), dim=-1)  # [H, S]
                expected = (expected + self.epsilon) * norms
            scores.append(expected)
        scores = torch.stack(scores)
        sink = (key_pos >= 0) & (key_pos < self.sinks)
        return torch.where(sink, torch.full_like(scores, NEVER), scores)


def _rotate_rows(rotary, x: torch.Tensor, table: dict, layer: int) -> torch.Tensor:
    """x [..., D, D] with every row r replaced by Rbar r (x Rbar^T), in float64 out."""
    return rotary.apply(x.float(), table, layer).double()
