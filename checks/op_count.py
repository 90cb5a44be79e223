"""Dispatched ATen ops and host syncs per forward pass of the streaming engine, by phase.

    python checks/op_count.py [--out results/bench/op_count.md] [--batches 1 8 16] [--policies h2o rmm window]

A GPU runs one kernel per dispatched op (near enough) and stalls the host at every host sync, so these
counts are what a pass costs on a device beyond its arithmetic. They are counted on the CPU, on a tiny
random fp32 model with Llama-3-8B's structure (``conf/model/llama3_1_8b.yaml``: 32 layers, 32 query
heads, 8 KV heads, its rope scaling; hidden size 256, head_dim 8), and do not depend on the machine or
its load. Rows: the model's own forward (SDPA) of the same [N, C] tokens per pass with a KV cache cut
to the last B - C + 1 entries after every pass (:func:`checks.yardsticks.equal_work`, the bench's
equal-work yardstick: every query attends at most B keys besides its own, as in the engine), then
:class:`~rmm.engine.StreamingEngine` under each policy, N equal-length random-token streams side by
side. Position rules (window) stream in C-token passes here too (they normally take max(C, min(B, 1024))-token
passes, ``rmm.recording.RecordingPlan.chunk``), so every row's pass holds the same tokens. The explicit
attention path takes every row at once, as on a device (on a CPU it works in cache-sized row blocks).

**Per pass.** Each row is counted on streams of B + 4C and B + 8C tokens (after an uncounted warm-up);
the difference over the difference in forward passes (calls of the model) cancels set-up, the
self-check, the first and the last passes. Every stream's memory is full in the passes between.

**Ops**: every op that reaches :class:`~torch.utils._python_dispatch.TorchDispatchMode` (below
autograd: composite ops are counted as what they decompose into; views count). Of them, **views**
launch no kernel: ops whose schema returns an alias of an input (``view``, ``slice``, ``select``,
``transpose``, ``expand``, ``detach``, ...) and the metadata-only ``_unsafe_view``, ``promote_types``,
``result_type``; ops less views is the nearer count of kernel launches.

**Host syncs**: ops that make the host wait for a device value:

- ``aten._local_scalar_dense`` (``item()``, ``float()``, ``int()``, ``bool()`` of a tensor),
  ``aten.is_nonzero``, ``aten.equal``;
- ops whose output size depends on values: ``aten.nonzero``, ``aten.masked_select``, ``aten.unique*``
  (``_unique``, ``_unique2``, ``unique_dim``, ``unique_consecutive``, ``unique_dim_consecutive``),
  ``aten.repeat_interleave.Tensor`` without ``output_size``;
- ``aten.index.Tensor``, ``aten.index_put``/``index_put_``/``_index_put_impl_`` with a bool (or uint8)
  index tensor (boolean-mask indexing and assignment);
- ``aten._to_copy`` to the cpu from a tensor on another device, ``aten.copy_`` into a cpu tensor from
  another device (never on the CPU, where every tensor is on the cpu: there the op list decides);
- ``Tensor.tolist`` and ``Tensor.numpy`` (seen by a ``TorchFunctionMode``: they dispatch nothing on the
  CPU); a sync inside them is not counted twice;
- ``torch.tensor`` and ``torch.as_tensor`` of host data (not a tensor) with a ``device`` named (seen by the
  same mode): on the CPU they copy nothing, but on a GPU the copy from pageable host memory waits for
  the device's stream (``rmm.transfer.to_device`` stages such values in pinned memory instead). Host data
  made on the CPU and moved later with ``.to(device)`` is not seen on the CPU.

**Phases**: the ops of a call of a function or method named in :data:`PHASES` belong to its phase (the
innermost such call wins), everything else to ``model`` (the model's own layers and the engine's
bookkeeping outside the named calls). The table names what today's engine calls; where that moves,
retarget the table (a missing name fails, naming the table).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import inspect
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import transformers
import yaml
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, PreTrainedModel

from checks.yardsticks import equal_work
from rmm import engine, integration, recording
from rmm import memory as slot_memory
from rmm.engine import StreamingEngine, StreamRequest
from rmm.files import atomic_write_text
from rmm.memory import SlotMemory
from rmm.models import config_from_architecture
from rmm.policies import POLICIES, make_policy

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "conf" / "model" / "llama3_1_8b.yaml"
OUT = ROOT / "results" / "bench" / "op_count.md"


class _PolicyClass:
    """Marker in :data:`PHASES`: the class of the policy being counted (skipped where it lacks the name)."""


POLICY = _PolicyClass()
# (object, attribute) -> phase: the ops of a call of object.attribute belong to the phase (innermost wins).
# Module-level functions are patched where their caller looks them up (rmm.engine imports select & co.).
PHASES: dict[tuple[object, str], str] = {
    (integration, "_attend"): "attention",  # bounded_attention calls it through the module global
    (SlotMemory, "begin_chunk"): "masks",
    (SlotMemory, "enter_layer"): "masks",
    (SlotMemory, "folded_mask"): "masks",
    (POLICY, "observe"): "scoring",
    (POLICY, "score"): "scoring",
    (engine, "select"): "decision",
    (engine, "decision_margin"): "decision",
    (engine, "kept_digest"): "decision",
    (engine, "rule_keep"): "decision",
    (SlotMemory, "alive"): "decision",
    (SlotMemory, "compact"): "compaction",
}
PHASE_NAMES = ("model", "attention", "masks", "scoring", "decision", "compaction")

# Llama-3-8B's structure at a tiny width (op counts depend on the structure, not on the width)
WIDTH = {"hidden_size": 256, "head_dim": 8, "intermediate_size": 512, "vocab_size": 1024}
POLICY_PARAMS: dict[str, dict[str, Any]] = {"rmm": {"lag": 64}}  # the rest: the policy's defaults
RATIO_GOAL, SYNC_GOAL = 1.6, 1  # issue 36: ops per pass / plain forward's; host syncs beyond the model's
PLAIN = "plain forward"

_SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "equal",
        "nonzero",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
    }
)
_BOOL_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_METADATA_ONLY = frozenset(
    {"_unsafe_view", "promote_types", "result_type", "sym_size", "sym_stride", "sym_numel"}
)
_HOST_READS = {"tolist", "numpy"}  # Tensor methods seen by the function mode
_HOST_TO_DEVICE = (torch.tensor, torch.as_tensor)  # with host data and a device: a blocking copy on a GPU
_TORCH_DIR = Path(torch.__file__).resolve().parent


def is_host_sync(func: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the ATen op ``func`` called with ``args``/``kwargs`` waits for a device value (the list:
    the module docstring)."""
    if func.namespace != "aten":
        return False
    name = func.overloadpacket.__name__
    if name in _SYNC_OPS:
        return True
    if name == "repeat_interleave":
        return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None and len(args) < 3
    if name in _BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _site() -> str:
    """The innermost caller outside torch and this module: ``path:line (function)``."""
    frame = sys._getframe(2)
    here = Path(__file__).resolve()
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != here and _TORCH_DIR not in path.parents:
            if ROOT in path.parents and ".venv" not in path.parts:
                where = path.relative_to(ROOT).as_posix()
            else:
                packages = [
                    i for i, part in enumerate(path.parts) if part in ("site-packages", "dist-packages")
                ]
                where = "/".join(path.parts[packages[-1] + 1 :]) if packages else path.name
            return f"{where}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops and host syncs per phase while active (``with OpCounter() as counter``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []  # the phases of the calls in progress, innermost last
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()  # ops that launch no kernel (module docstring)
        self.syncs: Counter[str] = Counter()
        self.sites: Counter[tuple[str, str, str]] = Counter()  # (phase, op, where) -> host syncs
        self.reading = 0  # > 0 inside a host read counted by the function mode

    @property
    def phase(self) -> str:
        return self.stack[-1] if self.stack else "model"

    def sync(self, op: str) -> None:
        self.syncs[self.phase] += 1
        self.sites[self.phase, op, _site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[self.phase] += 1
        if func.is_view or func.overloadpacket.__name__ in _METADATA_ONLY:
            self.views[self.phase] += 1
        if not self.reading and is_host_sync(func, args, kwargs):
            self.sync(str(func.overloadpacket))
        return func(*args, **kwargs)


class _HostReads(TorchFunctionMode):
    """Counts ``Tensor.tolist`` and ``Tensor.numpy``, and host data handed to a device by ``torch.tensor``
    or ``torch.as_tensor`` with a ``device``, as host syncs of ``counter`` (no dispatch on the CPU)."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in _HOST_TO_DEVICE
            and kwargs.get("device") is not None
            and args
            and not isinstance(args[0], torch.Tensor)
        ):
            self.counter.sync(f"torch.{func.__name__}(device=)")
            return func(*args, **kwargs)
        if getattr(func, "__name__", None) not in _HOST_READS or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        self.counter.sync(f"Tensor.{func.__name__}")
        self.counter.reading += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.reading -= 1


def _in_phase(fn: Callable, counter: OpCounter, phase: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counter.stack.append(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            counter.stack.pop()

    return wrapper


@contextlib.contextmanager
def phases(counter: OpCounter, policy_class: type | None) -> Iterator[None]:
    """Wrap every callable of :data:`PHASES` (``POLICY``: ``policy_class``) so that its ops count in its
    phase while the context is open."""
    with contextlib.ExitStack() as stack:
        for (owner, name), phase in PHASES.items():
            target = policy_class if owner is POLICY else owner
            if owner is POLICY and (target is None or not hasattr(target, name)):
                continue  # a position rule neither observes nor scores
            try:
                raw = inspect.getattr_static(target, name)
            except AttributeError:
                what = getattr(target, "__name__", repr(target))
                raise RuntimeError(
                    f"checks/op_count.py's PHASES table names {what}.{name} ({phase}), which does not exist: "
                    "point the table at the callable that does that work now"
                ) from None
            if isinstance(raw, staticmethod | classmethod):
                wrapped = type(raw)(_in_phase(raw.__func__, counter, phase))
            else:
                wrapped = _in_phase(raw, counter, phase)
            stack.enter_context(mock.patch.object(target, name, wrapped))
        yield


@dataclass
class Tally:
    """What one run dispatched: ops, views and host syncs per phase, syncs per (phase, op, site), model
    calls."""

    ops: Counter[str]
    views: Counter[str]
    syncs: Counter[str]
    sites: Counter[tuple[str, str, str]]
    passes: int


def tally(run: Callable[[], object], model: PreTrainedModel, policy_class: type | None = None) -> Tally:
    """Count ``run()``; its forward passes are the calls of ``model``."""
    counter, calls = OpCounter(), Counter()
    handle = model.register_forward_pre_hook(lambda *_: calls.update(["pass"]))
    try:
        with phases(counter, policy_class), counter, _HostReads(counter):
            run()
    finally:
        handle.remove()
    return Tally(counter.ops, counter.views, counter.syncs, counter.sites, calls["pass"])


@dataclass
class PerPass:
    """One row: ops, views and host syncs per forward pass, per phase (``sites``: per (phase, op, site))."""

    ops: dict[str, float]
    views: dict[str, float]
    syncs: dict[str, float]
    sites: dict[tuple[str, str, str], float]

    @property
    def total_ops(self) -> float:
        return sum(self.ops.values())

    @property
    def kernels(self) -> float:
        """Ops less views: ops that launch a kernel."""
        return self.total_ops - sum(self.views.values())

    @property
    def total_syncs(self) -> float:
        return sum(self.syncs.values())


def per_pass(short: Tally, long: Tally) -> PerPass:
    """The counts of ``long`` minus those of ``short`` over the difference in passes."""
    passes = long.passes - short.passes
    if passes <= 0:
        raise RuntimeError(f"the longer streams ran {passes} more forward passes than the shorter ones")

    def diff(a: Counter, b: Counter, keys) -> dict:
        return {k: (a[k] - b[k]) / passes for k in keys}

    sites = diff(long.sites, short.sites, sorted(long.sites.keys() | short.sites.keys()))
    return PerPass(
        diff(long.ops, short.ops, PHASE_NAMES),
        diff(long.views, short.views, PHASE_NAMES),
        diff(long.syncs, short.syncs, PHASE_NAMES),
        {k: v for k, v in sites.items() if v},
    )


def op_model(layers: int | None = None) -> PreTrainedModel:
    """Llama-3-8B's structure (``layers``: fewer layers) at the tiny :data:`WIDTH`, random fp32 on the CPU."""
    arch = yaml.safe_load(ARCHITECTURE.read_text())["architecture"]
    overrides = WIDTH | ({} if layers is None else {"num_hidden_layers": layers})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_from_architecture(arch, **overrides), dtype=torch.float32)
    return model.eval().requires_grad_(False)


def streams(model: PreTrainedModel, batch: int, n_tokens: int) -> torch.Tensor:
    """``batch`` random-token streams [batch, n_tokens] (seeded)."""
    generator = torch.Generator().manual_seed(n_tokens)
    return torch.randint(model.config.vocab_size, (batch, n_tokens), generator=generator)


def stream_engine(
    model: PreTrainedModel, config: dict[str, Any], tokens: torch.Tensor, budget: int, chunk: int
) -> None:
    """Stream ``tokens`` [N, n] (N streams side by side) under the policy ``config`` (``name`` + params)."""
    policy = make_policy(config, budget=budget, chunk=chunk)
    streaming = StreamingEngine(model, policy, batch=tokens.shape[0])
    requests = [StreamRequest(row, copy.copy(policy)) for row in tokens]
    for _ in streaming.stream_many(requests):
        pass


@contextlib.contextmanager
def position_rule_passes(chunk: int) -> Iterator[None]:
    """Position rules stream in ``chunk``-token passes, as score-based policies do."""
    if not hasattr(recording, "POSITION_RULE_CHUNK"):
        raise RuntimeError(
            "checks/op_count.py patches rmm.recording.POSITION_RULE_CHUNK, which does not exist"
        )
    with mock.patch.object(recording, "POSITION_RULE_CHUNK", chunk):
        yield


@contextlib.contextmanager
def device_row_blocks() -> Iterator[None]:
    """The explicit attention path over every row at once and compaction over every layer at once, as off
    the CPU (on a CPU they split the batch into cache-sized row blocks, ``rmm.integration.row_blocks``, and
    the layers into blocks the allocator reuses, ``rmm.memory.move_slots``, which a device does not)."""
    for module, name in ((integration, "CPU_BLOCK_BYTES"), (slot_memory, "CPU_MOVE_BYTES")):
        if not hasattr(module, name):
            raise RuntimeError(f"checks/op_count.py patches {module.__name__}.{name}, which does not exist")
    with (
        mock.patch.object(integration, "CPU_BLOCK_BYTES", 2**62),
        mock.patch.object(slot_memory, "CPU_MOVE_BYTES", 2**62),
    ):
        yield


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one CPU thread (the counts do not depend on threads; tiny kernels on a shared machine do
    not gain from more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def count(
    model: PreTrainedModel,
    policy: str | None,
    batch: int,
    budget: int,
    chunk: int,
    params: dict | None = None,
) -> PerPass:
    """Ops and host syncs per pass of ``policy`` (None: the plain forward) at ``batch`` streams per pass."""
    lengths = {"warm-up": budget + 2 * chunk, "short": budget + 4 * chunk, "long": budget + 8 * chunk}
    tokens = {key: streams(model, batch, n) for key, n in lengths.items()}
    if policy is None:
        run, policy_class = functools.partial(equal_work, model, budget=budget, chunk=chunk), None
    else:
        config = {"name": policy, **POLICY_PARAMS.get(policy, {}), **(params or {})}
        policy_class = type(make_policy(config, budget=budget, chunk=chunk))
        run = functools.partial(stream_engine, model, config, budget=budget, chunk=chunk)
    with position_rule_passes(chunk), device_row_blocks(), one_thread():
        run(tokens["warm-up"])  # one-time caches fill here, not in a counted run
        short, long = (
            tally(functools.partial(run, tokens[key]), model, policy_class) for key in ("short", "long")
        )
    return per_pass(short, long)


def _number(x: float) -> str:
    return f"{x:,.0f}" if x == round(x) else f"{x:,.2f}"


def _syncs(row: PerPass) -> str:
    parts = [f"{phase} {_number(row.syncs[phase])}" for phase in PHASE_NAMES if row.syncs[phase]]
    return _number(row.total_syncs) + (f" ({', '.join(parts)})" if parts else "")


def table(
    rows: dict[tuple[str, int], PerPass], model: PreTrainedModel, budget: int, chunk: int, command: str
) -> str:
    """The markdown report of ``rows`` {(run, batch): counts per pass}."""
    cfg = model.config
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    shape = (
        f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} "
        f"KV heads, llama3 rope scaling; hidden {cfg.hidden_size}, head_dim {cfg.head_dim}, MLP "
        f"{cfg.intermediate_size}, vocab {cfg.vocab_size}"
    )
    lines = [
        "# Dispatched ops and host syncs per forward pass",
        "",
        f"`{command}` ({versions}; deterministic: the counts depend on the code and these versions, not on "
        "the machine or its load).",
        "",
        f"Model: Llama-3-8B's structure at a tiny width ({shape}), random fp32 on the CPU. B={budget}, "
        f"C={chunk}: every pass holds C tokens of each of N random-token streams (window too). Per pass: "
        f"streams of {budget + 8 * chunk} tokens minus streams of {budget + 4 * chunk}, over the 4 passes "
        f"between. {PLAIN}: the model's own forward (SDPA) of the same [N, C] tokens, its KV cache cut to "
        "the last B - C + 1 entries after every pass (checks/yardsticks.py's equal_work). Phases, ops and "
        "host syncs: checks/op_count.py's docstring (model: everything outside the other "
        "phases, the engine's bookkeeping included).",
        "",
        f"Goals (issue 36, h2o and rmm at batch 8 and 16): ops per pass <= {RATIO_GOAL}x the {PLAIN}'s, "
        f"and at most {SYNC_GOAL} host sync per pass beyond the {PLAIN}'s.",
        "",
        "| run | batch | ops/pass | "
        + " | ".join(PHASE_NAMES)
        + f" | ops less views | x {PLAIN} | x, less views | host syncs/pass (by phase) "
        "| syncs beyond plain | goals |",
        "|---|---:|---:|" + "---:|" * len(PHASE_NAMES) + "---:|---:|---:|---|---:|---|",
    ]
    for (run, batch), row in rows.items():
        plain = rows.get((PLAIN, batch))
        ratio = row.total_ops / plain.total_ops if plain else None
        beyond = row.total_syncs - plain.total_syncs if plain else None
        goals = "—"
        if run != PLAIN and plain:
            goals = "met" if ratio <= RATIO_GOAL and beyond <= SYNC_GOAL else "not met"
        cells = [run, str(batch), _number(row.total_ops), *(_number(row.ops[p]) for p in PHASE_NAMES)]
        cells += [
            _number(row.kernels),
            "—" if ratio is None else f"{ratio:.2f}x",
            "—" if plain is None else f"{row.kernels / plain.kernels:.2f}x",
            _syncs(row),
            "—" if beyond is None or run == PLAIN else _number(beyond),
            goals,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    sites = [
        f"| {run} | {batch} | {phase} | `{op}` | `{where}` | {_number(n)} |"
        for (run, batch), row in rows.items()
        for (phase, op, where), n in row.sites.items()
    ]
    lines += ["", "## Host syncs per pass, by site", ""]
    if sites:
        lines += ["| run | batch | phase | op | where | per pass |", "|---|---:|---|---|---|---:|", *sites]
    else:
        lines.append("None: no pass of any run above waits for the device.")
    return "\n".join(lines) + "\n"


def label(policy: str) -> str:
    params = POLICY_PARAMS.get(policy, {})
    return policy + (f" ({', '.join(f'{k} {v}' for k, v in params.items())})" if params else "")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help="the markdown table (results/bench/op_count.md)"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16], help="streams per pass")
    parser.add_argument("--policies", nargs="+", default=["h2o", "rmm", "window"], choices=sorted(POLICIES))
    parser.add_argument("--budget", type=int, default=256, help="B (256)")
    parser.add_argument("--chunk", type=int, default=64, help="C (64)")
    args = parser.parse_args(argv)
    model = op_model()
    rows: dict[tuple[str, int], PerPass] = {}
    for batch in args.batches:
        rows[PLAIN, batch] = count(model, None, batch, args.budget, args.chunk)
        for policy in args.policies:
            rows[label(policy), batch] = count(model, policy, batch, args.budget, args.chunk)
            print(f"counted {label(policy)} at batch {batch}", file=sys.stderr)
    command = "python checks/op_count.py " + " ".join(
        ["--batches", *map(str, args.batches), "--policies", *args.policies]
        + (
            []
            if (args.budget, args.chunk) == (256, 64)
            else ["--budget", str(args.budget), "--chunk", str(args.chunk)]
        )
    )
    text = table(rows, model, args.budget, args.chunk, command)
    atomic_write_text(args.out, text)
    print(text)
    return text


if __name__ == "__main__":
    main()
