"""The reference matrix's ingredients, one copy for the test suite and the GPU check.

Tiny random causal LMs of five architectures (one hybrid: a sliding and a global layer; built locally,
no downloads), streams they partly
predict, and the policy cases every policy is checked in against :mod:`rmm.reference` (the engine's
retained sets in the reference's form: :func:`rmm.engine.retained_sets_recorder`). Test support, not
library: the tests, ``checks/gpu_check.py`` and ``checks/kvpress_parity.py`` import them from here.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=61,
    max_position_embeddings=512,
    initializer_range=0.1,
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# built by tiny_model but not in the matrix: Qwen3 (per-head RMS-normalised queries and keys, q_norm and
# k_norm), for checks/kvpress_parity.py
MORE_ARCHITECTURES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM)}
SLIDING_WINDOW = 6  # the hybrid model's window: the matrix's 24-token streams outgrow it
# per-architecture differences: Mistral's own sliding window off; GPT-NeoX is multi-head with partial rotary;
# Gemma 3 is hybrid: a sliding layer (window 6, its own rotary frequencies) then a global one
SPECIFIC = {
    "mistral": {"sliding_window": None},
    "gpt_neox": {"rotary_pct": 0.5},
    "qwen3": {"head_dim": 16},
    "gemma3": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
FOLLOW_ARGMAX = 0.5  # a sampled stream takes the model's own argmax with this probability

# (policy, parameters): every policy at least once, with the parameters that change its decisions
CASES: list[tuple[str, dict]] = [
    ("full", {}),
    ("window", {}),
    ("streaming_llm", {"sinks": 2}),
    ("h2o", {}),
    ("h2o", {"rho": 0.0}),
    ("rmm", {"lag": 3}),
    ("rmm", {"lag": 3, "weight": "prob"}),
    ("rmm", {"lag": 3, "weight": "uniform"}),
    ("rmm", {"lag": 3, "after_commit": "freeze"}),
    ("rmm", {"lag": 4, "weight": "prob", "after_commit": "freeze"}),
    ("rmm", {"lag": 0, "weight": "uniform", "after_commit": "freeze"}),
    ("rmm", {"lag": 3, "weight": "gradient"}),
    ("rmm", {"lag": 3, "weight": "gradient", "after_commit": "freeze"}),
    ("rmm", {"lag": "auto", "step": 1}),
    ("rmm", {"lag": "auto", "step": 1, "weight": "uniform"}),
    ("tova", {}),
    ("tova", {"variant": "kvpress"}),
    ("random", {}),
    ("random", {"seed": 3}),
    ("oracle", {}),
    ("oracle", {"variant": "future_mass"}),
    ("oracle", {"variant": "future_utility"}),
    ("oracle", {"variant": "future_utility", "weight": "prob"}),
    ("observed_attention", {}),
    ("observed_attention", {"rho": 0.25}),
    ("observed_attention", {"rho": 0.0, "variant": "kvpress"}),
    ("snapkv", {"window": 2, "kernel": 3, "pooling": "avg"}),
    ("snapkv", {"window": 3, "kernel": 5, "pooling": "max"}),
    ("snapkv", {"window": 2, "kernel": 3, "pooling": "avg", "variant": "kvpress"}),
    ("knorm", {}),
    ("knorm", {"variant": "kvpress"}),
    ("keydiff", {}),
    ("keydiff", {"variant": "kvpress"}),
    ("lru", {}),
    ("lru", {"tau": 0.2}),
    ("lagkv", {"partition": 3, "sinks": 1}),
    ("lagkv", {"partition": 2, "sinks": 1, "variant": "kvpress"}),
    ("lagkv", {"partition": 3, "sinks": 0}),
    ("restkv", {}),
    ("restkv", {"beta": 0.0, "kernel": 1}),
    ("expected_attention", {"n_future_positions": 16, "sinks": 1}),
    ("expected_attention", {"sinks": 2, "epsilon": 0.01}),
    (
        "expected_attention",
        {"n_future_positions": 1, "sinks": 0, "use_covariance": False, "use_vnorm": False},
    ),
]


def case_id(name: str, params: dict) -> str:
    """A case's name: the policy and its parameter values, e.g. ``rmm-3-prob``."""
    return f"{name}-{'-'.join(map(str, params.values()))}"


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
    """A small random causal LM (CPU, fp32) whose attention is peaked enough for eviction to matter."""
    config_cls, model_cls = {**ARCHITECTURES, **MORE_ARCHITECTURES}[arch]
    torch.manual_seed(seed)
    settings = {**TINY, **SPECIFIC.get(arch, {}), **overrides}
    if arch == "gpt_neox":
        del settings["num_key_value_heads"]
    return model_cls(config_cls(**settings)).eval().requires_grad_(False)


@torch.no_grad()
def sampled_stream(model: PreTrainedModel, n: int, seed: int = 1) -> torch.Tensor:
    """A stream [n] the model partly predicts: each next token is the model's argmax (full attention)
    with probability FOLLOW_ARGMAX, else uniformly random (so correctness weights see both outcomes)."""
    model.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    tokens = [int(torch.randint(vocab, (1,), generator=generator))]
    for _ in range(n - 1):
        if float(torch.rand(1, generator=generator)) < FOLLOW_ARGMAX:
            tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
        else:
            tokens.append(int(torch.randint(vocab, (1,), generator=generator)))
    return torch.tensor(tokens)


def ranks_keys(name: str) -> bool:
    """Whether the policy ``name`` ranks keys themselves (it reads ``keys``): the matrix streams it
    :func:`distinct_stream`."""
    from rmm.policies import POLICIES, ScorePolicy

    cls = POLICIES[name]
    return issubclass(cls, ScorePolicy) and "keys" in cls.needs


def runs_under(name: str, params: dict, positions: str) -> bool:
    """Whether the case runs under ``positions`` (a policy that scores keys as cached, kvpress's keydiff
    and lagkv, needs ``positions=original``)."""
    from rmm.planning import recording_plan
    from rmm.policies import make_policy

    try:
        recording_plan(make_policy({"name": name, **params}, budget=1024, chunk=1), positions)
    except ValueError:
        return False
    return True


def ranked_by_rounding(arch: str, name: str, params: dict) -> bool:
    """Whether the case's scores are all equal in exact arithmetic on the tiny ``arch``, so that rounding
    alone would rank them: Gemma 3 RMS-normalises its keys (``k_norm``, whose weight the tiny model leaves
    at 0), so every key norm is sqrt(head_dim), and knorm's ``variant=kvpress`` ranks the norms unrounded
    (the harness's knorm compares them at 4 significant digits: all tie, recency decides). The matrix
    leaves such a case out on that architecture."""
    return arch == "gemma3" and name == "knorm" and params.get("variant") == "kvpress"


def distinct_stream(n: int, seed: int = 1) -> torch.Tensor:
    """A stream [n] without a repeated token, so that no two keys of a layer are equal by construction.

    A repeated token has bitwise-equal layer-0 keys; the policies that rank keys themselves (knorm,
    keydiff, lagkv) then tie at the stated precision and recency decides (docs/semantics.md). The
    matrix streams them distinct tokens so that their scores, not the tie rule, are compared.
    """
    return torch.randperm(TINY["vocab_size"], generator=torch.Generator().manual_seed(seed))[:n]
