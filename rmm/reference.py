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

from rmm.models import describe_model
from rmm.policies.random_subset import hashed_uniform
from rmm.rotary import Rotary

POSITION_RULES = ("full", "window", "streaming_llm")
SCORE_POLICIES = (
    "h2o",
    "rmm",
    "tova",
    "random",
    "oracle",
    "observed_attention",
    "snapkv",
    "knorm",
    "keydiff",
    "lru",
    "lagkv",
)


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
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    partition: int = 32
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
    seen = [[{} for _ in range(n_kv)] for _ in range(n_layers)]  # j -> number of queries that saw j
    last_use = [[{} for _ in range(n_kv)] for _ in range(n_layers)]  # j -> last s with a_s(j) >= tau
    rows = []  # per query t: [L][H] {j: a_t(j)}
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
        rows.append([[{} for _ in range(n_kv)] for _ in range(n_layers)])
        for layer in range(n_layers):
            attn = out.attentions[layer][0, :, 0].view(n_kv, -1, m + 1).sum(1).double()  # [H, m + 1]
            for h in range(n_kv):
                visible = retained[layer][h] + [t]
                last[layer, h].zero_()
                for j, a in zip(visible, attn[h].tolist(), strict=True):
                    rows[t][layer][h][j] = a
                    seen[layer][h][j] = seen[layer][h].get(j, 0) + 1
                    if a >= spec.tau or j == t:
                        last_use[layer][h][j] = t
                    last[layer, h, j] = a
                    if spec.policy in ("h2o", "observed_attention"):
                        stats[layer, h, j] += a
                    elif spec.policy == "rmm" and (spec.after_commit == "accumulate" or t - j <= spec.lag):
                        stats[layer, h, j] += a * weight
        if t + 1 < n:
            data = {"keys": raw_keys, "values": values, "seen": seen, "last_use": last_use, "rows": rows}
            _decide(spec, retained, t + 1, stats, last, future, n, data)
    return nll, correct


def _decide(spec: ReferenceSpec, retained: list, now: int, stats, last, future, n: int, data: dict) -> None:
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
    if spec.policy in NEW_RULES:
        scores = {
            (layer, h): NEW_RULES[spec.policy](spec, layer, h, retained[layer][h], now, capacity, stats, data)
            for layer in range(n_layers)
            for h in range(n_kv)
        }
    else:
        scores = {
            (layer, h): {
                j: _score(spec, layer, h, j, now, capacity, stats, last, future, n)
                for j in retained[layer][h]
            }
            for layer in range(n_layers)
            for h in range(n_kv)
        }
    if spec.scope != "head":
        groups = {}
        for (layer, _), table in scores.items():
            groups.setdefault(layer if spec.scope == "layer" else 0, []).append(table)
        latest = (spec.policy == "oracle" and spec.variant == "next_use") or spec.policy == "lru"
        reduce = max if latest else math.fsum
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


# ---- the rules of observed_attention, snapkv, knorm, keydiff, lru, lagkv -------------------------
# Each takes one (layer, KV head)'s candidates (sorted positions) at boundary ``now`` and returns
# {position: score}; math.inf marks a position that is always kept. Plain Python over explicit lists.


def _observed_attention(spec, layer, h, candidates, now, capacity, stats, data) -> dict[int, float]:
    """A_j / n_j, the r = floor(rho * B') most recent positions kept."""
    recent = int(spec.rho * capacity)
    seen = data["seen"][layer][h]
    return {j: math.inf if j >= now - recent else stats[layer, h, j].item() / seen[j] for j in candidates}


def _snapkv(spec, layer, h, candidates, now, capacity, stats, data) -> dict[int, float]:
    """Mean attention of the chunk's last min(window, C) queries, pooled over position-sorted neighbours."""
    queries = range(now - min(spec.window, spec.chunk), now)
    rows = [data["rows"][s][layer][h] for s in queries]
    mean = [math.fsum(row.get(j, 0.0) for row in rows) / len(rows) for j in candidates]
    half = spec.kernel // 2
    scores = {}
    for i, j in enumerate(candidates):
        around = [mean[i + d] if 0 <= i + d < len(candidates) else 0.0 for d in range(-half, half + 1)]
        pooled = math.fsum(around) / spec.kernel if spec.pooling == "avg" else max(around)
        scores[j] = math.inf if j >= now - spec.window else pooled
    return scores


def _knorm(spec, layer, h, candidates, now, capacity, stats, data) -> dict[int, float]:
    """Minus the L2 norm of the key."""
    keys = data["keys"][layer]
    return {j: -math.sqrt(math.fsum(x * x for x in keys[j, h].double().tolist())) for j in candidates}


def _keydiff(spec, layer, h, candidates, now, capacity, stats, data) -> dict[int, float]:
    """Minus the cosine similarity of the unrotated key to the mean normalised key."""
    keys = data["keys"][layer]
    units = {}
    for j in candidates:
        k = keys[j, h].double().tolist()
        norm = math.sqrt(math.fsum(x * x for x in k))
        units[j] = [x / norm for x in k]
    n_channels = len(units[candidates[0]])
    mean = [math.fsum(units[j][c] for j in candidates) / len(candidates) for c in range(n_channels)]
    mean_norm = math.sqrt(math.fsum(x * x for x in mean))
    return {j: -math.fsum(a * b for a, b in zip(units[j], mean, strict=True)) / mean_norm for j in candidates}


def _lru(spec, layer, h, candidates, now, capacity, stats, data) -> dict[int, float]:
    """The last query s with a_s(j) >= tau, or j itself."""
    return {j: float(data["last_use"][layer][h][j]) for j in candidates}


def _lagkv(spec, layer, h, candidates, now, capacity, stats, data) -> dict[int, float]:
    """Partitions of P from the most recent end, each normalised by the next; sinks and partition 0 kept."""
    scores = {j: math.inf for j in candidates}
    rest = [j for j in candidates if j >= spec.sinks][::-1]  # most recent first
    parts = [rest[i : i + spec.partition] for i in range(0, len(rest), spec.partition)]
    for p in range(1, len(parts)):
        total = dict.fromkeys(parts[p], 0.0)
        for source in (data["keys"], data["values"]):
            rows = {j: source[layer][j, h].double().tolist() for j in parts[p] + parts[p - 1]}
            n_channels = len(rows[parts[p][0]])
            low = [min(rows[i][c] for i in parts[p - 1]) for c in range(n_channels)]
            high = [max(rows[i][c] for i in parts[p - 1]) for c in range(n_channels)]
            spread = {}
            for j in parts[p]:
                normed = [(rows[j][c] - low[c]) / max(high[c] - low[c], 1e-6) for c in range(n_channels)]
                mu = math.fsum(normed) / n_channels
                spread[j] = math.sqrt(math.fsum((x - mu) ** 2 for x in normed) / (n_channels - 1))
            top = max(spread.values())
            denominator = math.fsum(math.exp(v - top) for v in spread.values())
            for j in parts[p]:
                total[j] += math.exp(spread[j] - top) / denominator
        scores.update(total)
    return scores


NEW_RULES = {
    "observed_attention": _observed_attention,
    "snapkv": _snapkv,
    "knorm": _knorm,
    "keydiff": _keydiff,
    "lru": _lru,
    "lagkv": _lagkv,
}
