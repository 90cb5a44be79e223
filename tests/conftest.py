"""Shared fixtures: tiny random models built locally (no downloads) and streams they actually predict."""

from __future__ import annotations

import subprocess

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import rmm.config  # noqa: F401  (registers the OmegaConf resolvers that conf/ uses)

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
SENTENCES = [
    "shall i compare thee to a summer's day",
    "thou art more lovely and more temperate",
    "rough winds do shake the darling buds of may",
    "and summer's lease hath all too short a date",
]
STREAM_LENGTH = 24
FOLLOW_ARGMAX = 0.5  # a sampled stream takes the model's own argmax with this probability


# Largest differences seen by the exactness tests in this session, printed at the end of the run
# (the README's measured tolerances come from here): name -> (largest value, number of comparisons).
MEASURED: dict[str, tuple[float, int]] = {}


def record_max(name: str, value: float) -> None:
    largest, count = MEASURED.get(name, (0.0, 0))
    MEASURED[name] = (max(largest, value), count + 1)


def pytest_terminal_summary(terminalreporter) -> None:
    for name, (largest, count) in sorted(MEASURED.items()):
        terminalreporter.write_line(f"measured: {name}: largest {largest:.2e} over {count} streams")


# A test marked ``background(args, **popen_kwargs)`` receives its finished subprocess from the ``background``
# fixture. The selected tests' commands start when collection ends, so a fresh interpreter (importing torch
# and transformers takes about 5 s) runs on the machine's second core while the suite goes on.
_STARTED: dict[str, subprocess.Popen] = {}


def _start(marker: pytest.Mark) -> subprocess.Popen:
    return subprocess.Popen(
        *marker.args, **marker.kwargs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "background(args, **kwargs): a subprocess started at collection")


def pytest_collection_finish(session) -> None:
    if session.config.option.collectonly:
        return
    for item in session.items:
        if (marker := item.get_closest_marker("background")) is not None:
            _STARTED[item.nodeid] = _start(marker)


def pytest_sessionfinish(session) -> None:
    while _STARTED:  # the commands of tests that did not run (-x, an interrupt)
        process = _STARTED.popitem()[1]
        process.kill()
        process.communicate()


@pytest.fixture
def background(request) -> subprocess.CompletedProcess:
    """The test's ``background`` command, finished (started now if it was not at collection)."""
    process = _STARTED.pop(request.node.nodeid, None) or _start(request.node.get_closest_marker("background"))
    stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
    """A small random causal LM whose attention is peaked enough for eviction to matter."""
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    settings = {**TINY, **SPECIFIC.get(arch, {}), **overrides}
    if arch == "gpt_neox":
        del settings["num_key_value_heads"]
    return model_cls(config_cls(**settings)).eval().requires_grad_(False)


@torch.no_grad()
def sampled_stream(model: PreTrainedModel, n: int = STREAM_LENGTH, seed: int = 1) -> torch.Tensor:
    """A stream [n] the model partly predicts: each next token is the model's argmax (full attention)
    with probability FOLLOW_ARGMAX, else uniformly random."""
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


def distinct_stream(n: int = STREAM_LENGTH, seed: int = 1) -> torch.Tensor:
    """A stream [n] without a repeated token, so that no two keys of a layer are equal by construction.

    A repeated token has bitwise-equal layer-0 keys; the policies that rank keys themselves (knorm,
    keydiff, lagkv) then tie, and float rounding, not recency, decides (docs/semantics.md).
    """
    return torch.randperm(TINY["vocab_size"], generator=torch.Generator().manual_seed(seed))[:n]


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, PreTrainedModel]:
    return {arch: tiny_model(arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def streams(tiny_models) -> dict[str, torch.Tensor]:
    """Per architecture, a stream sampled from that tiny model (see :func:`sampled_stream`)."""
    return {arch: sampled_stream(model) for arch, model in tiny_models.items()}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few lines (byte-level, so Qwen2's forced tokenizer class agrees)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
