"""The run's self-check: before the first scored token the engine checks itself on the model it was given.

A probe, the first tokens of the longest stream to come, goes through these checks:

1. **Rotation** (only where the stream moves keys or queries to other positions: ``positions=cache``, a
   policy that reads keys or queries, attention sinks re-rotated to their rank): one pass of the
   probe's first :data:`ROTATION_TOKENS` tokens at positions p and one at p + :data:`ROTATION_SHIFT`
   (same masks, unlimited memory); in every attention layer the keys (and queries, where the stream
   moves them) of the second pass must be :class:`~rmm.rotary.Rotary`'s rotation of the first's.
   :meth:`~rmm.rotary.Rotary.calibrate` picks each layer's rotation from the model's own candidates
   (per-layer-type frequencies, either pairing, none for NoPE layers) and refuses a layer none reproduces,
   naming an earlier layer whose queries change with their absolute position where there is one. Under
   ``positions=cache`` it runs for position rules too, queries included: they keep original distances,
   which holds only where a shift of every position changes keys and queries by their rotation alone.
2. **Attention calls**: every attention layer (``ModelFacts.attending``) called the
   bounded attention exactly once per pass, and no other layer did. A model that bypasses the
   registered attention, or calls it twice in a layer, is refused.
3. **Per-token NLL**: the probe streamed in :data:`PROBE_PASSES` passes with an unlimited budget, in
   the run's own position mode and attention path (fused or eager), must equal the model's own forward
   pass over the probe within :data:`TOLERANCE` (max |dNLL| per token). In a run's process that pass
   is the first over the whole probe (only the rotation check's shorter ones come before it), so it
   runs twice and the first result is not held: on CPU a process's first forward pass differed from its
   later ones in some processes (SmolLM2-135M, 48 tokens, 2 threads: the rotary module's cos in the
   second thread's rows was MKL VML's low-accuracy cos, up to 1.5e-4 off; per-token NLL by up to 1.0e-3
   nats; results/bench/first_forward.txt). Held against that first pass, a sound model failed the check
   at random. ``rmm.models.load_model`` now removes that cause (``warm_vector_math``); a model loaded
   elsewhere, or a first-call effect of another kind, is still never held. The probe is longer than the
   longest window (sliding or chunked) that the stream can outgrow, so the windows are exercised; a
   hybrid model's recurrent and convolutional state goes through the passes in its own cache (the
   engine's memory carries it), so a state that restarted at a pass would fail here.
4. **Batch** (only when the engine streams more than one document per pass): the probe streamed in a
   batch of two beside its own reverse, once in each row, must give what it gives streamed alone, within
   the same tolerance; a model whose batch rows interact is refused. Only the probe, which is text, is
   held, against the model's forward and against itself alone, so a run's verdict on the model does not
   depend on its batch. (The reversed probe is no text, and its fp32 rounding is larger: on Gemma 3 270M
   it differs from the model's own forward by 1.07e-4 nats per token streamed alone, where in fp64 at
   positions=original the difference is 0, results/cpu/confirm/selfcheck_rounding.md; in a batch the
   engine's attention blocks the rows' arithmetic differently, and the reverse moved by 1.9e-4 nats at a
   token it predicts at 18 nats while the probe moved by 2.9e-5, ``tests/test_gemma3.py``.)

Any error raised while probing is turned into :class:`~rmm.errors.UnsupportedModelError` naming the
model type and what failed; so is every mismatch. Nothing is scored before this passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from transformers import PreTrainedModel

from rmm import integration
from rmm.errors import UnsupportedModelError
from rmm.memory import SlotMemory
from rmm.options import StreamOptions
from rmm.policies.base import every_key
from rmm.recording import RecordingPlan
from rmm.rotary import Rotary

PROBE_TOKENS = 48  # the probe's length when no window needs a longer one
PROBE_PASSES = 4  # forward passes the probe is streamed in
ROTATION_TOKENS = 24
ROTATION_SHIFT = 101
# against the model's own forward: fp32 bounds every token's |dNLL|; half precision, whose per-token rounding
# reaches 0.95 nats (measured, docs/semantics.md), bounds the mean |dNLL| of every pass
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 0.2, torch.float16: 0.2}
PER_TOKEN = (torch.float32, torch.float64)  # dtypes checked per token; the others per pass
# relative error of a rotation (per layer)
ROTATION_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


class CheckedFacts(Protocol):
    """What the self-check reads of the engine's model facts (:class:`rmm.facts.ModelFacts`)."""

    name: str
    windows: list[int | None]
    attending: list[bool]
    rotary: Rotary
    device: torch.device
    dtype: torch.dtype


class CheckedPlan(Protocol):
    """What the self-check reads of the engine's plan (:class:`rmm.planning.StreamPlan`)."""

    recording: RecordingPlan


class Checkable(Protocol):
    """What the self-check uses of :class:`rmm.engine.StreamingEngine`."""

    model: PreTrainedModel
    facts: CheckedFacts
    plan: CheckedPlan
    options: StreamOptions

    def new_memory(self, n_tokens: int, plan: RecordingPlan, rows: int = 1) -> SlotMemory: ...

    def forward(
        self, memory: SlotMemory, tokens: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass
class SelfCheck:
    """What the self-check measured: probe length and passes, the largest |dNLL| against the model's own
    forward, the largest mean |dNLL| of a pass, the tolerance of the dtype's statistic (the first in fp32,
    the second in half precision), the same statistic of a batch's rows against the rows streamed alone
    (None at batch 1), each checked layer's rotation (name, relative error), wall time."""

    probe_tokens: int
    passes: int
    max_abs_dnll: float
    worst_pass_mean_dnll: float
    tolerance: float
    batch_dnll: float | None = None
    rotations: dict[int, tuple[str, float]] = field(default_factory=dict)
    wall_s: float = 0.0


def self_check(engine: Checkable, tokens: torch.Tensor) -> SelfCheck:
    """Run the checks for ``engine`` with a probe from ``tokens`` [n]; refuse on any mismatch."""
    name = engine.facts.name
    start = time.perf_counter()
    try:
        probe = tokens[: probe_length(engine, tokens.numel())].to(engine.facts.device)
        renumbers = _renumbers(engine)
        rotations = _check_rotation(engine, probe) if renumbers else {}
        difference, step, in_batch = check_stream(engine, probe)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{name} failed the self-check: {err}") from err
    except Exception as err:  # anything the probe trips over is a refusal, never a crash mid-run
        raise UnsupportedModelError(
            f"{name} failed the self-check: streaming the probe raised {type(err).__name__}: {err}"
        ) from err
    tolerance = TOLERANCE.get(engine.facts.dtype, 1e-4)
    per_token = engine.facts.dtype in PER_TOKEN
    max_dnll, pass_means = _statistics(difference, step)
    measured, what = (max_dnll, "per-token NLL") if per_token else (max(pass_means), "a pass's mean NLL")
    if not measured <= tolerance:
        raise UnsupportedModelError(
            f"{name} failed the self-check: the probe streamed with an unlimited "
            f"budget gives {what} up to {measured:.3g} nats from the model's own forward pass (tolerance "
            f"{tolerance:g}), so the bounded attention does not reproduce this model's attention"
        )
    batch_dnll = None
    if in_batch is not None:
        batch_max, batch_means = _statistics(in_batch, step)
        batch_dnll = batch_max if per_token else max(batch_means)
        if not batch_dnll <= tolerance:
            raise UnsupportedModelError(
                f"{name} failed the self-check: the probe streamed beside its reverse "
                f"in one batch gives {what} up to {batch_dnll:.3g} nats from the probe streamed alone "
                f"(tolerance {tolerance:g}): the model's batch rows interact; run it with batch=1"
            )
    return SelfCheck(
        probe.numel(),
        len(pass_means),
        max_dnll,
        max(pass_means),
        tolerance,
        batch_dnll,
        rotations,
        time.perf_counter() - start,
    )


def _statistics(difference: torch.Tensor, step: int) -> tuple[float, list[float]]:
    """The largest |dNLL| of ``difference`` [..., n - 1] and the mean |dNLL| of every pass of ``step``."""
    means = [float(part.mean()) for part in difference.split(step, dim=-1) if part.numel()]
    return float(difference.max()), means


def probe_length(engine: Checkable, n_tokens: int) -> int:
    """Tokens in the probe: :data:`PROBE_TOKENS`, or one more pass beyond the longest window that a
    stream of ``n_tokens`` outgrows; never more than the stream."""
    windows = [w for w in engine.facts.windows if w is not None and w < n_tokens]
    length = max([PROBE_TOKENS] + [w + max(w // PROBE_PASSES, 8) for w in windows])
    return min(n_tokens, length)


def _unlimited(plan: RecordingPlan, chunk: int, **changes) -> RecordingPlan:
    """``plan`` with every entry kept: no bound on R, no position rule, no sinks, no gradient."""
    rule = None if plan.rule is None else every_key
    return replace(
        plan, rule=rule, retained=None, n_sink_slots=0, track_gradient=False, decision_chunk=chunk, **changes
    )


def check_stream(engine: Checkable, probe: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(|dNLL| [n - 1] of the probe against the model's own forward, tokens per pass, and with
    ``engine.options.batch`` > 1 |dNLL| [2, n - 1] of the probe in each row of a batch of two beside its
    reverse against the probe streamed alone, else None); checks the attention calls.

    Only the probe is held, so the verdict on the model does not depend on the batch; the batch is held
    against the engine's own unbatched stream: a model whose rows interact fails.
    """
    model = engine.model
    with torch.no_grad():
        for _ in range(2):  # the first pass is not held: a process's first pass may differ (module docstring)
            logits = model(input_ids=probe[None], use_cache=False).logits
        logp = torch.log_softmax(logits[0].float(), -1)
    own_nll = -logp[:-1].gather(-1, probe[1:, None])[:, 0]  # [n - 1]
    step = max(1, -(-probe.numel() // PROBE_PASSES))
    step = min(step, engine.plan.recording.pass_limit or step)
    alone = _stream(engine, probe[None], step)  # [1, n - 1]
    if engine.options.batch == 1:
        return (alone[0] - own_nll).abs(), step, None
    reverse = probe.flip(0)
    first = _stream(engine, torch.stack([probe, reverse]), step)[0]
    second = _stream(engine, torch.stack([reverse, probe]), step)[1]
    return (alone[0] - own_nll).abs(), step, (torch.stack([first, second]) - alone).abs()


def _stream(engine: Checkable, rows: torch.Tensor, step: int) -> torch.Tensor:
    """Per-token NLL [N, n - 1] of ``rows`` [N, n] streamed side by side in passes of ``step`` tokens with
    an unlimited budget; checks each memory's attention calls."""
    n = rows.shape[1]
    plan = _unlimited(engine.plan.recording, step)
    memory = engine.new_memory(n, plan, rows=len(rows))
    nll = torch.empty(len(rows), n - 1, device=engine.facts.device)
    with torch.no_grad(), integration.install(engine.model):
        for start in range(0, n, step):
            stop = min(start + step, n)
            position_ids = memory.begin_chunk([start] * len(rows), [stop - start] * len(rows))
            logits = engine.forward(memory, rows[:, start:stop], position_ids)
            scored = min(stop, n - 1) - start
            log_probs = torch.log_softmax(logits[:, :scored], dim=-1)
            targets = rows[:, start + 1 : start + 1 + scored, None]
            nll[:, start : start + scored] = -log_probs.gather(-1, targets)[..., 0]
            if stop < n:
                now = torch.full((len(rows),), stop, device=engine.facts.device)
                memory.compact(memory.alive(now) if plan.rule is None else memory.chunk_key_pos() >= 0, now)
    _check_calls(engine, memory.calls, memory.passes)
    return nll


def _check_calls(engine: Checkable, calls: list[int], passes: int) -> None:
    expected = {layer for layer, attends in enumerate(engine.facts.attending) if attends}
    wrong = {
        layer: count for layer, count in enumerate(calls) if count != (passes if layer in expected else 0)
    }
    if wrong:
        shown = ", ".join(f"layer {layer}: {count}" for layer, count in list(wrong.items())[:4])
        raise UnsupportedModelError(
            f"its attention layers must call the bounded attention once per forward pass ({passes} passes, "
            f"{len(expected)} attention layers), but the calls were {shown}"
            f"{' ...' if len(wrong) > 4 else ''}: "
            "the model bypasses the registered attention function or calls it more than once per layer"
        )


def _renumbers(engine: Checkable) -> bool:
    """Whether the stream moves keys or queries to other positions, or renumbers them (position rules
    under ``positions=cache`` on a rotary model, which hold only where a shift of every position
    changes each layer's keys and queries by its rotation alone)."""
    cache = engine.options.positions == "cache" and bool(engine.facts.rotary.candidates)
    return engine.plan.recording.moves_positions or cache


def _check_rotation(engine: Checkable, probe: torch.Tensor) -> dict[int, tuple[str, float]]:
    """Calibrate and check the engine's per-layer rotations against the model's own."""
    n = min(probe.numel(), ROTATION_TOKENS, engine.plan.recording.pass_limit or ROTATION_TOKENS)
    plan = _unlimited(
        engine.plan.recording,
        n,
        store_unrotated=False,
        raw_keys=False,
        record_queries=False,
        record_attention=False,
    )
    captured = []
    for shift in (0, ROTATION_SHIFT):
        keys, queries = {}, {}
        memory = engine.new_memory(n, plan)
        memory.capture = lambda layer, q, k, keys=keys, queries=queries: (  # row 0 of [1, H, ...]
            keys.__setitem__(layer, k[0].detach().clone()),
            queries.__setitem__(layer, q[0].detach().clone()),
        )
        with torch.no_grad(), integration.install(engine.model):
            position_ids = memory.begin_chunk([0], [n])
            engine.forward(memory, probe[None, :n], position_ids + shift)
        captured.append((keys, queries))
    tolerance = ROTATION_TOLERANCE.get(engine.facts.dtype, 1e-3)
    recording = engine.plan.recording  # a position rule under cache positions keeps queries where they are
    renumbered = recording.rule is not None and engine.options.positions == "cache"
    queries = recording.record_queries or bool(recording.n_sink_slots) or renumbered
    return engine.facts.rotary.check(captured, ROTATION_SHIFT, tolerance, queries)
