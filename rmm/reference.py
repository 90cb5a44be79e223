"""A slow, obviously-correct reference: token-by-token decoding with physical eviction.

For every token the model runs once with eager attention over a Hugging Face ``DynamicCache`` that
holds exactly the retained set R_t of each (layer, KV head), rebuilt from unrotated keys at the
positions the protocol prescribes (original positions, or ranks for ``positions=cache``). Policy
rules are written out directly from the protocol (python over explicit position lists), sharing
nothing with :mod:`rmm.policies` except the seeded hash of ``random``. Used by the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from rmm.integration import Rotary
from rmm.models import describe_model
from rmm.policies.random_subset import hashed_uniform


@dataclass
class ReferenceSpec:
    """The policy, spelled out. ``budget`` None means unbounded."""

    policy: str
    budget: int | None = None
    chunk: int = 1
    positions: str = "original"
    scope: str = "head"
    sinks: int = 4
    rho: float = 0.5
    lag: int = 0
    weight: str = "correct"
    after_commit: str = "accumulate"
    variant: str = "next_use"
    tau: float = 0.02
    seed: int = 0
    retained_log: list = field(default_factory=list)  # R_t per query: [L][H] lists of positions


def reference_attention(model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """Full causal eager attention of the whole stream, GQA group summed: [L, H, n, n]."""
    model.set_attn_implementation("eager")
    out = model(tokens[None], output_attentions=True, use_cache=False)
    n_kv = describe_model(model)["n_kv_heads"]
    return torch.stack([a[0].view(n_kv, -1, *a.shape[-2:]).sum(1) for a in out.attentions]).float()


@torch.no_grad()
def reference_stream(model: PreTrainedModel, tokens: torch.Tensor, spec: ReferenceSpec):
    """Returns (nll [n-1], correct [n-1]) decoding ``tokens`` one at a time under ``spec``."""
    n = tokens.numel()
    dims = describe_model(model)
    n_layers, n_kv, head_dim = dims["n_layers"], dims["n_kv_heads"], dims["head_dim"]
    rotary = Rotary(model)
    future = None
    if spec.policy == "oracle":
        future = reference_attention(model, tokens)
    model.set_attn_implementation("eager")
    raw_keys = torch.zeros(n_layers, n, n_kv, head_dim)
    values = torch.zeros(n_layers, n, n_kv, head_dim)
    retained = [[[] for _ in range(n_kv)] for _ in range(n_layers)]  # R_t as sorted position lists
    stats = torch.zeros(n_layers, n_kv, n, dtype=torch.float64)  # accumulated (weighted) attention
    last = torch.zeros(n_layers, n_kv, n, dtype=torch.float64)  # latest query's attention
    nll, correct = torch.zeros(n - 1), torch.zeros(n - 1, dtype=torch.bool)
    for t in range(n):
        spec.retained_log.append([[list(r) for r in layer] for layer in retained])
        m = len(retained[0][0])
        cache = DynamicCache()
        for layer in range(n_layers):
            index = torch.tensor(retained[layer], dtype=torch.long).view(n_kv, m)
            heads = torch.arange(n_kv)[:, None]
            key_pos = index if spec.positions == "original" else torch.arange(m).expand(n_kv, m)
            keys = rotary.rotate(raw_keys[layer][index, heads], key_pos)  # [H, m, D]
            cache.update(keys[None], values[layer][index, heads][None], layer)
        query_pos = t if spec.positions == "original" else m
        out = model(
            tokens[None, t : t + 1],
            position_ids=torch.tensor([[query_pos]]),
            cache=cache,
            use_cache=True,
            output_attentions=True,
        )
        for layer in range(n_layers):
            new_key = out.past_key_values.layers[layer].keys[0, :, -1]  # [H, D], rotated at query_pos
            raw_keys[layer, t] = rotary.rotate(new_key, torch.tensor(-query_pos))
            values[layer, t] = out.past_key_values.layers[layer].values[0, :, -1]
        log_probs = torch.log_softmax(out.logits[0, -1].float(), -1)
        weight = 1.0
        if t + 1 < n:
            nll[t] = -log_probs[tokens[t + 1]]
            correct[t] = bool(log_probs.argmax() == tokens[t + 1])
            weight = {"correct": float(correct[t]), "prob": math.exp(-nll[t].item())}.get(spec.weight, 1.0)
        else:
            weight = 1.0 if spec.weight == "uniform" else 0.0
        for layer in range(n_layers):
            attn = out.attentions[layer][0, :, 0].view(n_kv, -1, m + 1).sum(1).double()  # [H, m + 1]
            for h in range(n_kv):
                seen = retained[layer][h] + [t]
                last[layer, h].zero_()
                for j, a in zip(seen, attn[h].tolist(), strict=True):
                    last[layer, h, j] = a
                    if spec.policy == "h2o":
                        stats[layer, h, j] += a
                    elif spec.policy == "rmm" and (spec.after_commit == "accumulate" or t - j <= spec.lag):
                        stats[layer, h, j] += a * weight
        if t + 1 < n:
            _decide(spec, retained, t + 1, stats, last, future, n)
    return nll, correct


def _decide(spec: ReferenceSpec, retained: list, now: int, stats, last, future, n: int) -> None:
    """Turn R_{now-1} plus {now-1} into R_now, in place."""
    n_layers, n_kv = len(retained), len(retained[0])
    for layer in range(n_layers):
        for h in range(n_kv):
            retained[layer][h].append(now - 1)
    if spec.policy in ("full", "window", "streaming_llm"):
        for layer in range(n_layers):
            for h in range(n_kv):
                retained[layer][h] = [j for j in retained[layer][h] if _visible(spec, now, j)]
        return
    if now % spec.chunk != 0:
        return
    capacity = spec.budget - spec.chunk + 1
    scores = {
        (layer, h): {
            j: _score(spec, layer, h, j, now, capacity, stats, last, future, n) for j in retained[layer][h]
        }
        for layer in range(n_layers)
        for h in range(n_kv)
    }
    if spec.scope != "head":
        groups = {}
        for (layer, _), table in scores.items():
            groups.setdefault(layer if spec.scope == "layer" else 0, []).append(table)
        reduce = max if (spec.policy == "oracle" and spec.variant == "next_use") else math.fsum
        for layer, h in scores:
            tables = groups[layer if spec.scope == "layer" else 0]
            scores[(layer, h)] = {j: _combine(reduce, [tab[j] for tab in tables]) for j in scores[(layer, h)]}
    for (layer, h), table in scores.items():
        ranked = sorted(table, key=lambda j: (table[j], j), reverse=True)
        retained[layer][h] = sorted(ranked[:capacity])


def _combine(reduce, values: list[float]) -> float:
    return math.inf if math.inf in values else reduce(values)


def _visible(spec: ReferenceSpec, now: int, j: int) -> bool:
    if spec.policy == "full":
        return True
    if spec.policy == "window":
        return j >= now - spec.budget
    return j < spec.sinks or j >= now - (spec.budget - spec.sinks)


def _score(
    spec: ReferenceSpec, layer: int, h: int, j: int, now: int, capacity: int, stats, last, future, n: int
) -> float:
    if spec.policy in ("h2o", "random") and j >= now - int(spec.rho * capacity):
        return math.inf
    if spec.policy == "rmm" and j >= now - spec.lag:
        return math.inf
    if spec.policy in ("h2o", "rmm"):
        return float(torch.tensor(stats[layer, h, j].item(), dtype=torch.float32))
    if spec.policy == "tova":
        return float(torch.tensor(last[layer, h, j].item(), dtype=torch.float32))
    if spec.policy == "random":
        return (
            hashed_uniform(spec.seed, torch.tensor([[[j]]]).expand(layer + 1, h + 1, 1))[layer, h, 0]
            .float()
            .item()
        )
    if spec.policy == "oracle":
        requests = future[layer, h, now:, j]
        if spec.variant == "future_mass":
            return float(requests[requests >= spec.tau].sum())
        hits = torch.nonzero(requests >= spec.tau)
        return -float(now + hits[0, 0]) if len(hits) else -float(n)
    raise ValueError(f"reference has no rule for policy {spec.policy!r}")
