"""Shared fixtures: tiny random models built locally (no downloads) and streams they actually predict."""

from __future__ import annotations

import subprocess

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

import rmm.config  # noqa: F401  (registers the OmegaConf resolvers that conf/ uses)
from checks.matrix import ARCHITECTURES, sampled_stream, tiny_model
from rmm.divergence import Divergence, Trace, diverge
from rmm.models import warm_vector_math

warm_vector_math()  # as rmm.models.load_model does: the suite's first VML call is no parallel one

SENTENCES = [
    "shall i compare thee to a summer's day",
    "thou art more lovely and more temperate",
    "rough winds do shake the darling buds of may",
    "and summer's lease hath all too short a date",
]
STREAM_LENGTH = 24
# torch's CPU flash attention packs bf16 blocks with VNNI where the hardware has AMX, but the kernel compiled
# for a forced lower ATen capability (make test's ATEN_CPU_CAPABILITY=default step) cannot pack them and
# raises "pack_vnni2 is only supported when avx512 is supported": a limit of emulating another CPU, not of
# the harness (real hardware with AMX has AVX512). bf16 cases are skipped there.
BF16_UNDER_EMULATED_KERNELS = pytest.mark.skipif(
    torch.cpu._is_amx_tile_supported()
    and torch.backends.cpu.get_cpu_capability() not in ("AVX512", "ZVECTOR"),
    reason="bf16 SDPA under a forced lower ATen CPU capability on AMX hardware raises inside torch",
)


# Largest differences seen by the exactness tests in this session, printed at the end of the run
# (the README's measured tolerances come from here): name -> (largest value, number of comparisons).
MEASURED: dict[str, tuple[float, int]] = {}


def record_max(name: str, value: float) -> None:
    largest, count = MEASURED.get(name, (0.0, 0))
    MEASURED[name] = (max(largest, value), count + 1)


def assert_agree(a: Trace, b: Trace, where: str = "") -> Divergence:
    """Two computations of one stream whose kernels may block differently (another batch, thread count,
    CPU capability): equal to :data:`rmm.divergence.NLL_BOUND` per token until a near-tie flips, and
    the first difference explained by one (:func:`rmm.divergence.diverge`). Returns the divergence."""
    found = diverge(a, b)
    record_max("per-token |dNLL| before any near-tie flips, fp32", found.max_before)
    if found.first is not None:
        MEASURED_FLIPS.append(f"{where}: {found.describe()}")
    assert found.ok, f"{where}: {found.describe()}"
    return found


MEASURED_FLIPS: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    for flip in MEASURED_FLIPS:
        terminalreporter.write_line(f"near-tie flip: {flip}")
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


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, PreTrainedModel]:
    return {arch: tiny_model(arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def streams(tiny_models) -> dict[str, torch.Tensor]:
    """Per architecture, a stream sampled from that tiny model (see :func:`sampled_stream`)."""
    return {arch: sampled_stream(model, STREAM_LENGTH) for arch, model in tiny_models.items()}


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
