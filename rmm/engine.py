"""The streaming engine: one document, chunk by chunk, through a causal LM with a bounded memory.

After every chunk a score-based policy observes what the chunk recorded; at a boundary the engine runs
score -> select (:mod:`rmm.policies.select`) -> :meth:`~rmm.memory.SlotMemory.compact`. Which buffers
the memory holds is the stream's :class:`~rmm.recording.RecordingPlan`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from rmm import integration, selfcheck
from rmm.memory import SlotMemory, record_gradients
from rmm.models import UnsupportedModelError, describe_model
from rmm.policies import Observation, Policy, ScorePolicy
from rmm.policies.select import (
    SCOPES,
    adaptive_floor,
    capacities,
    check_allocation,
    decision_margin,
    kept_digest,
    rule_keep,
    select,
)
from rmm.recording import RecordingPlan, check_positions, recording_plan
from rmm.rotary import Rotary
from rmm.selfcheck import SelfCheck

LAYERS = ("all", "global")  # as rmm.config.LAYERS, which checks configs without torch
# observer(attn [L, H, Q, S], key_pos [L, H, S], query_pos [Q]) called after every chunk
AttentionObserver = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# called before each decision of a score-based policy:
# (memory, observation of the chunk, now, the policy's scores [L, H, R + Q] that the decision selects from)
DecisionHook = Callable[[SlotMemory, Observation, int, torch.Tensor], None]
# called after each chunk: (tokens streamed so far, nll [Q'] of the chunk's scored predictions)
ChunkHook = Callable[[int, torch.Tensor], None]
# called after each decision: (memory, now, evicted [L, H, S] with -1 where kept)
BoundaryHook = Callable[[SlotMemory, int, torch.Tensor], None]


@dataclass
class StreamResult:
    """Per-token outcome of one stream of n tokens.

    nll : [n - 1] float32, -log p(x_{p} | query p-1) for p = 1..n-1.
    correct : [n - 1] bool, argmax of query p-1 equals x_p.
    margin : [n - 1] float32, top-1 minus top-2 log-probability of query p-1: how near ``correct`` was
        to flipping (:mod:`rmm.divergence`).
    boundaries : [K] long, the positions ``now`` of a score-based policy's K decisions.
    decisions : [K, L, H] float32, each decision's relative margin per (layer, KV head)
        (:func:`rmm.policies.select.decision_margin`); K = 0 for a position rule.
    digests : [K, L, H] int64, a fingerprint of the set each decision kept per (layer, KV head)
        (:func:`~rmm.policies.select.kept_digest`).
    score_digits : the significant digits at which the policy compared its scores (None: unrounded).
    """

    nll: torch.Tensor
    correct: torch.Tensor
    attended_total: float
    evicted_age_sum: float
    evicted_count: int
    margin: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None
    decisions: torch.Tensor | None = None
    digests: torch.Tensor | None = None
    score_digits: int | None = None


class StreamingEngine:
    """Streams token sequences through ``model`` under ``policy`` with budget B and chunk C.

    ``allocation`` (``uniform``, ``adaptive`` or ``pyramid``) splits the budget across KV heads and
    layers (:mod:`rmm.policies.select`, docs/semantics.md); the capacities are computed once here.
    ``batch`` is how many streams :meth:`stream_many` runs side by side in one forward pass.

    While a stream runs, the model's attention is :func:`rmm.integration.bounded_attention` (its own
    implementation is restored afterwards); the model's own KV cache is not used.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: Policy,
        positions: str = "original",
        scope: str = "head",
        allocation: str = "uniform",
        layers: str = "all",
        batch: int = 1,
    ):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        check_allocation(allocation, scope, positions, policy)
        check_layers(layers, allocation)
        check_batch(batch)
        if allocation != "uniform" and policy.budget is None:
            raise ValueError(f"allocation={allocation} needs a budget: set budget, or allocation=uniform")
        check_positions(policy, positions)
        integration.check_model(model, positions)
        self.windows = integration.layer_windows(model)  # per layer: past entries its window shows, or None
        check_windows(model, self.windows, policy, scope)
        dims = describe_model(model)
        self.shape = (dims["n_layers"], dims["n_kv_heads"], dims["head_dim"])
        # the recording plan, built once: R is the largest per-head capacity under an allocation, and the
        # widest window of a layer the policy leaves alone (layers=global)
        plan = recording_plan(policy, positions, allocation, self.shape[:2])
        self.plan = plan.exempting(self.windows) if layers == "global" and policy.budget is not None else plan
        self.model, self.policy, self.positions, self.scope = model, policy, positions, scope
        self.allocation, self.layers, self.batch = allocation, layers, batch
        # per (layer, KV head) capacity [L, H] and the adaptive floor, once per engine
        self.capacity: int | torch.Tensor | None = None
        self.floor: int | None = None
        if policy.budget is not None and self.plan.rule is None:  # a score-based policy
            self.capacity = policy.capacity
            if allocation == "pyramid":
                self.capacity = capacities(allocation, policy.capacity, policy.protected, *self.shape[:2])
            elif allocation == "adaptive":
                self.floor = adaptive_floor(policy.capacity)
        self.device = next(model.parameters()).device
        if self.plan.exempt and self.capacity is not None:  # a windowed layer keeps all its window shows
            per_layer = torch.tensor([self.plan.retained if e else policy.capacity for e in self.plan.exempt])
            self.capacity = per_layer[:, None].expand(self.shape[:2]).clone()
        if isinstance(self.capacity, torch.Tensor):
            self.capacity = self.capacity.to(self.device)
        self.dtype = next(model.parameters()).dtype
        self.rotary = Rotary(model).to(self.device)
        if not self.rotary.candidates and selfcheck.moves_positions(self.plan):
            raise UnsupportedModelError(
                f"{integration.describe(model)} has no rotary position embedding (no `inv_freq` buffer, nor "
                "a sin/cos table in a rotary module), so its keys cannot move to other positions, which "
                f"positions={positions} with policy {policy.name} needs; use positions=original with a "
                "policy that reads no keys or queries"
            )
        # the positions a stream may reach: learned absolute positions, or a rotary sin/cos table's rows
        learned = dims["max_position_embeddings"]
        self.max_positions = self.rotary.max_positions if self.rotary.candidates else learned
        # model constants a policy may declare in `needs`, read once and handed to every observation
        self.constants: dict[str, object] = {}
        if "output_projection" in getattr(policy, "needs", ()):
            self.constants["output_projection"] = integration.output_projections(model).to(self.device)
        if "rotation" in getattr(policy, "needs", ()):
            self.constants["rotary"] = self.rotary  # calibrated in place by the self-check
        self.checked: SelfCheck | None = None

    def self_check(self, tokens: torch.Tensor) -> SelfCheck:
        """Check the engine on this model before the first scored token (:func:`rmm.selfcheck.self_check`)
        with a probe from ``tokens`` [n] (the longest stream to come); refuses the model on a mismatch."""
        if self.max_positions is not None and tokens.numel() > self.max_positions:
            what = "a rotary sin/cos table of" if self.rotary.candidates else "learned positions up to"
            raise UnsupportedModelError(
                f"{integration.describe(self.model)} has {what} {self.max_positions} positions, but a stream "
                f"has {tokens.numel()} tokens; cut the documents "
                f"(dataset.max_tokens<={self.max_positions}, or max_tokens=)"
            )
        if self.checked is None:
            self.checked = selfcheck.self_check(self, tokens)
        return self.checked

    def self_check_metrics(self) -> dict[str, float | int | None]:
        """The self-check's figures for a run's metrics (None before it ran)."""
        check = self.checked
        return {
            "self_check_tokens": None if check is None else check.probe_tokens,
            "self_check_max_dnll": None if check is None else check.max_abs_dnll,
            "self_check_s": None if check is None else check.wall_s,
        }

    def chunks(self, n_tokens: int, plan: RecordingPlan) -> list[tuple[int, int]]:
        """(start, stop) of every forward pass. The first holds at most B tokens, so that a position
        rule's first positions (its attention sinks) are retained slots by the time a query needs
        them re-rotated (:mod:`rmm.memory`); the chunk itself is ``plan.chunk``."""
        step = plan.chunk
        first = step if self.policy.budget is None else min(step, self.policy.budget)
        starts = [0, *range(first, n_tokens, step)] if first < n_tokens else [0]
        return [(start, min(start + (first if start == 0 else step), n_tokens)) for start in starts]

    def forward(
        self, memories: list[SlotMemory], tokens: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """One pass of N streams' chunks ``tokens`` [N, Q] at ``position_ids`` [N, Q], row i over
        ``memories[i]``: logits [N, Q, V] (float32). The model's attention must be the bounded attention
        (:func:`rmm.integration.install`)."""
        with integration.active(memories):  # the attention function finds them there, not in kwargs
            out = self.model(input_ids=tokens, position_ids=position_ids, use_cache=False)
        return out.logits.float()

    def new_memory(self, n_tokens: int, plan: RecordingPlan) -> SlotMemory:
        retained, chunk = plan.slots(n_tokens)
        return SlotMemory(plan, self.shape, retained, chunk, self.rotary, self.dtype, self.device)

    def stream(
        self,
        tokens: torch.Tensor,
        observer: AttentionObserver | None = None,
        before_boundary: DecisionHook | None = None,
        on_boundary: BoundaryHook | None = None,
        on_chunk: ChunkHook | None = None,
    ) -> StreamResult:
        """Score every next-token prediction of ``tokens`` [n] (n >= 2), alone in its passes."""
        hooks = StreamHooks(observer, before_boundary, on_boundary, on_chunk)
        ((_, result, _),) = self.stream_many([StreamRequest(tokens, self.policy, hooks)], batch=1)
        return result

    @torch.no_grad()
    def stream_many(
        self, requests: Iterable[StreamRequest], batch: int | None = None
    ) -> Iterator[tuple[int, StreamResult, float]]:
        """Stream ``requests`` side by side, up to ``batch`` (default: the engine's) in one forward pass.

        Each stream has its own memory, policy, positions and decisions; streams share no entry, so a
        stream's outcome does not depend on the others (to fp32 rounding of the batched matrix products).
        Streams whose next chunks have equal lengths share a pass; a finished stream leaves and the next
        request takes its place (requests are drawn lazily, outside the model's attention switch, so a
        request may run the model, e.g. an oracle's reference pass, while it is made).

        Yields (index of the request, its result, its share of the passes' wall time in seconds) as
        each stream finishes.
        """
        batch = self.batch if batch is None else batch
        check_batch(batch)
        pending = iter(enumerate(requests))
        active: list[_Stream] = []
        while True:
            for index, request in itertools.islice(pending, batch - len(active)):
                n = request.tokens.numel()
                if n < 2:
                    raise ValueError(f"a stream needs at least 2 tokens to score one prediction, got {n}")
                self.self_check(request.tokens)
                active.append(_Stream(self, request, index))
            if not active:
                return
            with integration.install(self.model):
                while not any(stream.done for stream in active):
                    groups: dict[int, list[_Stream]] = {}
                    for stream in active:
                        groups.setdefault(stream.next_length, []).append(stream)
                    for group in groups.values():
                        self._pass(group)
            finished = [stream for stream in active if stream.done]
            active = [stream for stream in active if not stream.done]
            while finished:  # a finished stream's memory is released before the next ones are drawn
                done = finished.pop(0)
                outcome = done.index, done.result(), done.wall_s
                del done
                yield outcome

    def _pass(self, streams: list[_Stream]) -> None:
        """One forward pass of the streams' next chunks (all of one length), then each stream's decision."""
        start = time.perf_counter()
        chunks = [stream.begin() for stream in streams]
        tokens = torch.stack([chunk for chunk, _ in chunks])
        position_ids = torch.stack([position for _, position in chunks])
        tracking = self.plan.track_gradient
        # autograd only for a policy that needs the gradient utility, and only for this pass
        with torch.enable_grad() if tracking else contextlib.nullcontext():
            logits = self.forward([stream.memory for stream in streams], tokens, position_ids)  # [N, Q, V]
            losses = [stream.score(logits[i]) for i, stream in enumerate(streams)]
            if tracking:
                record_gradients([stream.memory for stream in streams], losses)
        for stream in streams:
            self._decide(stream)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        share = (time.perf_counter() - start) / len(streams)
        for stream in streams:
            stream.wall_s += share

    def _decide(self, stream: _Stream) -> None:
        """After a stream's pass: record its outcomes, let a score-based policy observe the chunk, and at a
        boundary choose what the memory keeps."""
        memory, policy, plan, hooks = stream.memory, stream.policy, stream.plan, stream.hooks
        start, stop = stream.schedule[stream.step]
        token_nll, token_correct = stream.record(start)
        stream.step += 1
        n, query_pos = stream.tokens.numel(), memory.query_pos
        stream.attended += memory.attended_total()
        if hooks.on_chunk is not None:
            hooks.on_chunk(stop, token_nll)
        obs = None
        if plan.rule is None:  # a score-based policy observes the chunk
            outcomes = {}
            if "outcomes" in policy.needs:
                outcomes = _outcomes(query_pos, token_nll, token_correct)
            observed = memory.observed(policy.needs)
            obs = Observation(memory.chunk_key_pos(), query_pos, **observed, **outcomes, **self.constants)
            policy.observe(memory.state_view(), obs)
        if hooks.observer is not None:
            hooks.observer(memory.chunk_attention(), memory.chunk_key_pos(), query_pos)
        if stop == n:
            return
        key_pos = memory.chunk_key_pos()
        if obs is not None:
            # entries a layer's own window hides from now on are gone: no policy ranks them
            valid = memory.alive(stop)
            obs.key_pos = key_pos = torch.where(valid, key_pos, -1)
            scores = policy.score(memory.state_view(), obs, stop)
            if hooks.before_boundary is not None:
                hooks.before_boundary(memory, obs, stop, scores)
            how = (self.scope, policy.scope_reduce, self.floor)
            keep = select(scores, key_pos, valid, self.capacity, *how)
            stream.decided(
                stop, decision_margin(scores, key_pos, valid, keep, *how), kept_digest(keep, key_pos)
            )
        else:
            keep = rule_keep(plan.rule, stop, key_pos)
            if plan.exempt:  # layers the rule leaves alone keep what their window shows
                exempt = torch.tensor(plan.exempt, device=keep.device)[:, None, None]
                keep = torch.where(exempt, memory.alive(stop), keep)
        evicted = memory.compact(keep)
        evicted_pos = evicted[evicted >= 0]
        stream.age_sum += float((stop - evicted_pos).sum())
        stream.n_evicted += evicted_pos.numel()
        if hooks.on_boundary is not None:
            hooks.on_boundary(memory, stop, evicted)


@dataclass
class StreamHooks:
    """A stream's optional callbacks (see the type aliases above)."""

    observer: AttentionObserver | None = None
    before_boundary: DecisionHook | None = None
    on_boundary: BoundaryHook | None = None
    on_chunk: ChunkHook | None = None


@dataclass
class StreamRequest:
    """One stream for :meth:`StreamingEngine.stream_many`: ``tokens`` [n], the policy instance that decides
    for it (its own instance when streams share passes and :meth:`~rmm.policies.Policy.prepare` keeps
    per-stream state; the same class and parameters as the engine's policy) and its hooks."""

    tokens: torch.Tensor
    policy: Policy
    hooks: StreamHooks = field(default_factory=StreamHooks)


class _Stream:
    """One stream's state while it runs: memory, chunk schedule, outcomes so far."""

    def __init__(self, engine: StreamingEngine, request: StreamRequest, index: int):
        self.index, self.policy, self.hooks = index, request.policy, request.hooks
        self.tokens = request.tokens.to(engine.device)
        n = self.tokens.numel()
        self.plan = engine.plan if request.hooks.observer is None else engine.plan.observed()
        self.memory = engine.new_memory(n, self.plan)
        self.schedule = engine.chunks(n, self.plan)
        self.step = 0
        self.nll = torch.empty(n - 1, device=engine.device)
        self.correct = torch.empty(n - 1, dtype=torch.bool, device=engine.device)
        self.margin = torch.empty(n - 1, device=engine.device)
        # per decision (at most one per chunk boundary), kept on the device until the end
        self.boundaries: list[int] = []
        self.decisions = torch.empty(len(self.schedule), *engine.shape[:2], device=engine.device)
        self.digests = torch.empty(self.decisions.shape, dtype=torch.long, device=engine.device)
        self.attended, self.age_sum, self.n_evicted, self.wall_s = 0.0, 0.0, 0, 0.0
        self._scored: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def done(self) -> bool:
        return self.step == len(self.schedule)

    @property
    def next_length(self) -> int:
        start, stop = self.schedule[self.step]
        return stop - start

    def begin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next chunk's tokens [Q] and the position ids [Q] to feed the model."""
        start, stop = self.schedule[self.step]
        return self.tokens[start:stop], self.memory.begin_chunk(
            torch.arange(start, stop, device=self.tokens.device)
        )

    def score(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Score the chunk's predictions from its logits [Q, V]; returns their summed NLL (in the pass's
        graph when it has one), None when no query of the chunk has a target."""
        start, stop = self.schedule[self.step]
        n_scored = min(stop, self.tokens.numel() - 1) - start
        targets = self.tokens[start + 1 : start + 1 + n_scored]
        log_probs = torch.log_softmax(logits[:n_scored], dim=-1)
        token_nll = -log_probs.gather(-1, targets[:, None])[:, 0]
        detached = log_probs.detach()
        top = detached.topk(2, dim=-1).values  # how far the argmax is ahead of the runner-up
        self._scored = (token_nll, detached.argmax(dim=-1) == targets, top[:, 0] - top[:, 1])
        return token_nll.sum() if n_scored else None

    def record(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the NLL, correctness and its margin [Q'] of the scored chunk starting at ``start`` (Q' scored
        queries) and return the NLL and correctness."""
        assert self._scored is not None
        token_nll, token_correct, margin = self._scored[0].detach(), self._scored[1], self._scored[2]
        self._scored = None
        self.nll[start : start + token_nll.numel()] = token_nll
        self.correct[start : start + token_nll.numel()] = token_correct
        self.margin[start : start + token_nll.numel()] = margin
        return token_nll, token_correct

    def decided(self, now: int, margin: torch.Tensor, digest: torch.Tensor) -> None:
        """Record the margin [L, H] and the kept sets' digests [L, H] of the decision at boundary ``now``."""
        self.decisions[len(self.boundaries)] = margin
        self.digests[len(self.boundaries)] = digest
        self.boundaries.append(now)

    def result(self) -> StreamResult:
        k = len(self.boundaries)
        return StreamResult(
            self.nll.float().cpu(),
            self.correct.cpu(),
            self.attended,
            self.age_sum,
            self.n_evicted,
            self.margin.float().cpu(),
            torch.tensor(self.boundaries, dtype=torch.long),
            self.decisions[:k].float().cpu(),
            self.digests[:k].cpu(),
            getattr(self.policy, "score_digits", None),
        )


def check_batch(batch: int) -> None:
    """``batch``: streams per forward pass, at least 1."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1 (streams per forward pass), got {batch!r}")


def check_layers(layers: str, allocation: str) -> None:
    """``layers``: ``all`` (the policy decides in every layer) or ``global`` (only in global layers)."""
    if layers not in LAYERS:
        raise ValueError(f"layers must be one of {LAYERS}, got {layers!r}")
    if layers == "global" and allocation != "uniform":
        raise ValueError(
            "layers=global keeps the windowed layers out of the policy's budget, which "
            f"allocation={allocation} spreads over every layer: use allocation=uniform, or layers=all"
        )


def layer_entries(budget: int, windows: list[int | None], exempt: tuple[bool, ...]) -> list[int]:
    """Past entries each layer holds at most: B, or min(B, w) for a layer whose window shows w past entries
    (its budget beyond w is never used), or w for a windowed layer the policy leaves alone."""
    return [
        budget if w is None else (w if exempt and exempt[layer] else min(budget, w))
        for layer, w in enumerate(windows)
    ]


def check_windows(
    model: PreTrainedModel, layer_windows: list[int | None], policy: Policy, scope: str
) -> None:
    """Refuse what a model's own windows (sliding or chunked layers) and a score-based policy cannot do
    together: one set shared across layers (``scope=global``), or a policy that reads entries further
    back than a window keeps them (its ``lookback``)."""
    windows = [w for w in layer_windows if w is not None]
    if not windows or not isinstance(policy, ScorePolicy):
        return
    name = integration.describe(model)
    if scope == "global":
        raise UnsupportedModelError(
            f"{name} has windowed layers, whose entries leave as the window passes, so one set cannot be "
            "shared across all layers; use scope=head or scope=layer"
        )
    if min(windows) < policy.lookback:
        raise UnsupportedModelError(
            f"policy {policy.name} reads entries up to {policy.lookback} positions behind a boundary, but "
            f"{name} has a layer that attends only {min(windows)} past positions; choose smaller "
            "policy parameters (e.g. policy.partition) or another policy"
        )


def _outcomes(query_pos: torch.Tensor, nll: torch.Tensor, correct: torch.Tensor) -> dict[str, torch.Tensor]:
    """correct, prob and nll [Q] of the chunk's queries, 0 for the document's last query (no target)."""
    pad = query_pos.numel() - nll.numel()
    return {
        "correct": torch.nn.functional.pad(correct.float(), (0, pad)),
        "prob": torch.nn.functional.pad(torch.exp(-nll), (0, pad)),
        "nll": torch.nn.functional.pad(nll.float(), (0, pad)),
    }
