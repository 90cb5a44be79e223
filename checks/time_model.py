"""The time model: expected wall time of a run from FLOPs, bytes moved and the host cost of its ops.

One forward pass of N streams' chunks of Q tokens each (every stream attending S = R + Q slots) costs

    t_pass = max(FLOPs / F, bytes / W) + launches * o

with F the effective FLOP/s, W the effective bytes/s and o the host cost of one dispatched op (Python,
the dispatcher and a kernel launch on a GPU). Counted per pass (formulas in docs/gpu.md, "Time model"):

- FLOPs: 2 * P * N * Q for the matrix products (P: the layers' projection and MLP weights plus the LM
  head, hidden * vocab), 4 * L * n_heads * head_dim * Q * S per stream for attention (scores and the
  weighted sum over all S slots: the engine masks, it does not skip); a policy that needs the gradient
  utility adds a backward pass to the attention outputs (:data:`BACKWARD_FLOPS_FACTOR`);
- bytes: the weights read once, every stream's keys and values (L * H * S * head_dim * 2 * dtype bytes)
  and masks read, the recorded-attention path's fp32 scores (:data:`EAGER_BYTES_PER_SCORE`), the
  activations written and read once per layer, the logits written (dtype, fp32 copy, log-softmax), and
  at every boundary the compaction's read and write of every slot;
- launches: the ops one pass dispatches, a + b * L for its policy's family plus the decision's at a
  boundary and a few per stream beyond the first (:data:`OP_COUNTS`): one memory holds the whole batch,
  attends once per layer and decides once per pass; only each stream's own scoring repeats.

A document of n tokens streams in the engine's schedule (:func:`schedule`); N documents of equal length
share every pass, so a run of D documents is ceil(D / N) waves. The oracle (and the estimator
diagnostic) add a reference pass per document (unbatched unless the caller says otherwise): a recording
window over ``context`` positions in 256-token passes (:mod:`rmm.lookahead`).

The constants (F, W, o) of a named GPU are its datasheet peaks times stated utilisations and an assumed
cost per launch (:data:`GPUS`; assumptions, not measurements); a CPU's are fitted to measured runs
(:func:`fit`). This module needs no Hydra and no torch: :func:`stream_shape` describes a run's documents
from its recording plan (``checks/plan.py`` for a configured run, ``checks/gpu_check.py`` for an engine).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rmm.recording import RecordingPlan

F32, I64 = 4, 8

# ---- assumptions (not measurements) -----------------------------------------------------------------
# Fraction of the datasheet's dense bf16 peak that the model's matrix products and the attention reach
# in PyTorch eager at these shapes (a few hundred to a few thousand rows times 4096): an assumption.
MATMUL_UTILISATION = 0.5
# Fraction of the datasheet's HBM bandwidth that streaming reads and writes reach: an assumption.
BANDWIDTH_UTILISATION = 0.7
# Host cost of one dispatched op on a GPU in PyTorch eager (Python, the dispatcher, the kernel launch):
# an assumption for an H200 until checks/gpu_check.py's `points` recalibrate it, stated with its range,
# half and twice (LAUNCH_RANGE), which checks/plan.py --time prints beside the estimate.
LAUNCH_S = 5e-6
LAUNCH_RANGE = (0.5, 2.0)
# Bytes moved per attention score [n_heads, Q, S] on the recorded-attention (eager) path: the dtype
# logits written (2) and cast to fp32 (2 + 4), scaled (4 + 4), masked (4 + 4), softmax (4 + 4), the GQA
# group sum read (4), probabilities cast back (4 + 2) and read by the weighted sum (2); counted in
# bf16 terms whatever the dtype (an estimate).
EAGER_BYTES_PER_SCORE = 44
# ... and per recorded score [H, Q, S] (GQA summed): the sum written, copied into the memory (4 + 4),
# and read once by the policy's observation (4).
RECORDED_BYTES_PER_SCORE = 16
# Bytes per slot of the boundary's ranking: sort keys, argsort indices, ranks (int64, read and written).
INDEX_BYTES_PER_SLOT = 48
# A backward pass to the attention outputs (activation gradients only, no weight gradients) costs about
# one more forward pass of FLOPs and of weight reads.
BACKWARD_FLOPS_FACTOR = 1.0


@dataclass(frozen=True)
class OpCount:
    """Ops one forward pass of N streams dispatches: ``fixed + per_layer * L``, plus ``boundary`` (scoring,
    decision, compaction) when a decision follows the pass, plus ``per_stream`` for each stream beyond the
    first (each policy scores its own stream; everything else runs once for the batch)."""

    fixed: float
    per_layer: float
    boundary: float = 0.0
    per_stream: float = 0.0

    def launches(self, n_layers: int, boundary: bool, rows: int = 1) -> float:
        extra = self.per_stream * (rows - 1)
        return self.fixed + self.per_layer * n_layers + (self.boundary if boundary else 0.0) + extra


# Ops per forward pass by policy family, from checks/op_count.py's counter (every dispatched op, views
# included) on Llama-3-8B's structure at B=256, C=64: a + b L counted at 2 and 4 layers on one stream
# (32 layers give 2,762 for plain and 3,877 for observed), per_stream from the batched memory at 32 layers
# (results/bench/op_count.md: h2o 3,917 and 4,093 at batch 8 and 16, rmm 3,968 and 4,184, window 3,070
# and 3,118; at batch 1 h2o 3,735 and rmm 3,751, within 4 % below the observed row's 3,877). The reference
# pass and random were not counted by the batch: they take the rows of their families.
OP_COUNTS: dict[str, OpCount] = {
    "plain": OpCount(fixed=42, per_layer=85),  # the model's own forward with a KV cache
    "position": OpCount(fixed=106, per_layer=94, boundary=27, per_stream=6),  # full, window, streaming_llm
    "recorded_position": OpCount(fixed=112, per_layer=115, boundary=27, per_stream=6),  # the reference pass
    "score": OpCount(fixed=95, per_layer=94, boundary=108, per_stream=27),  # no attention recorded: random
    "observed": OpCount(fixed=108, per_layer=115, boundary=89, per_stream=27),  # attention recorded: rmm, h2o
}


@dataclass(frozen=True)
class Hardware:
    """Effective constants of a device: ``flops`` (FLOP/s) and ``bytes_per_s`` reached, and the host cost
    ``launch_s`` of one dispatched op; ``memory_bytes`` when known."""

    name: str
    flops: float
    bytes_per_s: float
    launch_s: float
    memory_bytes: int | None = None
    note: str = ""

    def as_vector(self) -> np.ndarray:
        return np.array([self.flops, self.bytes_per_s, self.launch_s])


def gpu(name: str, peak_flops: float, peak_bytes_per_s: float, memory_gb: float) -> Hardware:
    return Hardware(
        name=name,
        flops=peak_flops * MATMUL_UTILISATION,
        bytes_per_s=peak_bytes_per_s * BANDWIDTH_UTILISATION,
        launch_s=LAUNCH_S,
        memory_bytes=int(memory_gb * 1e9),
        note=(
            f"datasheet {peak_flops / 1e12:g} TFLOP/s bf16 dense x {MATMUL_UTILISATION}, "
            f"{peak_bytes_per_s / 1e12:g} TB/s x {BANDWIDTH_UTILISATION}, "
            f"{LAUNCH_S * 1e6:g} us per dispatched op (assumptions, not measurements)"
        ),
    )


# datasheet peaks: dense bf16 FLOP/s (no sparsity), HBM bandwidth, memory
GPUS = {
    "h200": gpu("H200", 989e12, 4.8e12, 141),
    "h100": gpu("H100 SXM", 989e12, 3.35e12, 80),
    "a100": gpu("A100 80GB", 312e12, 2.0e12, 80),
}


# ---- what a run streams -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The dimensions the time model reads from a model config's ``architecture`` node."""

    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_architecture(cls, arch: Mapping) -> ModelShape:
        heads = arch["num_attention_heads"]
        return cls(
            n_layers=arch["num_hidden_layers"],
            hidden=arch["hidden_size"],
            intermediate=arch["intermediate_size"],
            n_heads=heads,
            n_kv_heads=arch.get("num_key_value_heads") or heads,
            head_dim=arch.get("head_dim") or arch["hidden_size"] // heads,
            vocab=arch["vocab_size"],
        )

    @property
    def qkv(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def matmul_params(self) -> int:
        """Weights of the matrix products per token: q/k/v/o projections and a gated MLP (three
        matrices) in every layer, and the LM head (hidden * vocab)."""
        per_layer = self.hidden * self.qkv + self.n_heads * self.head_dim * self.hidden
        per_layer += 3 * self.hidden * self.intermediate
        return self.n_layers * per_layer + self.hidden * self.vocab


@dataclass(frozen=True)
class StreamShape:
    """How one document streams (from the run's :class:`~rmm.recording.RecordingPlan`).

    n_tokens : the document's length n.
    retained : R, slots kept across boundaries (the slots attended are S = R + Q).
    first, step : tokens in the first forward pass and in every later one (:func:`schedule`).
    records_attention : the eager path that computes and keeps fp32 attention scores.
    per_head_masks : masks per layer and KV head (score-based policies); one shared mask otherwise.
    n_state : the policy's fp32 statistics per slot; raw_keys : a second key copy per slot.
    gradient : a backward pass per chunk (rmm's ``weight=gradient``).
    causal : plain forward passes (no memory): each query attends its causal prefix of the pass (SDPA
        with ``is_causal`` skips the masked half), no boundary, no per-stream attention code.
    """

    n_tokens: int
    retained: int
    first: int
    step: int
    records_attention: bool = False
    per_head_masks: bool = False
    n_state: int = 0
    raw_keys: bool = False
    gradient: bool = False
    causal: bool = False

    @property
    def family(self) -> str:
        """Its row of :data:`OP_COUNTS`."""
        if self.causal:
            return "plain"
        if not self.per_head_masks:  # a position rule
            return "recorded_position" if self.records_attention else "position"
        return "observed" if self.records_attention else "score"


def schedule_first(budget: int | None, step: int) -> int:
    """Tokens in a stream's first forward pass (:meth:`rmm.engine.StreamingEngine.chunks`): at most B."""
    return step if budget is None else min(step, budget)


def stream_shape(recording: RecordingPlan, n_tokens: int, budget: int | None) -> StreamShape:
    """How one ``n_tokens`` document streams under ``recording`` (budget B of the policy)."""
    retained, _ = recording.slots(n_tokens)
    return StreamShape(
        n_tokens=n_tokens,
        retained=retained,
        first=schedule_first(budget, recording.chunk),
        step=recording.chunk,
        records_attention=recording.record_attention,
        per_head_masks=recording.rule is None,
        n_state=len(recording.state_names),
        raw_keys=recording.raw_keys,
        gradient=recording.track_gradient,
    )


def schedule(n_tokens: int, first: int, step: int) -> list[int]:
    """Tokens of every forward pass of an ``n_tokens`` stream (:meth:`rmm.engine.StreamingEngine.chunks`:
    a first pass of ``first`` tokens, then ``step`` tokens each)."""
    if first >= n_tokens:
        return [n_tokens]
    rest = n_tokens - first
    return [first] + [step] * (rest // step) + ([rest % step] if rest % step else [])


@dataclass
class Work:
    """FLOPs, bytes and dispatched ops of some forward passes, and their count."""

    flops: float = 0.0
    bytes: float = 0.0
    launches: float = 0.0
    passes: int = 0

    def times(self, k: int) -> Work:
        """The work of ``k`` such passes."""
        return Work(self.flops * k, self.bytes * k, self.launches * k, self.passes * k)


def pass_work(
    model: ModelShape, stream: StreamShape, rows: int, queries: int, element: int, boundary: bool
) -> Work:
    """The work of one forward pass of ``rows`` streams' chunks of ``queries`` tokens (``element``: the
    dtype's bytes), with the boundary after it when ``boundary``."""
    m, tokens = model, rows * queries
    slots = queries if stream.causal else stream.retained + queries
    layers_heads = m.n_layers * m.n_kv_heads
    attention_flops = 4 * m.n_layers * m.n_heads * m.head_dim * queries * slots * rows
    if stream.causal:
        attention_flops /= 2
    flops = 2 * m.matmul_params * tokens + attention_flops
    weights = m.matmul_params * element
    per_layer_activations = (4 * m.hidden + m.qkv + 3 * m.intermediate) * element
    moved = (
        weights
        + 2 * tokens * m.n_layers * per_layer_activations  # written once, read once
        # the logits, their fp32 copy (none in fp32: the engine's .float() is then no copy), the log-softmax
        + tokens * m.vocab * (element + (F32 if element != F32 else 0) + F32)
    )
    if not stream.causal:
        moved += rows * layers_heads * slots * m.head_dim * 2 * element  # keys and values read
        mask_copies = layers_heads if stream.per_head_masks else m.n_layers  # a shared mask read per layer
        moved += rows * mask_copies * queries * slots
        if stream.records_attention:
            scores = rows * m.n_layers * queries * slots
            moved += scores * (m.n_heads * EAGER_BYTES_PER_SCORE + m.n_kv_heads * RECORDED_BYTES_PER_SCORE)
    launches = OP_COUNTS[stream.family].launches(m.n_layers, boundary and not stream.causal, rows)
    if stream.gradient:
        flops *= 1 + BACKWARD_FLOPS_FACTOR
        moved += weights * BACKWARD_FLOPS_FACTOR
    if boundary and not stream.causal:
        key_bytes = 2 * m.head_dim * element * (1.5 if stream.raw_keys else 1.0)  # K, V (+ raw K) per slot
        per_slot = 2 * (key_bytes + I64 + F32 * stream.n_state) + INDEX_BYTES_PER_SLOT
        moved += rows * layers_heads * slots * per_slot
    return Work(flops, moved, launches, 1)


def stream_work(model: ModelShape, stream: StreamShape, rows: int, element: int) -> list[Work]:
    """The work of streaming ``rows`` documents side by side, pass by pass (grouped by pass length)."""
    lengths = schedule(stream.n_tokens, stream.first, stream.step)
    out = []
    for queries, count in Counter(lengths[:-1]).items():
        out.append(pass_work(model, stream, rows, queries, element, boundary=True).times(count))
    out.append(pass_work(model, stream, rows, lengths[-1], element, boundary=False))
    return out


def seconds(works: Sequence[Work], hardware: Hardware) -> float:
    """Wall time of ``works`` on ``hardware``: per group of equal passes, max(FLOPs / F, bytes / W) plus
    the launches times o."""
    total = 0.0
    for work in works:
        total += max(work.flops / hardware.flops, work.bytes / hardware.bytes_per_s)
        total += work.launches * hardware.launch_s
    return total


@dataclass
class RunTime:
    """Predicted wall time of one run: its documents' passes and the reference passes."""

    n_docs: int
    tokens_per_doc: int
    batch: int
    passes: int  # the streams' forward passes
    reference_passes: int
    stream_s: float
    reference_s: float
    shares: dict[str, float]  # of the stream's time: compute-bound, bandwidth-bound, host overhead
    hardware: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.stream_s + self.reference_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second (infinite for a run whose work another run of its sweep did)."""
        return self.n_docs * self.tokens_per_doc / self.wall_s if self.wall_s else math.inf

    def as_dict(self) -> dict:
        return asdict(self) | {"wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s}


def run_works(
    model: ModelShape,
    stream: StreamShape,
    n_docs: int,
    batch: int,
    element: int,
    reference: StreamShape | None = None,
    reference_batch: int = 1,
) -> tuple[list[Work], list[Work]]:
    """(the stream's works, the reference passes' works) of ``n_docs`` documents, ``batch`` per pass
    (the reference passes ``reference_batch`` per pass)."""

    def waves(shape: StreamShape, rows: int) -> list[Work]:
        full_waves, rest = divmod(n_docs, rows)
        works = (
            [work.times(full_waves) for work in stream_work(model, shape, rows, element)]
            if full_waves
            else []
        )
        return works + (stream_work(model, shape, rest, element) if rest else [])

    return waves(stream, batch), [] if reference is None else waves(reference, reference_batch)


def run_time(
    works: Sequence[Work],
    reference_works: Sequence[Work],
    n_docs: int,
    tokens_per_doc: int,
    batch: int,
    hardware: Hardware,
) -> RunTime:
    """The predicted wall time of a run (:func:`run_works`) on ``hardware``."""
    stream_s = seconds(works, hardware)
    shares = {"compute": 0.0, "bandwidth": 0.0, "overhead": 0.0}
    for w in works:
        compute, memory = w.flops / hardware.flops, w.bytes / hardware.bytes_per_s
        shares["compute" if compute >= memory else "bandwidth"] += max(compute, memory)
        shares["overhead"] += w.launches * hardware.launch_s
    return RunTime(
        n_docs=n_docs,
        tokens_per_doc=tokens_per_doc,
        batch=batch,
        passes=sum(w.passes for w in works),
        reference_passes=sum(w.passes for w in reference_works),
        stream_s=stream_s,
        reference_s=seconds(reference_works, hardware),
        shares={key: value / stream_s if stream_s else 0.0 for key, value in shares.items()},
        hardware=hardware.name,
    )


def totals(works: Sequence[Work]) -> np.ndarray:
    """[(flops, bytes, launches)] per group, for the fit."""
    return np.array([[w.flops, w.bytes, w.launches] for w in works], dtype=float)


# ---- calibration ------------------------------------------------------------------------------------
def predict(groups: np.ndarray, constants: np.ndarray) -> float:
    """Wall time of work groups [k, 3] (flops, bytes, launches) under constants (F, W, o)."""
    flops, moved, launches = groups.T
    return float(np.sum(np.maximum(flops / constants[0], moved / constants[1]) + launches * constants[2]))


@dataclass
class Fit:
    """Constants fitted to measured wall times, in log time (least squares on log(pred / measured))."""

    constants: np.ndarray  # F, W, o
    predicted_s: np.ndarray
    measured_s: np.ndarray
    identified: dict[str, bool]  # whether each constant is pinned by some point (its term binds)

    @property
    def ratios(self) -> np.ndarray:
        return self.predicted_s / self.measured_s

    @property
    def max_relative_error(self) -> float:
        return float(np.max(np.abs(self.ratios - 1)))

    def hardware(self, name: str) -> Hardware:
        flops, moved, overhead = (float(x) for x in self.constants)
        unpinned = [key for key, ok in self.identified.items() if not ok]
        note = f"fitted to {len(self.measured_s)} measured runs"
        note += f"; largest relative error {self.max_relative_error:.1%}"
        if unpinned:
            note += f"; not identified by these points: {', '.join(unpinned)}"
        return Hardware(name, flops, moved, overhead, note=note)


CONSTANT_NAMES = ("flops", "bytes_per_s", "launch_s")


def fit(point_groups: Sequence[np.ndarray], measured_s: Sequence[float]) -> Fit:
    """Fit (F, W, o) to measured wall times: ``point_groups[i]`` is run i's work groups [k, 3].

    Minimises sum_i log(predicted_i / measured_i)^2 over log F, log W, log o from a grid of starts (the
    max() makes the objective piecewise smooth). A constant is reported as not identified when no point
    depends on it at the optimum (no point is compute-bound, bandwidth-bound, or the overhead is under
    0.1 % of every point's time)."""
    from scipy.optimize import least_squares

    measured = np.asarray(measured_s, dtype=float)
    if len(measured) < 3:
        raise ValueError(f"the fit needs at least 3 measured runs for 3 constants, got {len(measured)}")
    log_measured = np.log(measured)

    def residuals(x: np.ndarray) -> np.ndarray:
        constants = np.exp(x)
        return np.array([math.log(predict(g, constants)) for g in point_groups]) - log_measured

    best = None
    for flops in (1e9, 1e11, 1e13, 1e15):
        for moved in (1e9, 1e11, 1e13):
            for overhead in (1e-8, 1e-6, 1e-4):
                x0 = np.log([flops, moved, overhead])
                result = least_squares(residuals, x0, method="trf", x_scale=1.0, xtol=1e-12, ftol=1e-12)
                if best is None or result.cost < best.cost:
                    best = result
    assert best is not None
    constants = np.exp(best.x)
    predicted = np.array([predict(g, constants) for g in point_groups])
    identified = {name: False for name in CONSTANT_NAMES}
    for groups, total in zip(point_groups, predicted, strict=True):
        flops, moved, launches = groups.T
        compute, memory = flops / constants[0], moved / constants[1]
        identified["flops"] |= bool(np.any((compute >= memory) & (compute > 1e-3 * total)))
        identified["bytes_per_s"] |= bool(np.any((memory > compute) & (memory > 1e-3 * total)))
        identified["launch_s"] |= bool(np.sum(launches) * constants[2] > 1e-3 * total)
    return Fit(constants, predicted, measured, identified)


def with_constants(hardware: Hardware, constants: Mapping[str, float]) -> Hardware:
    """``hardware`` with some of its constants replaced (e.g. those fitted on the device)."""
    return replace(hardware, **{k: float(v) for k, v in constants.items() if k in CONSTANT_NAMES})
