"""GPU memory plan of a run, from the configs alone (no weights are loaded).

    python experiments/plan.py model=llama3_8b budget=4096 chunk=256 policy=rmm dataset.max_tokens=65536
    python experiments/plan.py model=qwen2_5_7b policy=oracle dataset.max_tokens=32768 --gpu-memory 80 --json

Takes the same overrides as ``run.py`` (composed from ``conf/`` with Hydra) and prints what one run
holds on the GPU: the weights, the engine's KV slots (keys, values, positions, policy statistics), the
attention scratch (masks, and the recorded attention of policies that observe it), the activations of
one chunk's forward pass, and the oracle's reference pass; with ``--gpu-memory`` also the largest
chunk that fits. ``dtype=auto`` plans for a GPU (bfloat16). Formulas: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

import rmm.config  # noqa: F401  (registers the OmegaConf resolvers that conf/ uses)
from rmm.lookahead import configured_reference_context
from rmm.models import architecture, config_from_architecture, resolve_dtype
from rmm.policies import make_policy
from rmm.recording import RecordingPlan, recording_plan

CONF = Path(__file__).resolve().parents[1] / "conf"
REFERENCE_CHUNK = 256  # rmm.lookahead.record_future's default chunk
F32, I64, BOOL = 4, 8, 1


@dataclass
class Plan:
    """Bytes on the GPU in one run; ``total_bytes`` is the weights plus the larger of the stream's
    working set (KV, scratch, activations) and the reference pass's, whose window is
    ``reference_context`` (None without a reference pass)."""

    weights_bytes: int
    kv_bytes: int
    scratch_bytes: int
    activation_bytes: int
    reference_pass_bytes: int
    total_bytes: int
    reference_context: int | None = None


def compose_config(overrides: list[str]) -> DictConfig:
    """``conf/config.yaml`` with ``run.py``-style overrides."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def model_architecture(model_cfg: DictConfig) -> dict[str, Any]:
    """The ``architecture`` node of a model config, or the config.json of ``model.path``."""
    if model_cfg.get("architecture") is not None:
        return OmegaConf.to_container(model_cfg.architecture, resolve=True)
    if model_cfg.get("path"):
        return architecture(AutoConfig.from_pretrained(model_cfg.path, local_files_only=True))
    raise ValueError(
        f"model {model_cfg.name!r} records no architecture: add an `architecture:` node to its "
        "conf/model/*.yaml (see docs/models.md) or pass model.path=<dir with config.json>"
    )


@functools.cache
def _parameter_count(arch_json: str) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_from_architecture(json.loads(arch_json)))
    return sum(p.numel() for p in model.parameters())


def parameter_count(arch: dict[str, Any]) -> int:
    """Parameters of the model, counted on the meta device (nothing allocated, shared weights once)."""
    return _parameter_count(json.dumps(arch, sort_keys=True))


def kv_bytes(arch: dict[str, Any], recording: RecordingPlan, n_tokens: int, dtype: torch.dtype) -> int:
    """Keys and values [L, H, S, D] in ``dtype``, positions [L, H, S] int64, policy state [L, H, S] fp32."""
    retained, chunk = recording.slots(n_tokens)
    slots = arch["num_hidden_layers"] * arch["num_key_value_heads"] * (retained + chunk)
    element = torch.empty(0, dtype=dtype).element_size()
    return slots * (2 * arch["head_dim"] * element + I64 + F32 * len(recording.state_names))


def scratch_bytes(arch: dict[str, Any], recording: RecordingPlan, n_tokens: int, element: int = F32) -> int:
    """Attention masks, the recorded attention [L, H, C, S] and fp32 attention logits.

    Q is the tokens per forward pass (``recording.chunk``). Masks: [Q, S] shared by all layers and
    heads for position rules, [L, H, Q, S] for score-based policies; the blocked mask (its complement)
    exists when attention is recorded or sinks re-rotated, and re-rotated sinks add an additive mask
    [Q, S] of ``element`` bytes (the model's dtype). Recording also keeps the chunk's attention
    [L, H, C, S] fp32 and materialises one layer's logits, masked logits and probabilities
    [n_heads, C, S] fp32 (three at once). With gradient tracking (rmm's ``weight=gradient``) the
    backward pass keeps those three of every layer, plus the utility [L, H, C, S] fp32.
    """
    retained, chunk = recording.slots(n_tokens)
    record, sinks, gradient = recording.record_attention, recording.n_sink_slots > 0, recording.track_gradient
    slots = retained + chunk
    layers_heads = arch["num_hidden_layers"] * arch["num_key_value_heads"]
    mask = chunk * slots * BOOL * (1 if recording.rule is not None else layers_heads)
    total = mask * (2 if record or sinks else 1)
    if sinks:
        total += chunk * slots * element
    if record:
        kept_layers = arch["num_hidden_layers"] if gradient else 1
        total += layers_heads * chunk * slots * F32
        total += kept_layers * 3 * arch["num_attention_heads"] * chunk * slots * F32
    if gradient:
        total += layers_heads * chunk * slots * F32
    return total


def activation_bytes(arch: dict[str, Any], chunk: int, dtype: torch.dtype, kept_layers: int = 1) -> int:
    """An estimate of one chunk's forward pass: hidden states, q/k/v, the MLP, and the logits.

    Per token and kept layer: 4 hidden vectors, q/k/v, 3 MLP intermediates in ``dtype``; once per token
    the logits in ``dtype`` plus their fp32 copy and log-softmax (the engine scores in fp32). Without
    autograd one layer's activations live at a time; rmm's ``weight=gradient`` keeps every layer's
    (``kept_layers`` = L) for its backward pass.
    """
    element = torch.empty(0, dtype=dtype).element_size()
    qkv = (arch["num_attention_heads"] + 2 * arch["num_key_value_heads"]) * arch["head_dim"]
    per_layer = (4 * arch["hidden_size"] + qkv + 3 * arch["intermediate_size"]) * element
    logits = arch["vocab_size"] * (element + 2 * F32)
    return chunk * (kept_layers * per_layer + logits)


def plan(cfg: DictConfig, chunk: int | None = None) -> Plan:
    """The memory plan of the run ``cfg`` describes (``chunk`` overrides ``cfg.chunk``)."""
    n_tokens = cfg.dataset.max_tokens
    if n_tokens is None:
        raise ValueError("the plan needs the stream length: set dataset.max_tokens=<tokens per document>")
    arch = model_architecture(cfg.model)
    dtype = resolve_dtype(cfg.dtype, "cuda")
    policy = make_policy(cfg.policy, budget=cfg.budget, chunk=chunk or cfg.chunk)
    element = torch.empty(0, dtype=dtype).element_size()
    allocation = cfg.get("allocation", "uniform")  # R is the largest per-head capacity
    shape = (arch["num_hidden_layers"], arch["num_key_value_heads"])
    recording = recording_plan(policy, cfg.positions, allocation, shape)
    kv = kv_bytes(arch, recording, n_tokens, dtype)
    scratch = scratch_bytes(arch, recording, n_tokens, element)
    kept_layers = arch["num_hidden_layers"] if recording.track_gradient else 1
    activations = activation_bytes(arch, recording.slots(n_tokens)[1], dtype, kept_layers)
    reference, context = 0, None
    if policy.needs_reference or (cfg.diagnostics.estimator and recording.rule is None):
        context = configured_reference_context(cfg, arch["max_position_embeddings"], n_tokens)
        window = make_policy({"name": "window"}, budget=context, chunk=min(REFERENCE_CHUNK, context))
        observed = recording_plan(window, "original").observed()  # the pass records attention
        reference = (
            kv_bytes(arch, observed, n_tokens, dtype)
            + scratch_bytes(arch, observed, n_tokens)
            + activation_bytes(arch, min(window.chunk, n_tokens), dtype)
        )
    weights = parameter_count(arch) * element
    total = weights + max(kv + scratch + activations, reference)
    return Plan(weights, kv, scratch, activations, reference, total, context)


def largest_chunk(cfg: DictConfig, gpu_bytes: int) -> int | None:
    """The largest valid chunk C whose plan fits ``gpu_bytes`` (None if not even C = 1 fits)."""

    def fits(chunk: int) -> bool:
        try:
            return plan(cfg, chunk=chunk).total_bytes <= gpu_bytes
        except ValueError:  # too large for the policy (chunk > budget, rmm's lag >= budget - chunk + 1)
            return False

    if not fits(1):
        return None
    low, high = 1, cfg.dataset.max_tokens
    while low < high:  # the plan grows with C, and validity is lost for good above some C
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def gib(n: int) -> str:
    return f"{n / 2**30:8.2f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="run.py overrides, e.g. model=llama3_8b budget=4096")
    parser.add_argument(
        "--gpu-memory", type=float, help="GPU memory in GiB: report the largest chunk that fits"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    cfg = compose_config(args.overrides)
    result = asdict(plan(cfg))
    if args.gpu_memory:
        result["gpu_memory_bytes"] = int(args.gpu_memory * 2**30)
        result["largest_chunk"] = largest_chunk(cfg, result["gpu_memory_bytes"])
    if args.json:
        print(json.dumps(result, indent=2))
        return
    dtype = str(resolve_dtype(cfg.dtype, "cuda")).removeprefix("torch.")
    print(
        f"{cfg.model.name} ({dtype}), policy {cfg.policy.name}, B={cfg.budget}, C={cfg.chunk}, "
        f"positions={cfg.positions}, {cfg.dataset.max_tokens}-token streams"
    )
    rows = [
        ("weights", "weights_bytes"),
        ("KV slots", "kv_bytes"),
        ("attention scratch", "scratch_bytes"),
        ("activations (one chunk)", "activation_bytes"),
        ("reference pass", "reference_pass_bytes"),
        ("total", "total_bytes"),
    ]
    for label, key in rows:
        print(f"  {label:24s} {gib(result[key])}")
    if args.gpu_memory:
        fits = result["largest_chunk"]
        print(
            f"  largest chunk within {args.gpu_memory:g} GiB: "
            + (f"C={fits}" if fits else "none (even C=1 does not fit)")
        )


if __name__ == "__main__":
    sys.exit(main())
