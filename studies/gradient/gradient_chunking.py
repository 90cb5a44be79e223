"""How much the chunk-sum definition of rmm's gradient utility changes its ranking, against per-query ones.

    python -m studies.gradient.gradient_chunking [--tokens 256] [--chunk 16] [--lag 32] [--budget 128]

With C > 1 the engine takes one backward pass of the chunk's summed NLL, so u_s(j) also counts the effect
of query s's attention on the later queries of the chunk (through s's hidden states, which they attend).
The per-query definition differentiates each query's own NLL alone (what chunk 1 computes). Both are
computed here with the independent reference (:func:`rmm.reference.gradient_utility`) on the same memory:
SmolLM2-135M (fp32, CPU) over the first ``--tokens`` tokens of the Shakespeare sample, original positions,
nothing evicted (every earlier position is visible), so the two differ only in their loss. Reported:

- per chunk, the Spearman correlation of the chunk's utility sum_s u_s(j) under the two definitions, over
  every (layer, KV head, key j), pooled over chunks;
- at every boundary, DU_j accumulated from the start, ranked per (layer, KV head) over the committed keys
  (j < now - lag): the Spearman correlation, and the share of the top ``budget - chunk + 1 - lag`` committed
  keys (the ones a budget of ``--budget`` would keep) that the two definitions choose differently;
- for the chunk-sum DU, how often position 0 (where attention sinks form) has a negative utility and how
  often it falls outside those top keys.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy.stats import spearmanr

from rmm.data import sample_stream
from rmm.files import config_dir
from rmm.models import load_model
from rmm.reference import ReferenceSpec, gradient_utility, model_shape


def produced_keys_values(model, tokens: torch.Tensor) -> tuple[list, list]:
    """Keys (as the model rotated them, at their own positions) and values: [L][H] {position: [D]}."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        cache = model(tokens[None], use_cache=True).past_key_values
    n_layers, n_kv, _ = model_shape(model)
    keys = [[{} for _ in range(n_kv)] for _ in range(n_layers)]
    values = [[{} for _ in range(n_kv)] for _ in range(n_layers)]
    for layer in range(n_layers):
        for h in range(n_kv):
            for j in range(tokens.numel()):
                keys[layer][h][j] = cache.layers[layer].keys[0, h, j].clone()
                values[layer][h][j] = cache.layers[layer].values[0, h, j].clone()
    return keys, values


def chunk_utility(model, tokens, start, stop, keys, values, per_query: bool) -> np.ndarray:
    """sum_s u_s(j) over the chunk's queries: float64 [L, H, stop] (0 where s never saw j)."""
    n_layers, n_kv, _ = model_shape(model)
    spec = ReferenceSpec(policy="rmm", weight="gradient")
    made_at = {j: j for j in range(tokens.numel())}
    parts = [(s, s + 1) for s in range(start, stop)] if per_query else [(start, stop)]
    total = np.zeros((n_layers, n_kv, stop))
    for first, last in parts:
        retained = [[list(range(first)) for _ in range(n_kv)] for _ in range(n_layers)]
        rows = gradient_utility(model, tokens, first, last, retained, keys, values, made_at, spec)
        for layer in range(n_layers):
            for h in range(n_kv):
                for row in rows[layer][h].values():
                    for j, u in row.items():
                        total[layer, h, j] += u
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--lag", type=int, default=32)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(
        OmegaConf.load(config_dir() / "model/smollm2_135m.yaml"), torch.device("cpu"), torch.float32
    )
    tokens = sample_stream(tokenizer, args.tokens)
    n, chunk = tokens.numel(), args.chunk
    keys, values = produced_keys_values(model, tokens)
    room = args.budget - chunk + 1 - args.lag
    start_time = time.perf_counter()
    du = {False: None, True: None}
    chunk_pairs, boundary_rho, differ = [], [], []
    sink_negative, sink_dropped = [], []  # position 0 under the chunk-sum DU, per boundary x head
    for start in range(0, n - 1, chunk):
        stop = min(start + chunk, n - 1)  # queries with a target
        parts = {q: chunk_utility(model, tokens, start, stop, keys, values, q) for q in (False, True)}
        chunk_pairs.append((parts[False].ravel(), parts[True].ravel()))
        for q in (False, True):
            grown = np.zeros(parts[q].shape)
            if du[q] is not None:
                grown[..., : du[q].shape[-1]] = du[q]
            du[q] = grown + parts[q]
        committed = stop - args.lag
        if committed <= room:  # nothing to choose yet: every committed key fits
            continue
        for layer in range(du[False].shape[0]):
            for h in range(du[False].shape[1]):
                a, b = du[False][layer, h, :committed], du[True][layer, h, :committed]
                boundary_rho.append(spearmanr(a, b).statistic)
                kept_a, kept_b = set(np.argsort(-a)[:room]), set(np.argsort(-b)[:room])
                differ.append(len(kept_a - kept_b) / room)
                sink_negative.append(a[0] < 0)
                sink_dropped.append(0 not in kept_a)
    chunk_rho = spearmanr(
        np.concatenate([p[0] for p in chunk_pairs]), np.concatenate([p[1] for p in chunk_pairs])
    )
    print(
        f"SmolLM2-135M fp32, {n} Shakespeare tokens, C={chunk}, H={args.lag}, B={args.budget} "
        f"({time.perf_counter() - start_time:.0f} s)"
    )
    print(
        f"per-chunk utility, chunk-sum vs per-query: Spearman {chunk_rho.statistic:.4f} over "
        f"{len(chunk_pairs)} chunks"
    )
    if boundary_rho:
        print(
            f"accumulated DU over committed keys, per (layer, KV head): Spearman median "
            f"{np.median(boundary_rho):.4f} (min {np.min(boundary_rho):.4f}); kept set (top {room}) "
            f"differs in {100 * np.mean(differ):.2f} % of its keys on average "
            f"(max {100 * np.max(differ):.1f} %), over "
            f"{len(differ)} boundary x head decisions"
        )
        print(
            f"position 0 (the attention sink) under the chunk-sum DU: negative in "
            f"{100 * np.mean(sink_negative):.1f} %, outside the top {room} in "
            f"{100 * np.mean(sink_dropped):.1f} % of those decisions"
        )


if __name__ == "__main__":
    main()
