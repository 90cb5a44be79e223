"""GPU memory plan and expected wall time of a run, from the configs alone (no weights are loaded).

    python checks/plan.py model=llama3_8b budget=4096 chunk=256 policy=rmm dataset.max_tokens=65536
    python checks/plan.py model=qwen2_5_7b policy=oracle dataset.max_tokens=32768 --gpu-memory 80 --json
    python checks/plan.py experiment=main_table scale=pg19 --time --gpu h200     # the whole sweep
    python checks/plan.py --calibrate results/bench/speed_points.json --out docs/time_calibration.md

Takes the same overrides as ``run.py`` (composed from ``conf/`` with Hydra) and prints what one run
holds on the GPU: the weights, the engine's KV slots (keys, values, positions, policy statistics), the
attention scratch (masks, and the recorded attention of policies that observe it), the activations of
one forward pass of ``batch`` documents' chunks, and the oracle's reference pass (one document at a
time); with ``--gpu-memory`` also the largest chunk (at the configured batch) and the largest batch (at
the configured chunk) that fit. ``dtype=auto`` plans for a GPU (bfloat16).

``--time`` prints the expected wall time instead (:mod:`checks.time_model`): of the composed run,
or of every run of a sweep, given as ``run.py -m`` gives it (comma lists on the command line, and the
``hydra.sweeper.params`` of an ``experiment=`` preset), what its runs share counted once (``full`` and the
reference passes, :mod:`rmm.sharing`), with the range at half and twice the cost per launch.
``--calibrate POINTS.json`` fits the time model's constants to measured runs and prints predicted
against measured. Formulas: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

import rmm.config  # noqa: F401  (registers the OmegaConf resolvers that conf/ uses)
from checks import time_model
from checks.time_model import GPUS, Hardware, ModelShape, StreamShape, schedule_first, stream_shape
from rmm import sharing
from rmm.lookahead import configured_reference_context
from rmm.models import architecture, config_from_architecture, resolve_dtype
from rmm.planning import recording_plan
from rmm.policies import make_policy
from rmm.recording import RecordingPlan

CONF = Path(__file__).resolve().parents[1] / "conf"
REFERENCE_CHUNK = 256  # rmm.lookahead.record_future's default chunk
F32, I64, BOOL = 4, 8, 1


@dataclass
class Plan:
    """Bytes on the GPU in one run of ``batch`` documents per forward pass.

    ``kv_bytes``, ``scratch_bytes`` and ``activation_bytes`` are of all ``batch`` streams together (each
    stream has its own memory); ``reference_pass_bytes`` is one document's reference pass (it runs
    unbatched), whose window is ``reference_context`` (None without a reference pass). ``total_bytes``
    is the weights plus the larger of the streams' working set (KV, scratch, activations) and the
    reference pass beside the memories of at most ``batch - 1`` streams (a document's reference pass
    runs while it is drawn into the batch, after the memories of the documents drawn before it exist)."""

    weights_bytes: int
    kv_bytes: int
    scratch_bytes: int
    activation_bytes: int
    reference_pass_bytes: int
    total_bytes: int
    reference_context: int | None = None
    batch: int = 1


def compose_config(overrides: list[str], hydra: bool = False) -> DictConfig:
    """``conf/config.yaml`` with ``run.py``-style overrides (``hydra``: with the ``hydra`` node)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra)


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
    """One stream's keys and values [L, H, S, D] in ``dtype``, positions [L, H, S] int64, policy state
    [L, H, S] fp32."""
    retained, chunk = recording.slots(n_tokens)
    slots = arch["num_hidden_layers"] * arch["num_key_value_heads"] * (retained + chunk)
    element = torch.empty(0, dtype=dtype).element_size()
    return slots * (2 * arch["head_dim"] * element + I64 + F32 * len(recording.state_names))


def scratch_parts(
    arch: dict[str, Any], recording: RecordingPlan, n_tokens: int, element: int = F32
) -> tuple[int, int]:
    """The two parts of :func:`scratch_bytes`: (one stream's masks, recorded attention and utility, which
    live through the pass; what one stream adds to one layer's attention while it runs)."""
    retained, chunk = recording.slots(n_tokens)
    record, sinks, gradient = recording.record_attention, recording.n_sink_slots > 0, recording.track_gradient
    slots = retained + chunk
    layers_heads = arch["num_hidden_layers"] * arch["num_key_value_heads"]
    if recording.rule is None and record and not sinks:  # the eager path's bias: [L, H, S] and [Q, S] fp32
        per_stream = (layers_heads + chunk) * slots * F32
    else:  # the allowed mask, and its complement too where sinks need it
        per_stream = chunk * slots * BOOL * (1 if recording.rule is not None else layers_heads) * (1 + sinks)
    if sinks:
        per_stream += chunk * slots * element
    if record:
        per_stream += layers_heads * chunk * slots * F32
    if gradient:
        per_stream += layers_heads * chunk * slots * F32
    # the fp32 logits, masked logits and probabilities [n_heads, C, S], and the eager path's additive mask
    # [H, C, S] (not kept for a backward pass, but counted with what is: an upper bound under gradients)
    per_layer = (
        (3 * arch["num_attention_heads"] + arch["num_key_value_heads"]) * chunk * slots * F32 if record else 0
    )
    if gradient:  # the attended keys and values [H, S, D], concatenated with the chunk's own in the graph
        per_layer += 2 * arch["num_key_value_heads"] * slots * arch["head_dim"] * element
    if not record and arch["num_attention_heads"] > arch["num_key_value_heads"]:  # the fused call's mask,
        folded = arch["num_attention_heads"] * chunk * slots  # with the query group folded into its rows
        if recording.rule is not None:  # one for every layer (the sinks' additive one), kept through the pass
            per_stream += folded * (element if sinks else BOOL) // arch["num_key_value_heads"]
        else:  # a layer's own, while the layer runs
            per_layer += folded * BOOL
    return per_stream, per_layer


def scratch_bytes(
    arch: dict[str, Any], recording: RecordingPlan, n_tokens: int, element: int = F32, batch: int = 1
) -> int:
    """Attention masks, the recorded attention [L, H, C, S] and fp32 attention logits of ``batch`` streams.

    Q is the tokens per forward pass (``recording.chunk``). Per stream: masks [Q, S] shared by all layers
    and heads for position rules, [L, H, Q, S] for score-based policies, and its complement too where
    sinks are re-rotated, which add an additive mask [Q, S] of ``element`` bytes (the model's dtype); a
    score-based policy that records attention (without sinks) keeps the eager path's additive mask in two
    fp32 parts instead, [L, H, S] and [Q, S] (the latter once per pass unless a row is padded: counted per
    stream). Recording also keeps the chunk's attention [L, H, C, S] fp32. The attention runs one layer at
    a time for every stream at once, so the fp32 logits, masked logits and probabilities [N, n_heads, C, S]
    (three at once) and the layer's additive mask [N, H, C, S] of one layer exist at a time; the fused path
    (nothing recorded, G > 1 query heads per KV head) folds the group into the
    mask's rows, [Q, G * S] per KV head: once per pass for position rules (and their sinks' additive mask),
    per layer otherwise. With gradient tracking (rmm's ``weight=gradient``) the backward pass keeps those
    three of every layer, with the keys and values [N, H, S, D] each layer attended (in ``element``
    bytes), plus each stream's utility [L, H, C, S] fp32.
    """
    per_stream, per_layer = scratch_parts(arch, recording, n_tokens, element)
    kept = arch["num_hidden_layers"] if recording.track_gradient else 1
    return batch * (per_stream + kept * per_layer)


def activation_bytes(
    arch: dict[str, Any],
    chunk: int,
    dtype: torch.dtype,
    *,
    gradient: bool = False,
    sinks: bool = False,
    batch: int = 1,
) -> int:
    """An estimate of one forward pass of ``batch`` streams' chunks of ``chunk`` tokens: hidden states,
    q/k/v, the MLP, and the logits.

    Per token and kept layer: 4 hidden vectors, q/k/v, 3 MLP intermediates in ``dtype``, and with
    re-rotated sinks (``sinks``) the fp32 merge of the sink slots' and the fused call's outputs (4 of
    [n_heads, D]). The logits [N, C, V] in ``dtype``, their fp32 copy (none when ``dtype`` is fp32) and
    their log-softmax [N, C, V] fp32 (every stream scored at once). Without autograd one layer's
    activations live at a time; rmm's ``weight=gradient`` keeps every layer's for its backward pass.
    """
    element = torch.empty(0, dtype=dtype).element_size()
    kept_layers = arch["num_hidden_layers"] if gradient else 1
    qkv = (arch["num_attention_heads"] + 2 * arch["num_key_value_heads"]) * arch["head_dim"]
    per_layer = (4 * arch["hidden_size"] + qkv + 3 * arch["intermediate_size"]) * element
    if sinks:
        per_layer += 4 * arch["num_attention_heads"] * arch["head_dim"] * F32
    logits = batch * chunk * arch["vocab_size"] * (element + (F32 if dtype != torch.float32 else 0))
    log_softmax = batch * chunk * arch["vocab_size"] * F32
    return batch * chunk * kept_layers * per_layer + logits + log_softmax


@dataclass(frozen=True)
class RunSpec:
    """What the planner reads of a run: the model, the policy's recording plan, its reference pass."""

    arch: dict[str, Any]
    dtype: torch.dtype
    n_tokens: int
    batch: int
    budget: int | None
    recording: RecordingPlan
    reference: RecordingPlan | None
    reference_context: int | None


def run_spec(cfg: DictConfig, chunk: int | None = None, batch: int | None = None) -> RunSpec:
    """The run ``cfg`` describes (``chunk`` and ``batch`` override ``cfg.chunk`` and ``cfg.batch``)."""
    n_tokens = cfg.dataset.max_tokens
    if n_tokens is None:
        raise ValueError("the plan needs the stream length: set dataset.max_tokens=<tokens per document>")
    batch = batch or cfg.get("batch", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    arch = model_architecture(cfg.model)
    dtype = resolve_dtype(cfg.dtype, "cuda")
    policy = make_policy(cfg.policy, budget=cfg.budget, chunk=chunk or cfg.chunk)
    allocation = cfg.get("allocation", "uniform")  # R is the largest per-head capacity
    shape = (arch["num_hidden_layers"], arch["num_key_value_heads"])
    recording = recording_plan(policy, cfg.positions, allocation, shape)
    reference, context = None, None
    if policy.needs_reference or (cfg.diagnostics.estimator and recording.rule is None):
        context = configured_reference_context(cfg, arch["max_position_embeddings"], n_tokens)
        window = make_policy({"name": "window"}, budget=context, chunk=min(REFERENCE_CHUNK, context))
        reference = recording_plan(window, "original").observed()  # the pass records attention
    return RunSpec(arch, dtype, n_tokens, batch, policy.budget, recording, reference, context)


def plan(cfg: DictConfig, chunk: int | None = None, batch: int | None = None) -> Plan:
    """The memory plan of the run ``cfg`` describes (``chunk`` and ``batch`` override ``cfg.chunk`` and
    ``cfg.batch``)."""
    spec = run_spec(cfg, chunk, batch)
    arch, dtype, n_tokens, batch, recording = spec.arch, spec.dtype, spec.n_tokens, spec.batch, spec.recording
    element = torch.empty(0, dtype=dtype).element_size()
    kv = kv_bytes(arch, recording, n_tokens, dtype)
    scratch = scratch_bytes(arch, recording, n_tokens, element, batch)
    activations = activation_bytes(
        arch,
        recording.slots(n_tokens)[1],
        dtype,
        gradient=recording.track_gradient,
        sinks=recording.n_sink_slots > 0,
        batch=batch,
    )
    reference, others = 0, 0
    if spec.reference is not None:
        # a run's reference passes (the oracle's, diagnostics.estimator's) run `batch` documents side by side
        # (rmm.lookahead.ReferenceRunner.prefetch) when a wave is drawn, while up to batch - 1 streams of
        # unequal length that have not finished still hold their memories
        observed = spec.reference
        reference = (
            batch * kv_bytes(arch, observed, n_tokens, dtype)
            + scratch_bytes(arch, observed, n_tokens, batch=batch)
            + activation_bytes(arch, observed.slots(n_tokens)[1], dtype, batch=batch)
        )
        others = (batch - 1) * (kv + scratch_parts(arch, recording, n_tokens, element)[0])
    weights = parameter_count(arch) * element
    streams = batch * kv + scratch + activations
    total = weights + max(streams, reference + others if reference else 0)
    return Plan(weights, batch * kv, scratch, activations, reference, total, spec.reference_context, batch)


def largest_chunk(cfg: DictConfig, gpu_bytes: int) -> int | None:
    """The largest valid chunk C whose plan fits ``gpu_bytes`` at the configured batch (None if not even
    C = 1 fits)."""

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


MAX_BATCH = 1 << 16


def largest_batch(cfg: DictConfig, gpu_bytes: int) -> int | None:
    """The largest batch N (documents per forward pass, at most :data:`MAX_BATCH`) whose plan fits
    ``gpu_bytes`` at the configured chunk (None if not even N = 1 fits)."""

    def fits(batch: int) -> bool:
        return plan(cfg, batch=batch).total_bytes <= gpu_bytes

    if not fits(1):
        return None
    low, high = 1, 2
    while high <= MAX_BATCH and fits(high):  # the plan grows with N: double, then bisect
        low, high = high, 2 * high
    high = min(high - 1, MAX_BATCH)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


# ---- time --------------------------------------------------------------------------------------------
def n_documents(cfg: DictConfig) -> int:
    """Documents of the run: ``dataset.n_docs`` (one with ``stream=concat``)."""
    if cfg.dataset.get("stream") == "concat":
        return 1
    n_docs = cfg.dataset.get("n_docs")
    if n_docs is None:
        raise ValueError("the time model needs the number of documents: set dataset.n_docs=<documents>")
    return int(n_docs)


def time_works(
    cfg: DictConfig, n_docs: int | None = None, pass_tokens: int | None = None
) -> tuple[ModelShape, list[time_model.Work], list[time_model.Work], RunSpec]:
    """The work of the run ``cfg``: (model, stream works, reference works, spec); every document is
    assumed ``dataset.max_tokens`` long. ``pass_tokens`` replaces the tokens per forward pass (a bench
    run that streams a position rule in C-token passes)."""
    spec = run_spec(cfg)
    model = ModelShape.from_architecture(spec.arch)
    stream = stream_shape(spec.recording, spec.n_tokens, spec.budget)
    if pass_tokens is not None and pass_tokens != stream.step:
        first = schedule_first(spec.budget, pass_tokens)
        stream = replace(stream, first=first, step=pass_tokens)
    reference = None
    if spec.reference is not None:
        reference = stream_shape(spec.reference, spec.n_tokens, spec.reference_context)
    element = torch.empty(0, dtype=spec.dtype).element_size()
    n_docs = n_documents(cfg) if n_docs is None else n_docs
    works, reference_works = time_model.run_works(
        model, stream, n_docs, spec.batch, element, reference, spec.batch
    )
    return model, works, reference_works, spec


def run_time(cfg: DictConfig, hardware: Hardware) -> time_model.RunTime:
    """The expected wall time of the run ``cfg`` on ``hardware`` (a note when its plan exceeds the
    device's memory)."""
    return run_times(cfg, [hardware])[0]


def run_times(cfg: DictConfig, hardwares: list[Hardware]) -> list[time_model.RunTime]:
    """:func:`run_time` of the run ``cfg`` on each of ``hardwares`` (its work counted once)."""
    _, works, reference_works, spec = time_works(cfg)
    needed = plan(cfg).total_bytes if any(hw.memory_bytes is not None for hw in hardwares) else 0
    results = []
    for hardware in hardwares:
        result = time_model.run_time(
            works, reference_works, n_documents(cfg), spec.n_tokens, spec.batch, hardware
        )
        if hardware.memory_bytes is not None and needed > hardware.memory_bytes:
            result.notes.append(
                f"the memory plan ({needed / 1e9:.1f} GB) exceeds the {hardware.name}'s "
                f"{hardware.memory_bytes / 1e9:.0f} GB"
            )
        results.append(result)
    return results


def shared_work(cfg: DictConfig) -> tuple[str | None, str | None]:
    """What a sweep's runs share (:mod:`rmm.sharing`, ``reuse=true``): (the key of the run's streams when
    its policy ignores the budget, the key of its reference passes when it has them); None for neither.
    Runs with equal keys compute that part once."""
    if not cfg.get("reuse", True):
        return None, None
    config = OmegaConf.to_container(cfg, resolve=True)
    spec = run_spec(cfg)
    budget_free = cfg.budget is not None and spec.budget is None
    stream = sharing.fingerprint(sharing.budget_free_config(config)) if budget_free else None
    reference = sharing.fingerprint(sharing.reference_config(config)) if spec.reference else None
    return stream, reference


def without_shared(result: time_model.RunTime, stream: str | None, reference: str | None) -> None:
    """Take from ``result`` what an earlier run of the sweep computed: its streams (``stream``, the label
    of the run that streamed them) or its reference passes (``reference``)."""
    if stream is not None:
        result.stream_s = result.reference_s = 0.0
        result.passes = result.reference_passes = 0
        result.notes.append(f"counted once per sweep: reuses {stream} (its policy ignores the budget)")
    elif reference is not None:
        result.reference_s, result.reference_passes = 0.0, 0
        result.notes.append(f"reference passes counted once per sweep: those of {reference}")


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The runs of ``run.py -m <overrides>``, as Hydra's basic sweeper makes them: the composed config's
    ``hydra.sweeper.params`` (an ``experiment=`` preset's sweep) and the command line's comma lists
    (``policy=h2o,rmm``, ``range(...)``), the command line winning for a key both set; their product."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    params = compose_config(fixed, hydra=True).hydra.sweeper.get("params") or {}
    lines = [f"{key}={value}" for key, value in params.items()] + overrides
    choices: dict[str, list[str]] = {}
    for override in parser.parse_overrides(lines):
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise ValueError(f"{override.input_line}: only comma lists and range() sweep here")
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*choices.values())]


def hardware_named(name: str) -> Hardware:
    """A named GPU (:data:`checks.time_model.GPUS`) or a JSON file of constants (name, flops, bytes_per_s,
    launch_s): ``--calibrate --constants-out``'s, or checks/gpu_check.py's JSON, whose ``kernels``
    section's ``calibration`` holds them."""
    if name.lower() in GPUS:
        return GPUS[name.lower()]
    path = Path(name)
    if not path.is_file():
        raise SystemExit(f"--gpu {name}: not one of {sorted(GPUS)} nor a constants JSON file")
    data = json.loads(path.read_text())
    if isinstance(data, list):  # --constants-out writes one entry per fitted group: the first
        data = data[0]
    elif "sections" in data:  # checks/gpu_check.py's JSON
        data = data["sections"]["kernels"]["calibration"]
    return Hardware(
        name=data["name"],
        flops=float(data["flops"]),
        bytes_per_s=float(data["bytes_per_s"]),
        launch_s=float(data["launch_s"]),
        memory_bytes=data.get("memory_bytes"),
        note=data.get("note", f"constants from {path}"),
    )


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def time_report(overrides: list[str], hardware: Hardware) -> dict[str, Any]:
    """Every run of the sweep ``overrides`` describes (one run without a sweep): its expected time, what
    the sweep shares counted once (:func:`shared_work`), and the total at the ends of
    :data:`~checks.time_model.LAUNCH_RANGE` (the cost per launch halved and doubled)."""
    low, high = (
        time_model.with_constants(hardware, {"launch_s": hardware.launch_s * factor})
        for factor in time_model.LAUNCH_RANGE
    )
    runs, refused, first = [], [], {}
    for job in sweep_jobs(overrides):
        try:
            cfg = compose_config(job)
            result, at_low, at_high = run_times(cfg, [hardware, low, high])
            keys = shared_work(cfg)
        except ValueError as err:
            refused.append({"overrides": job, "error": str(err)})
            continue
        label = (
            f"{cfg.model.name} {cfg.policy.name} B={cfg.budget} C={cfg.chunk} "
            f"positions={cfg.positions} batch={result.batch}"
        )
        stream, reference = (first.get(key) if key is not None else None for key in keys)
        for times in (result, at_low, at_high):
            without_shared(times, stream, reference)
        for key in keys:
            if key is not None:
                first.setdefault(key, label)
        runs.append(
            {
                "overrides": job,
                "run": label,
                **result.as_dict(),
                "wall_s_range": [at_low.wall_s, at_high.wall_s],
            }
        )
    total = sum(run["wall_s"] for run in runs)
    total_range = [sum(run["wall_s_range"][i] for run in runs) for i in (0, 1)]
    return {
        "hardware": asdict(hardware),
        "assumptions": {
            "matmul_utilisation": time_model.MATMUL_UTILISATION,
            "bandwidth_utilisation": time_model.BANDWIDTH_UTILISATION,
            "gpu_launch_s": time_model.LAUNCH_S,
            "launch_range": [low.launch_s, high.launch_s],
            "op_counts": {name: asdict(count) for name, count in time_model.OP_COUNTS.items()},
            "documents": "every document dataset.max_tokens long",
            "shared": "full once per sweep, each reference pass once (reuse=true, rmm.sharing)",
        },
        "runs": runs,
        "refused": refused,
        "total_wall_s": total,
        "total_device_hours": total / 3600,
        "total_device_hours_range": [t / 3600 for t in total_range],
    }


def print_time(report: dict[str, Any]) -> None:
    hw = report["hardware"]
    print(f"{hw['name']}: {hw['note']}")
    runs = report["runs"]
    low_s, high_s = report["assumptions"]["launch_range"]
    at = f"at {low_s * 1e6:g} and {high_s * 1e6:g} us per launch"
    if len(runs) == 1 and not report["refused"]:
        run = runs[0]
        print(f"{run['run']}: {run['n_docs']} documents x {run['tokens_per_doc']} tokens")
        print(f"  forward passes           {run['passes']:>12d}")
        print(f"  reference pass passes    {run['reference_passes']:>12d}")
        print(f"  streams                  {hours(run['stream_s']):>12s}  ({run['stream_s']:.1f} s)")
        print(f"  reference passes         {hours(run['reference_s']):>12s}  ({run['reference_s']:.1f} s)")
        print(f"  total                    {hours(run['wall_s']):>12s}  ({run['tokens_per_s']:.0f} tokens/s)")
        low, high = (hours(s) for s in run["wall_s_range"])
        print(f"  range                    {low:>12s} to {high} ({at})")
        names = {"compute": "compute-bound", "bandwidth": "bandwidth-bound", "overhead": "host launches"}
        split = ", ".join(f"{names[key]} {share:.0%}" for key, share in run["shares"].items())
        print(f"  the streams' time: {split}")
    else:
        print(f"{len(runs)} runs:")
        for run in runs:
            rate = f"{run['tokens_per_s']:>10.0f} tok/s" if run["wall_s"] else f"{'(shared)':>16s}"
            print(f"  {hours(run['wall_s']):>10s} {rate}  {' '.join(run['overrides'])}")
        for run in report["refused"]:
            print(f"  refused: {' '.join(run['overrides'])}: {run['error']}")
        low, high = report["total_device_hours_range"]
        print(
            f"total: {report['total_device_hours']:.1f} device-hours ({len(runs)} runs, one device each); "
            f"{low:.1f} to {high:.1f} {at}"
        )
    for run in runs:
        for note in run["notes"]:
            print(f"  note ({run['run']}): {note}")
    if report["refused"]:
        print(f"runs the configs refuse (not counted): {len(report['refused'])}")


# ---- calibration -------------------------------------------------------------------------------------
POINT_KEYS = (
    "model",
    "policy",
    "positions",
    "budget",
    "chunk",
    "batch",
    "n_docs",
    "tokens_per_doc",
    "wall_s",
)
PLAIN_FORWARD = "plain_forward"  # a point of plain forward passes over `chunk`-token windows


def point_label(point: dict[str, Any]) -> str:
    return (
        f"{point['model']} {point['policy']}/{point['positions']} B={point['budget']} C={point['chunk']} "
        f"N={point['batch']} {point['n_docs']}x{point['tokens_per_doc']}"
    )


def point_policy(point: dict[str, Any]) -> tuple[str, str]:
    """(policy name, rmm weight or "") of a point: ``policy`` is a name, optionally ``name[weight]`` or
    ``name@variant`` (bench.py's ``window@C``: see ``pass_tokens``); bench.py's ``run`` label
    (``rmm[gradient]/original``) names the weight where ``policy`` does not."""
    name = point["policy"].split("@")[0]
    name, _, weight = name.partition("[")
    if not weight and "[" in str(point.get("run", "")):
        weight = str(point["run"]).split("[")[1]
    return name, weight.split("]")[0]


def point_overrides(point: dict[str, Any]) -> list[str]:
    """The config of a measured point (:func:`point_policy`)."""
    name, weight = point_policy(point)
    overrides = [
        f"model={point['model']}",
        f"policy={name}",
        f"budget={'null' if point['budget'] is None else point['budget']}",
        f"chunk={point['chunk']}",
        f"positions={point['positions']}",
        f"batch={point['batch']}",
        f"dataset.max_tokens={point['tokens_per_doc']}",
        f"dataset.n_docs={point['n_docs']}",
        f"dtype={point.get('dtype', 'float32')}",
    ]
    if weight:
        overrides.append(f"policy.weight={weight}")
    if name == "rmm" and point["budget"] is not None:  # the lag changes no cost; keep it valid
        overrides.append(f"lag={max(1, min(32, point['budget'] - point['chunk']))}")
    return overrides


def point_works(point: dict[str, Any]) -> np.ndarray:
    """The work groups [k, 3] of a measured point, as the time model counts them (``pass_tokens``, when
    given, is the tokens per forward pass per document)."""
    if point["policy"] == PLAIN_FORWARD:
        cfg = compose_config([f"model={point['model']}", f"dtype={point.get('dtype', 'float32')}"])
        arch = model_architecture(cfg.model)
        element = torch.empty(0, dtype=resolve_dtype(cfg.dtype, "cuda")).element_size()
        window = point["chunk"]
        stream = StreamShape(point["tokens_per_doc"], 0, window, window, causal=True)
        works, _ = time_model.run_works(
            ModelShape.from_architecture(arch), stream, point["n_docs"], point["batch"], element
        )
        return time_model.totals(works)
    cfg = compose_config(point_overrides(point))
    _, works, reference_works, spec = time_works(cfg, point["n_docs"], point.get("pass_tokens"))
    recorded = point.get("records_attention")
    if recorded is not None and bool(recorded) != spec.recording.record_attention:
        raise ValueError(
            f"records_attention={recorded} but the composed config's policy records "
            f"{'attention' if spec.recording.record_attention else 'none'}"
        )
    return time_model.totals(works + reference_works)


def calibrate(points: list[dict[str, Any]], command: str) -> tuple[str, list[dict[str, Any]]]:
    """Fit the time model's constants per (device, threads) group of measured points; returns the
    Markdown report and the fitted constants."""
    groups: dict[tuple[str, int], list[tuple[dict[str, Any], np.ndarray]]] = {}
    skipped = []
    for point in points:
        if missing := [key for key in POINT_KEYS if key not in point]:
            skipped.append((point, f"missing {missing}"))
            continue
        try:
            works = point_works(point)
        except Exception as err:  # noqa: BLE001 (a point the model cannot describe is reported, not fatal)
            skipped.append((point, f"{type(err).__name__}: {str(err).splitlines()[0]}"))
            continue
        key = (point.get("device", "cpu"), int(point.get("threads") or 0))
        groups.setdefault(key, []).append((point, works))
    lines = [
        "# Time model calibration",
        "",
        f"Written by `{command}`. Constants fitted by least squares in log time per (device, threads);",
        "predicted against measured for every point (ratio: predicted / measured).",
        "",
    ]
    constants = []
    for (device, threads), members in sorted(groups.items()):
        if len(members) < 3:
            lines += [
                f"## {device}, {threads} threads: {len(members)} points, too few to fit 3 constants",
                "",
            ]
            continue
        result = time_model.fit([works for _, works in members], [p["wall_s"] for p, _ in members])
        hardware = result.hardware(f"{device} ({threads} threads, fitted)")
        constants.append(asdict(hardware) | {"device": device, "threads": threads})
        flops, moved, overhead = result.constants
        lines += [
            f"## {device}, {threads} threads ({len(members)} points)",
            "",
            f"- effective FLOP/s: {flops:.3e}" + ("" if result.identified["flops"] else " (not identified)"),
            f"- effective bytes/s: {moved:.3e}"
            + ("" if result.identified["bytes_per_s"] else " (not identified: no point is bandwidth-bound)"),
            f"- host cost per dispatched op: {overhead * 1e6:.2f} us"
            + ("" if result.identified["launch_s"] else " (not identified)"),
            f"- largest relative error: {result.max_relative_error:.1%}",
            "",
            "| point | measured s | predicted s | measured tok/s | predicted tok/s | ratio |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for (point, _), predicted, ratio in zip(members, result.predicted_s, result.ratios, strict=True):
            measured_rate = (
                point.get("tokens_per_s") or point["n_docs"] * point["tokens_per_doc"] / point["wall_s"]
            )
            lines.append(
                f"| {point_label(point)} | {point['wall_s']:.2f} | {predicted:.2f} | {measured_rate:.1f} | "
                f"{measured_rate / ratio:.1f} | {ratio:.3f} |"
            )
        lines.append("")
    if not constants:
        lines += ["No group of points to fit.", ""]
    if skipped:
        lines += ["## Skipped points", ""]
        lines += [f"- {point.get('policy', '?')}: {why}" for point, why in skipped]
        lines.append("")
    return "\n".join(lines), constants


def load_points(path: Path) -> list[dict[str, Any]]:
    """Speed points: a list (results/bench/speed_points.json), or checks/gpu_check.py's JSON, whose
    ``points`` section holds them."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        return data["sections"]["points"]["speed_points"]
    return data


def gib(n: int) -> str:
    return f"{n / 2**30:8.2f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="run.py overrides, e.g. model=llama3_8b budget=4096")
    parser.add_argument(
        "--gpu-memory", type=float, help="GPU memory in GiB: report the largest chunk and batch that fit"
    )
    parser.add_argument("--json", action="store_true", help="print the plan (or the times) as JSON")
    parser.add_argument("--time", action="store_true", help="print the expected wall time of the run(s)")
    parser.add_argument(
        "--gpu",
        default="h200",
        help=f"for --time: {', '.join(sorted(GPUS))}, or a constants JSON file (--constants-out's, or "
        "checks/gpu_check.py's: its kernels section's calibration)",
    )
    parser.add_argument(
        "--launch-us",
        type=float,
        help="for --time: the host cost of one dispatched op in us instead of the device's (sensitivity)",
    )
    parser.add_argument("--calibrate", type=Path, help="speed points JSON: fit the time model's constants")
    parser.add_argument("--out", type=Path, help="with --calibrate: write the Markdown table here")
    parser.add_argument("--constants-out", type=Path, help="with --calibrate: write the fitted constants")
    args = parser.parse_args(argv)
    if args.calibrate:
        command = "python checks/plan.py --calibrate " + str(args.calibrate)
        command += f" --out {args.out}" if args.out else ""
        report, constants = calibrate(load_points(args.calibrate), command)
        print(report)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(report + "\n")
        if args.constants_out:
            args.constants_out.write_text(json.dumps(constants, indent=2) + "\n")
        return
    if args.time:
        hardware = hardware_named(args.gpu)
        if (launch := args.launch_us) is not None:
            hardware = time_model.with_constants(hardware, {"launch_s": launch / 1e6})
            hardware = replace(hardware, note=f"{hardware.note}; {launch:g} us per dispatched op")
        report = time_report(args.overrides, hardware)
        print(json.dumps(report, indent=2)) if args.json else print_time(report)
        return
    cfg = compose_config(args.overrides)
    result = asdict(plan(cfg))
    if args.gpu_memory:
        result["gpu_memory_bytes"] = int(args.gpu_memory * 2**30)
        result["largest_chunk"] = largest_chunk(cfg, result["gpu_memory_bytes"])
        result["largest_batch"] = largest_batch(cfg, result["gpu_memory_bytes"])
    if args.json:
        print(json.dumps(result, indent=2))
        return
    dtype = str(resolve_dtype(cfg.dtype, "cuda")).removeprefix("torch.")
    print(
        f"{cfg.model.name} ({dtype}), policy {cfg.policy.name}, B={cfg.budget}, C={cfg.chunk}, "
        f"positions={cfg.positions}, batch {result['batch']} x {cfg.dataset.max_tokens}-token streams"
    )
    rows = [
        ("weights", "weights_bytes"),
        ("KV slots", "kv_bytes"),
        ("attention scratch", "scratch_bytes"),
        ("activations (one pass)", "activation_bytes"),
        ("reference pass", "reference_pass_bytes"),
        ("total", "total_bytes"),
    ]
    for label, key in rows:
        print(f"  {label:24s} {gib(result[key])}")
    if args.gpu_memory:
        fits = result["largest_chunk"]
        print(
            f"  largest chunk within {args.gpu_memory:g} GiB at batch {result['batch']}: "
            + (f"C={fits}" if fits else "none (even C=1 does not fit)")
        )
        fits = result["largest_batch"]
        print(
            f"  largest batch within {args.gpu_memory:g} GiB at C={cfg.chunk}: "
            + (f"{fits}" if fits else "none (even batch 1 does not fit)")
            + (f" (the cap, {MAX_BATCH})" if fits == MAX_BATCH else "")
        )


if __name__ == "__main__":
    sys.exit(main())
