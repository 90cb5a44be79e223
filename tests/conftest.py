"""Shared fixtures: tiny random models built locally (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
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
}
# per-architecture differences: Mistral's own sliding window off; GPT-NeoX is multi-head with partial rotary
SPECIFIC = {"mistral": {"sliding_window": None}, "gpt_neox": {"rotary_pct": 0.5}}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
    """A small random causal LM whose attention is peaked enough for eviction to matter."""
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    settings = {**TINY, **SPECIFIC.get(arch, {}), **overrides}
    if arch == "gpt_neox":
        del settings["num_key_value_heads"]
    return model_cls(config_cls(**settings)).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, PreTrainedModel]:
    return {arch: tiny_model(arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (48,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def distinct_tokens() -> torch.Tensor:
    """48 tokens, none repeated, so no two keys of a layer are equal by construction."""
    return torch.randperm(TINY["vocab_size"], generator=torch.Generator().manual_seed(1))[:48]
