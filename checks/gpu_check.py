"""One-call GPU check: kernels and host overhead per pass, the engine's correctness on the device, then the
speed and memory of a 7-8B shape.

    python -m checks.gpu_check                        # on a CUDA machine: about 5 minutes on one H200
    python -m checks.gpu_check --device cpu --small   # the same, end to end, in seconds (tests)

Needs only torch, transformers, numpy, pandas and this package (no Hydra, W&B, datasets, GGUF or hub:
every model is random-initialised). Prints one JSON summary, then the time model's constants as measured
and the command that predicts with them, and writes the JSON to ``--out`` (rewritten after every
section, so a run cut short keeps what it measured); each section's elapsed time goes to stderr as it
ends. Sections, in this order:

- ``kernels``: the ``speed`` section's model at B=2048, C=64: h2o, rmm (lag 64), random (no attention
  recorded: the fused attention call with a mask, as the position rules) and the equal-work forward,
  each at batch 4 and 16 (documents of 3,328 random tokens), measured over windows of 5 passes once
  the memory is full: wall time per pass, CUDA kernels per pass and their summed durations (the GPU-busy
  time; torch.profiler with CUDA activity), dispatched ops per pass (:class:`checks.op_count.OpCounter`),
  the kernels that took longest, overall and among the attention's (a fallback to the unfused math
  kernel shows there), the time model's FLOPs, bytes and launches of such a pass, and the time model's
  constants from them (:func:`calibration`), which ``checks/plan.py --time --gpu <the JSON>`` reads. On
  the CPU the launches are the dispatched ops less views and the busy time the ops' own (said in each row).
- ``points``: what recalibrates the time model (checks/time_model.py) on the device, as speed points
  (the format of results/bench/speed_points.json, for ``checks/plan.py --calibrate``): the same
  model, h2o and rmm at B=256, C=64 at batch 1 and 4 (four 2048-token documents), window at batch 4,
  and plain forward passes over 2048-token windows.
- ``matrix``: the reference matrix (tiny random Llama, Qwen2, Mistral, GPT-NeoX; every policy; chunk 1
  and 4; both position modes). The token-by-token reference (:mod:`rmm.reference`) runs on the CPU in
  fp32; the engine runs on the device in fp32, where it must agree as on the CPU, and in bf16, where
  NLL agreement and the fraction of identical retained sets are reported.
- ``speed``: a random-init bf16 model with Llama-3.1-8B's architecture (``conf/model/llama3_1_8b.yaml``:
  32 layers, GQA 32/8, head_dim 128, llama3 rope scaling) streaming 32k tokens at B=2048: tokens/s of
  window, streaming_llm (cache positions), h2o and rmm; plain forward passes over 8k-token windows
  (SDPA); the equal-work forward (the model's own, C tokens per pass, a KV cache of B - C + 1 keys); a
  token-by-token eviction loop over 1k tokens; peak device memory at 8k and 32k tokens.

Expected time on one H200 (estimates: nothing here has run on a GPU yet; docs/gpu.md): ``kernels``
about 1 minute, ``points`` under 1, ``matrix`` 1 to 3, ``speed`` about 2, with the model's set-up
under 6 minutes in all.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import platform
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import transformers
import yaml
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from transformers import AutoModelForCausalLM, PreTrainedModel

from checks import time_model
from checks.matrix import (
    ARCHITECTURES,
    CASES,
    case_id,
    distinct_stream,
    ranked_by_rounding,
    ranks_keys,
    runs_under,
    sampled_stream,
    tiny_model,
)
from checks.op_count import OpCounter
from checks.time_model import Hardware, ModelShape, StreamShape
from checks.yardsticks import equal_work, plain_forward, token_loop
from rmm.engine import StreamingEngine, StreamRequest, retained_sets_recorder
from rmm.files import atomic_write_text
from rmm.integration import cache_keyword
from rmm.lookahead import record_future
from rmm.models import config_from_architecture
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

ROOT = Path(__file__).resolve().parents[1]
SPEED_ARCHITECTURE = ROOT / "conf" / "model" / "llama3_1_8b.yaml"

# ---- the reference matrix (checks/matrix.py: the test suite's models and policy cases) ---------------
MATRIX_BUDGET = 12
MATRIX_TOKENS = 48
SMALL_MATRIX_TOKENS = 24
FP32_NLL_ATOL = 1e-4  # fp32 engine vs fp32 reference, per token (what the CPU test suite requires)


def matrix_cases(archs: list[str], every_case: bool = True) -> list[tuple[str, str, dict, int, str]]:
    """(arch, policy, params, chunk, positions) over chunk 1 and 4 and both position modes; without
    ``every_case`` only each policy's first case."""
    cases = [c for i, c in enumerate(CASES) if every_case or c[0] not in {n for n, _ in CASES[:i]}]
    out = []
    for arch, (name, params), chunk, positions in itertools.product(
        archs, cases, [1, 4], ["original", "cache"]
    ):
        if name == "rmm" and params["lag"] != "auto" and params["lag"] >= MATRIX_BUDGET - chunk + 1:
            continue
        if not runs_under(name, params, positions) or ranked_by_rounding(arch, name, params):
            continue
        out.append((arch, name, params, chunk, positions))
    return out


def engine_run(model, tokens, name, params, chunk, positions) -> tuple[Any, dict[int, list]]:
    """The engine's result and its retained sets R_now per boundary ([L][H] sorted position lists)."""
    policy = make_policy({"name": name, **params}, budget=MATRIX_BUDGET, chunk=chunk)
    policy.prepare(tokens, lambda stream: record_future(model, stream, tau=0.02, context=1024))
    hook, sets = retained_sets_recorder()
    result = StreamingEngine(model, policy, positions=positions).stream(tokens, on_boundary=hook)
    return result, sets


def compare(result, sets, ref_nll, ref_correct, ref_sets) -> dict[str, float]:
    """Agreement of one engine run with the reference."""
    pairs = [
        (set(head), set(ref_sets[now][layer][h]))
        for now, engine_set in sets.items()
        for layer, heads in enumerate(engine_set)
        for h, head in enumerate(heads)
    ]
    split = [now for now, engine_set in sets.items() if engine_set != ref_sets[now]]
    first_split = min(split, default=ref_nll.numel() + 1)  # queries before it saw identical sets
    diff = (result.nll - ref_nll).abs()
    return {
        "max_token_nll_diff": float(diff.max()),
        "token_nll_diff_while_same": float(diff[:first_split].max()) if first_split else 0.0,
        "mean_nll_diff": abs(result.nll.double().mean().item() - ref_nll.double().mean().item()),
        "argmax_agreement": float((result.correct == ref_correct).float().mean()),
        "same_sets": sum(a == b for a, b in pairs) / len(pairs) if pairs else 1.0,
        "set_overlap": sum(len(a & b) / max(len(a | b), 1) for a, b in pairs) / len(pairs) if pairs else 1.0,
    }


def _as_loaded(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` in ``dtype`` as ``from_pretrained(dtype=)`` (rmm.models) gives it: its rotary
    frequencies (``*inv_freq``) stay float32."""
    kept = {name: buffer for name, buffer in model.named_buffers() if name.endswith("inv_freq")}
    model.to(device=device, dtype=dtype)
    for name, buffer in kept.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buffer.to(device))
    return model


def reference_matrix(
    device: torch.device,
    dtypes: list[torch.dtype],
    cases: list[tuple[str, str, dict, int, str]],
    n_tokens: int = MATRIX_TOKENS,
) -> pd.DataFrame:
    """One row per (case, dtype): the engine on ``device`` against the fp32 CPU reference."""
    rows = []
    models: dict[str, PreTrainedModel] = {}
    streams: dict[str, torch.Tensor] = {}
    engine_models: dict[tuple[str, torch.dtype], PreTrainedModel] = {}  # one per (arch, dtype), not per case
    for arch, name, params, chunk, positions in cases:
        if arch not in models:
            models[arch] = tiny_model(arch)
            streams[arch] = sampled_stream(models[arch], n_tokens)
        reference_model, tokens = models[arch], streams[arch]
        if ranks_keys(name):  # scores, not the tie rule, are compared (see distinct_stream)
            tokens = distinct_stream(n_tokens)
        spec = ReferenceSpec(policy=name, budget=MATRIX_BUDGET, chunk=chunk, positions=positions, **params)
        ref_nll, ref_correct = reference_stream(reference_model, tokens, spec)
        for dtype in dtypes:
            if (arch, dtype) not in engine_models:
                engine_models[arch, dtype] = _as_loaded(tiny_model(arch), device, dtype)
            model = engine_models[arch, dtype]
            result, sets = engine_run(model, tokens.to(device), name, params, chunk, positions)
            row = compare(result, sets, ref_nll, ref_correct, spec.retained_log)
            case = case_id(name, params).rstrip("-")
            rows.append({"arch": arch, "case": case, "policy": name, "chunk": chunk, "positions": positions})
            rows[-1] |= {"dtype": str(dtype).removeprefix("torch."), **row}
    return pd.DataFrame(rows)


def summarize_matrix(frame: pd.DataFrame) -> dict[str, Any]:
    """Per dtype: worst NLL agreement, identical retained sets overall and per policy."""
    out = {}
    for dtype, rows in frame.groupby("dtype"):
        same = rows.groupby("policy")["same_sets"].mean()
        summary = {
            "runs": len(rows),
            "max_token_nll_diff": float(rows["max_token_nll_diff"].max()),
            "max_token_nll_diff_while_sets_identical": float(rows["token_nll_diff_while_same"].max()),
            "max_mean_nll_diff": float(rows["mean_nll_diff"].max()),
            "min_argmax_agreement": float(rows["argmax_agreement"].min()),
            "identical_sets_frac": float(rows["same_sets"].mean()),
            "identical_sets_frac_by_policy": {k: round(float(v), 4) for k, v in same.items()},
            "min_set_overlap": float(rows["set_overlap"].min()),
        }
        if dtype == "float32":
            bad = rows[(rows["max_token_nll_diff"] > FP32_NLL_ATOL) | (rows["same_sets"] < 1.0)]
            summary["agrees"] = bad.empty
            summary["nll_atol"] = FP32_NLL_ATOL
            summary["disagreeing"] = [
                f"{r.arch} {r.case} C={r.chunk} {r.positions}" for r in bad.itertuples()
            ]
        out[str(dtype)] = summary
    return out


# ---- speed and memory ------------------------------------------------------------------------------
@functools.cache  # one model for the speed and points sections
def speed_model(device: torch.device, small: bool) -> PreTrainedModel:
    """Llama-3.1-8B's architecture, random-initialised in bf16 on ``device`` (``small``: 2 narrow layers)."""
    arch = yaml.safe_load(SPEED_ARCHITECTURE.read_text())["architecture"]
    overrides = (
        dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024)
        | dict(num_attention_heads=8, num_key_value_heads=2)
        if small
        else {}
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config_from_architecture(arch, **overrides), dtype=torch.bfloat16
        )
    return model.eval().requires_grad_(False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    """Peak allocated device memory since the last reset (None on the CPU: not measured here)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


SPEED_POLICIES = [  # rmm's lag is B / 32 (64 at B = 2048)
    ("window", {}, "original"),
    ("streaming_llm", {}, "cache"),
    ("h2o", {}, "original"),
    ("rmm", {}, "original"),
]


def speed(device: torch.device, small: bool, chunk: int) -> dict[str, Any]:
    """tokens/s and peak memory of the engine, plain forward passes, the equal-work forward (batch 1, as
    the engine here) and a token loop."""
    n, short, budget, window, loop = (512, 128, 64, 128, 64) if small else (32768, 8192, 2048, 8192, 1024)
    chunk = min(chunk, budget // 4)  # room for rmm's lag at the small sizes
    model = speed_model(device, small)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.config.vocab_size, (n,), generator=generator).to(device)
    out: dict[str, Any] = {
        "model": "llama3_1_8b architecture, random init" + (" (small: 2 narrow layers)" if small else ""),
        "dtype": "bfloat16",
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens": n,
        "budget": budget,
        "chunk": chunk,
        "tokens_per_s": {},
        "peak_memory_bytes": {str(short): {}, str(n): {}},
    }
    for name, params, positions in SPEED_POLICIES:
        key = f"{name}/{positions}"
        params = {"lag": budget // 32} if name == "rmm" else params
        policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
        engine = StreamingEngine(model, policy, positions=positions)
        engine.self_check(tokens[:n])  # the longest probe: not run again while timed
        engine.stream(tokens[: 2 * chunk + 1])  # warm-up
        for length in (short, n):
            peak_reset(device)
            seconds = timed(device, lambda engine=engine, length=length: engine.stream(tokens[:length]))
            out["peak_memory_bytes"][str(length)][key] = peak_bytes(device)
            if length == n:
                out["tokens_per_s"][key] = (n - 1) / seconds
    plain_forward(model, tokens[:window], window)  # warm-up
    peak_reset(device)
    out["tokens_per_s"][f"plain_forward_{window}"] = n / timed(
        device, lambda: plain_forward(model, tokens, window)
    )
    out["peak_memory_bytes"][str(n)][f"plain_forward_{window}"] = peak_bytes(device)
    equal_work(model, tokens[None, : 2 * chunk + 1], budget, chunk)  # warm-up
    out["tokens_per_s"]["equal_work"] = n / timed(
        device, lambda: equal_work(model, tokens[None], budget, chunk)
    )
    token_loop(model, tokens[:8], budget)  # warm-up
    seconds = timed(device, lambda: token_loop(model, tokens[:loop], budget))
    out["tokens_per_s"][f"token_loop_{loop}"] = (loop - 1) / seconds
    rates = out["tokens_per_s"]
    out["ratios"] = (
        {
            f"{key} / plain_forward": rates[key] / rates[f"plain_forward_{window}"]
            for key in rates
            if "/" in key
        }
        | {f"{key} / equal_work": rates[key] / rates["equal_work"] for key in rates if "/" in key}
        | {f"{key} / token_loop": rates[key] / rates[f"token_loop_{loop}"] for key in rates if "/" in key}
    )
    return out


# ---- speed points for the time model ---------------------------------------------------------------
POINT_POLICIES = [  # (name, parameters, positions, batch): B=256, C=64; rmm's lag is the config default
    ("h2o", {}, "original", 1),
    ("h2o", {}, "original", 4),
    ("rmm", {"lag": 32}, "original", 1),
    ("rmm", {"lag": 32}, "original", 4),
    ("window", {}, "original", 4),
]


def speed_points(device: torch.device, small: bool) -> dict[str, Any]:
    """Speed points (results/bench/speed_points.json's format, plus ``device`` and ``dtype``) of the speed
    section's model: each engine configuration streams four documents side by side ``batch`` at a time,
    timed after a warm-up; plain forward passes over ``window``-token windows of one longer stream."""
    n_docs, n, budget, chunk, window = (4, 256, 64, 16, 128) if small else (4, 2048, 256, 64, 2048)
    model = speed_model(device, small)
    generator = torch.Generator().manual_seed(1)
    docs = torch.randint(model.config.vocab_size, (n_docs, n), generator=generator).to(device)
    common = {
        # small: 2 narrow layers, no shipped config: checks/plan.py --calibrate skips these points
        "model": "llama3_1_8b" + ("_small_test" if small else ""),
        "threads": torch.get_num_threads(),
        "device": device.type,
        "dtype": "bfloat16",
    }
    points = []
    for name, params, positions, batch in POINT_POLICIES:
        policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
        engine = StreamingEngine(model, policy, positions=positions, batch=batch)
        engine.self_check(docs[0])  # the documents' probe: not run again while timed
        warm = [StreamRequest(docs[i, : 2 * chunk + 1], copy.copy(policy)) for i in range(batch)]
        for _ in engine.stream_many(warm):
            pass
        requests = [StreamRequest(docs[i], copy.copy(policy)) for i in range(n_docs)]
        seconds = timed(device, lambda engine=engine, requests=requests: list(engine.stream_many(requests)))
        points.append(
            common
            | {"policy": name, "positions": positions, "budget": budget, "chunk": chunk, "batch": batch}
            | {
                "n_docs": n_docs,
                "tokens_per_doc": n,
                "records_attention": engine.plan.recording.record_attention,
            }
            | {"wall_s": seconds, "tokens_per_s": n_docs * n / seconds}
        )
    stream = docs.reshape(-1)
    plain_forward(model, stream[:window], window)  # warm-up
    seconds = timed(device, lambda: plain_forward(model, stream, window))
    points.append(
        common
        | {"policy": "plain_forward", "positions": "original", "budget": None, "chunk": window, "batch": 1}
        | {"n_docs": 1, "tokens_per_doc": stream.numel(), "records_attention": False}
        | {"wall_s": seconds, "tokens_per_s": stream.numel() / seconds}
    )
    return {"speed_points": points}


# ---- kernels per pass, device-busy time, the attention kernels, the time model's constants ----------
EQUAL_WORK = "equal_work"
KERNEL_RUNS: list[tuple[str, dict[str, Any]]] = [  # (a policy or EQUAL_WORK, params); rmm's lag: B / 32
    ("h2o", {}),
    ("rmm", {}),
    ("random", {}),  # records no attention: the fused SDPA call with a mask (as window, streaming_llm)
    (EQUAL_WORK, {}),
]
KERNEL_SIZES = {  # small -> (B, C, batches, passes per window)
    False: (2048, 64, (4, 16), 5),
    True: (64, 16, (2, 4), 2),
}
FUSED_NAMES = ("flash", "fmha", "efficient", "cudnn", "sdpa")  # fused attention kernels (or CPU ops)
ATTENTION_NAMES = (*FUSED_NAMES, "attention", "attn", "softmax", "bmm")
NOT_ATTENTION = ("log_softmax", "logsoftmax")  # the NLL's log-softmax over the vocabulary
COPY_NAMES = ("Memcpy", "Memset")  # device activities that are copies, not kernel launches
TOP_KERNELS, NAME_CHARS = 6, 160


class Stopwatch:
    """Seconds from entering to leaving (``seconds``)."""

    seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


@contextlib.contextmanager
def pass_windows(
    model: PreTrainedModel,
    device: torch.device,
    first: int,
    passes: int,
    windows: list[AbstractContextManager],
) -> Iterator[None]:
    """Hold ``windows[k]`` open over ``passes`` forward passes (calls of ``model``, counted from 0 on
    entry) from call ``first + k (passes + 1)``: each opens before its first call and closes before the
    call after its last, the device synchronised at both ends. Raises if the calls end too soon."""
    starts = {first + k * (passes + 1): window for k, window in enumerate(windows)}
    ends = {start + passes for start in starts}
    calls, stack, closed = itertools.count(), contextlib.ExitStack(), []

    def hook(module: torch.nn.Module, args: tuple) -> None:
        call = next(calls)
        if call in ends or call in starts:
            synchronize(device)
        if call in ends:
            stack.close()
            closed.append(call)
        if call in starts:
            stack.enter_context(starts[call])

    handle = model.register_forward_pre_hook(hook)
    try:
        yield
        if len(closed) < len(windows):
            raise RuntimeError(f"the streams ended before call {max(ends)}, where the last window closes")
    finally:
        handle.remove()
        stack.close()


def device_work(profiler: torch.profiler.profile, device: torch.device) -> list[tuple[str, float]]:
    """(name, seconds) of everything the profiler saw run on ``device``: every CUDA kernel and copy; on the
    CPU (no kernels) every op's self CPU time."""
    events = profiler.events()
    if device.type == "cuda":
        return [(e.name, e.time_range.elapsed_us() / 1e6) for e in events if e.device_type == DeviceType.CUDA]
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    return [(e.name, e.self_cpu_time_total / 1e6) for e in cpu]


def kernel_names(work: list[tuple[str, float]], passes: int) -> dict[str, Any]:
    """The kernels (CPU: ops) that took the most time, overall and among the attention's (names with
    :data:`ATTENTION_NAMES`, none of :data:`NOT_ATTENTION`), per pass; ``fused_attention``: whether a
    fused attention kernel (:data:`FUSED_NAMES`) ran."""
    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for name, duration in work:
        seconds[name] += duration
        calls[name] += 1
    ranked = [name for name, _ in seconds.most_common()]
    attention = [
        name
        for name in ranked
        if any(w in name.lower() for w in ATTENTION_NAMES)
        and not any(w in name.lower() for w in NOT_ATTENTION)
    ]

    def rows(names: list[str]) -> list[dict[str, Any]]:
        return [
            {
                "name": n[:NAME_CHARS],
                "calls_per_pass": calls[n] / passes,
                "ms_per_pass": 1e3 * seconds[n] / passes,
            }
            for n in names[:TOP_KERNELS]
        ]

    fused = any(word in name.lower() for name in attention for word in FUSED_NAMES)
    return {"top_kernels": rows(ranked), "attention_kernels": rows(attention), "fused_attention": fused}


def kernel_run(
    model: PreTrainedModel, device: torch.device, name: str, params: dict, docs: torch.Tensor, small: bool
) -> dict[str, Any]:
    """One row of the ``kernels`` section: ``docs`` [N, n] streamed side by side under ``name`` (or the
    equal-work forward), measured over three windows of steady-state passes (the memory full): wall time
    (nothing else running), the profiler's kernels and their durations, and the dispatched ops
    (:class:`checks.op_count.OpCounter`); beside them the time model's FLOPs, bytes and launches of
    such a pass."""
    budget, chunk, _, passes = KERNEL_SIZES[small]
    batch, n_tokens = docs.shape
    shape = ModelShape.from_architecture(model.config.to_dict())
    if name == EQUAL_WORK:
        # the work of a position rule's pass over B - C + 1 retained slots; the launches: the plain forward's
        stream = functools.partial(equal_work, model, budget=budget, chunk=chunk)
        streams = StreamShape(n_tokens, budget - chunk + 1, chunk, chunk)
        work = time_model.pass_work(shape, streams, batch, chunk, model.dtype.itemsize, boundary=False)
        work.launches = time_model.OP_COUNTS["plain"].launches(shape.n_layers, False)
    else:
        params = {"lag": budget // 32} if name == "rmm" else params
        policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
        engine = StreamingEngine(model, policy, batch=batch)
        engine.self_check(docs[0])  # the documents' probe: not run again in the measured passes

        def stream(rows: torch.Tensor) -> None:
            for _ in engine.stream_many(StreamRequest(row, copy.copy(policy)) for row in rows):
                pass

        streams = time_model.stream_shape(engine.plan.recording, n_tokens, policy.budget)
        work = time_model.pass_work(shape, streams, batch, chunk, model.dtype.itemsize, boundary=True)
    stream(docs[:, : 2 * chunk + 1])  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    watch, profiler, counter = Stopwatch(), torch.profiler.profile(activities=activities), OpCounter()
    with pass_windows(model, device, budget // chunk + 2, passes, [watch, profiler, counter]):
        stream(docs)
    recorded = device_work(profiler, device)
    ops = sum(counter.ops.values()) / passes
    ops_less_views = ops - sum(counter.views.values()) / passes
    if device.type == "cuda":
        launches = sum(not n.startswith(COPY_NAMES) for n, _ in recorded) / passes
        launches_are = "CUDA kernels (torch.profiler, CUDA activity; copies apart)"
        busy_is = "the CUDA kernels' and copies' durations"
    else:
        launches, launches_are = ops_less_views, "dispatched ops less views (CPU: no kernel launches)"
        busy_is = "the ops' self CPU time under the profiler (no device)"
    wall = watch.seconds / passes
    busy = sum(seconds for _, seconds in recorded) / passes
    idle = max(wall - busy, 0.0)
    label = name + (f" ({', '.join(f'{k} {v}' for k, v in params.items())})" if params else "")
    row: dict[str, Any] = {"run": label, "batch": batch}
    row |= {"budget": budget, "chunk": chunk, "passes": passes, "wall_s_per_pass": wall}
    row |= {"launches_per_pass": launches, "launches_are": launches_are, "ops_per_pass": ops}
    row |= {"ops_less_views_per_pass": ops_less_views, "busy_s_per_pass": busy, "busy_is": busy_is}
    row |= {"busy_fraction": busy / wall, "idle_s_per_launch": idle / launches if launches else None}
    row |= {"idle_s_per_op": idle / ops, **kernel_names(recorded, passes)}
    row["model"] = {"flops": work.flops, "bytes": work.bytes, "launches": work.launches}
    row["achieved_flops_per_s"] = work.flops / busy if busy else None
    row["achieved_bytes_per_s"] = work.bytes / busy if busy else None
    return row


def calibration(rows: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The time model's constants (checks/plan.py --gpu reads them from the check's JSON): F and W the
    highest FLOP/s and bytes/s of the model's counts per busy second over the rows (lower bounds: every
    row's busy time is at least the model's), o the median idle time per dispatched op, (wall - busy) /
    ops; each row's predicted wall time per pass under them (``model_wall_s_per_pass``)."""
    rows = [row for row in rows if "error" not in row]
    measured = [row for row in rows if row["busy_s_per_pass"] and row["launches_per_pass"]]
    if not measured:
        return {"error": "no row measured a busy time and launches: nothing to calibrate"}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    base = next((key for key in time_model.GPUS if key in name.lower()), None)
    hardware = Hardware(
        name=f"{name} (checks/gpu_check.py)",
        flops=max(row["achieved_flops_per_s"] for row in measured),
        bytes_per_s=max(row["achieved_bytes_per_s"] for row in measured),
        launch_s=float(np.median([row["idle_s_per_op"] for row in measured])),
        memory_bytes=torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        note=(
            f"measured by checks/gpu_check.py (kernels, {len(measured)} runs): F and W the highest FLOP/s "
            "and bytes/s of the time model's counts per busy second (lower bounds), o the median idle "
            "time per dispatched op"
            + ("" if device.type == "cuda" else "; on the CPU busy is the ops' own time: a smoke test")
        ),
    )
    for row in rows:
        counted = time_model.Work(row["model"]["flops"], row["model"]["bytes"], row["model"]["launches"], 1)
        row["model_wall_s_per_pass"] = time_model.seconds([counted], hardware)
    block = asdict(hardware) | {
        "launch_s_per_kernel": float(np.median([row["idle_s_per_launch"] for row in measured])),
        "launch_s_range": [
            min(row["idle_s_per_op"] for row in measured),
            max(row["idle_s_per_op"] for row in measured),
        ],
        "base": base,
    }
    if base is not None:  # the utilisations the time model assumes for this GPU, measured
        assumed = time_model.GPUS[base]
        block["matmul_utilisation"] = hardware.flops / assumed.flops * time_model.MATMUL_UTILISATION
        block["bandwidth_utilisation"] = (
            hardware.bytes_per_s / assumed.bytes_per_s * time_model.BANDWIDTH_UTILISATION
        )
    return block


def kernels(device: torch.device, small: bool) -> dict[str, Any]:
    """Kernels per pass, busy against wall time and the attention kernels of :data:`KERNEL_RUNS` at each
    batch, and the calibration block of the time model."""
    budget, chunk, batches, passes = KERNEL_SIZES[small]
    model = speed_model(device, small)
    n_tokens = chunk * (budget // chunk + 2 + 3 * (passes + 1))  # the windows' passes, the memory full
    generator = torch.Generator().manual_seed(2)
    docs = torch.randint(model.config.vocab_size, (max(batches), n_tokens), generator=generator).to(device)
    rows = []
    for batch, (name, params) in itertools.product(batches, KERNEL_RUNS):
        start = time.perf_counter()
        try:
            row = kernel_run(model, device, name, params, docs[:batch], small)
        except Exception as err:  # a run that fails (out of memory, say) leaves the others measured
            row = {"run": name, "batch": batch, "error": f"{type(err).__name__}: {err}"}
        rows.append(row | {"elapsed_s": time.perf_counter() - start})
        progress(f"kernels: {row['run']} at batch {batch}: {rows[-1]['elapsed_s']:.1f} s")
    return {"tokens_per_doc": n_tokens, "runs": rows, "calibration": calibration(rows, device)}


# ---- driver ----------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        # rmm/reference.py passes its cache as `cache=`; older transformers name it `past_key_values`
        "forward_cache_keyword": cache_keyword(tiny_model("llama")),
    }


def progress(line: str) -> None:
    """A line on stderr while the check runs."""
    print(f"[gpu_check] {line}", file=sys.stderr, flush=True)


SECTIONS = ("kernels", "points", "matrix", "speed")  # the order they run in: a run cut short keeps the first
# the sweep whose estimate the calibration feeds (docs/gpu.md, "PG-19 on Llama-3-8B: the estimate")
PG19_SWEEP = (
    "model=llama3_8b dataset=pg19 dataset.n_docs=100 dataset.max_tokens=90600 chunk=64 lag=32 "
    "oracle.context=8192 policy=full,window,streaming_llm,h2o,rmm,tova,random,oracle "
    "budget=512,1024,2048,4096"
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes: the whole check in seconds")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}"
    )
    parser.add_argument("--chunk", type=int, default=64, help="the engine's C in the speed section (64)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu" / "gpu_check.json")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here: run with --device cpu (add --small for a quick check)")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := set(sections) - set(SECTIONS):
        raise SystemExit(f"unknown sections {sorted(unknown)}: use {', '.join(SECTIONS)}")
    started = time.perf_counter()
    summary: dict[str, Any] = {"environment": environment(device), "small": args.small, "sections": {}}
    for section in sections:
        start = time.perf_counter()
        progress(f"{section} ...")
        try:
            if section == "kernels":
                result = kernels(device, args.small)
            elif section == "matrix":
                n_tokens = SMALL_MATRIX_TOKENS if args.small else MATRIX_TOKENS
                cases = matrix_cases(["llama"] if args.small else list(ARCHITECTURES), not args.small)
                frame = reference_matrix(device, [torch.float32, torch.bfloat16], cases, n_tokens)
                result = summarize_matrix(frame)
            elif section == "speed":
                result = speed(device, args.small, args.chunk)
            else:
                result = speed_points(device, args.small)
        except Exception as err:  # keep the other sections' results: the GPU window is short
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        result["wall_s"] = time.perf_counter() - start
        summary["sections"][section] = result
        summary["wall_s"] = time.perf_counter() - started
        atomic_write_text(args.out, json.dumps(summary, indent=2) + "\n")
        progress(f"{section}: {result['wall_s']:.1f} s ({summary['wall_s']:.1f} s since the start)")
    print(json.dumps(summary, indent=2))
    if "kernels" in sections:
        print(
            "\nThe time model's constants, measured (checks/plan.py --time --gpu reads them from the JSON):"
        )
        print(json.dumps(summary["sections"]["kernels"].get("calibration"), indent=2))
        print(f"python checks/plan.py {PG19_SWEEP} --time --gpu {args.out}")
    return summary


if __name__ == "__main__":
    main()
