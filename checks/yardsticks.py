"""The yardsticks the engine's speed is measured against, one copy for the CPU bench and the GPU check.

- :func:`plain_forward`: forward passes over consecutive windows, no memory bound (the ceiling);
- :func:`equal_work`: the model's own forward at the engine's work per pass: N streams side by side, C
  new tokens each per pass, a KV cache cut to the last B - C + 1 keys after every pass;
- :func:`token_loop`: StreamingLLM's evaluation method, one token per forward with the KV cache cut to
  sinks + the last B - sinks entries after every step (physical eviction).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from rmm.integration import cache_keyword


@torch.no_grad()
def plain_forward(model: PreTrainedModel, tokens: torch.Tensor, window: int) -> None:
    """Plain forward passes (SDPA) over consecutive ``window``-token windows of ``tokens`` [n]."""
    model.set_attn_implementation("sdpa")
    for start in range(0, tokens.numel(), window):
        model(tokens[None, start : start + window], use_cache=False)


@torch.no_grad()
def token_loop(model: PreTrainedModel, tokens: torch.Tensor, budget: int, sinks: int = 4) -> torch.Tensor:
    """Per-token NLL [n - 1] of ``tokens`` [n] decoded one at a time, the cache cut to ``sinks`` + the
    last ``budget - sinks`` entries after every step (original positions)."""
    model.set_attn_implementation("sdpa")
    keyword = cache_keyword(model)
    cache = DynamicCache()
    nll = torch.empty(tokens.numel() - 1, device=tokens.device)
    positions = torch.arange(tokens.numel(), device=tokens.device)
    for t in range(tokens.numel() - 1):
        out = model(
            tokens[None, t : t + 1],
            position_ids=positions[None, t : t + 1],
            use_cache=True,
            **{keyword: cache},
        )
        nll[t] = -torch.log_softmax(out.logits[0, -1].float(), -1)[tokens[t + 1]]
        for layer in out.past_key_values.layers:
            if layer.keys.shape[-2] > budget:
                layer.keys, layer.values = (
                    torch.cat([x[..., :sinks, :], x[..., -(budget - sinks) :, :]], -2)
                    for x in (layer.keys, layer.values)
                )
        cache = out.past_key_values
    return nll


@torch.no_grad()
def equal_work(model: PreTrainedModel, tokens: torch.Tensor, budget: int, chunk: int) -> int:
    """The model's own forward (SDPA, batch N) over ``tokens`` [N, n], N streams side by side: each pass
    feeds ``chunk`` new tokens per stream with a ``DynamicCache`` of the streams' previous keys and values,
    cut after every pass to the last B' = ``budget`` - ``chunk`` + 1, what the engine keeps at a boundary,
    so that every query attends at most ``budget`` keys besides its own (original positions; logits of
    every token, no log-softmax). Runs on ``tokens``' device; for models whose every layer is a full-
    attention layer. Returns the most keys any query attended besides its own (``budget`` on streams long
    enough to fill the cache)."""
    if not 1 <= chunk <= budget:
        raise ValueError(f"equal_work needs 1 <= chunk <= budget, got chunk={chunk}, budget={budget}")
    model.set_attn_implementation("sdpa")
    keyword = cache_keyword(model)
    keep = budget - chunk + 1
    cache = DynamicCache()
    n = tokens.shape[1]
    positions = torch.arange(n, device=tokens.device).expand_as(tokens)
    most = 0
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        most = max(most, cache.get_seq_length() + stop - start - 1)
        model(
            tokens[:, start:stop], position_ids=positions[:, start:stop], use_cache=True, **{keyword: cache}
        )
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[..., -keep:, :], layer.values[..., -keep:, :]
    return most
