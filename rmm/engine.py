"""The streaming engine: one document, chunk by chunk, through a causal LM with a bounded memory.

After every chunk a score-based policy observes what the chunk recorded; at a boundary the engine runs
score -> select (:mod:`rmm.policies.select`) -> :meth:`~rmm.memory.SlotMemory.compact`. Which buffers
the memory holds is the stream's :class:`~rmm.recording.RecordingPlan`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from rmm import integration, selfcheck
from rmm.errors import UnsupportedModelError
from rmm.facts import model_facts
from rmm.memory import RowView, SlotMemory, record_gradients
from rmm.metrics import StreamResult
from rmm.options import StreamOptions
from rmm.planning import plan_stream
from rmm.policies import Observation, Policy
from rmm.policies.select import (
    decision_margin,
    kept_digest,
    rule_keep,
    select,
    threshold_margins,
)
from rmm.recording import RecordingPlan
from rmm.selfcheck import SelfCheck
from rmm.timing import PassClock, StreamTime
from rmm.transfer import to_device

# observer(attn [L, H, Q, S], key_pos [L, H, S], query_pos [Q]) called after every chunk
AttentionObserver = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# called before each decision of a score-based policy: (the stream's view of the memory, observation of
# the chunk, now, the policy's scores [L, H, R + Q] that the decision selects from)
DecisionHook = Callable[[RowView, Observation, int, torch.Tensor], None]
# called after each chunk: (tokens streamed so far, nll [Q'] of the chunk's scored predictions)
ChunkHook = Callable[[int, torch.Tensor], None]
# called after each decision: (the stream's view of the memory, now, evicted [L, H, S] with -1 where kept)
BoundaryHook = Callable[[RowView, int, torch.Tensor], None]


def retained_sets_recorder() -> tuple[BoundaryHook, dict[int, list]]:
    """An ``on_boundary`` hook and the dict it fills: boundary -> retained sets R_now as nested lists [L][H]
    of sorted positions, the form of the reference's ``retained_log`` (:mod:`rmm.reference`)."""
    sets: dict[int, list] = {}

    def hook(memory: RowView, now: int, evicted: torch.Tensor) -> None:
        pos = memory.retained_positions().cpu()
        sets[now] = [[sorted(p for p in head.tolist() if p >= 0) for head in layer] for layer in pos]

    return hook, sets


class StreamingEngine:
    """Streams token sequences through ``model`` under ``policy`` with budget B and chunk C, bounded as
    ``options`` say (:class:`~rmm.options.StreamOptions`, or its fields as keywords: ``positions="cache"``).

    ``options.allocation`` (``uniform``, ``adaptive`` or ``pyramid``) splits the budget across KV heads
    and layers (:mod:`rmm.policies.select`, docs/semantics.md); the capacities are computed once here.
    ``options.batch`` is how many streams :meth:`stream_many` runs side by side in one forward pass.

    While a stream runs, the model's attention is :func:`rmm.integration.bounded_attention` (its own
    implementation is restored afterwards); the model's own KV cache holds no attention entry. A model
    with recurrent or convolutional mixers (hybrid models) carries their state across passes in its own
    cache, one row per stream (:class:`rmm.integration.CarriedState`, held by the memory).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: Policy,
        options: StreamOptions | None = None,
        **fields: str | int,
    ):
        self.options = options = StreamOptions.given(options, **fields)
        self.facts = facts = model_facts(model)
        self.plan = plan_stream(policy, options, facts)  # recording plan, capacities, floor, constants
        self.model, self.policy = model, policy
        self.state_bytes = 0  # one stream's recurrent and convolutional state (measured at the first pass)
        self.checked: SelfCheck | None = None
        self.clock = PassClock(facts.device)

    def self_check(self, tokens: torch.Tensor) -> SelfCheck:
        """Check the engine on this model before the first scored token (:func:`rmm.selfcheck.self_check`)
        with a probe from ``tokens`` [n] (the longest stream to come); refuses the model on a mismatch. It
        runs once, and again only for a stream that needs a longer probe than the checked one
        (:func:`rmm.selfcheck.probe_length`: a stream longer than a short first one, or one that outgrows
        a window)."""
        limit = self.facts.max_positions
        if limit is not None and tokens.numel() > limit:
            what = "a rotary sin/cos table of" if self.facts.rotary.candidates else "learned positions up to"
            raise UnsupportedModelError(
                f"{self.facts.name} has {what} {limit} positions, but a stream has {tokens.numel()} tokens; "
                f"cut the documents (dataset.max_tokens<={limit}, or max_tokens=)"
            )
        if self.checked is None or selfcheck.probe_length(self, tokens.numel()) > self.checked.probe_tokens:
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
        if self.facts.carried:  # every pass but a stream's last as long: a padded query would enter the state
            step = first
        starts = [0, *range(first, n_tokens, step)] if first < n_tokens else [0]
        return [(start, min(start + (first if start == 0 else step), n_tokens)) for start in starts]

    def forward(self, memory: SlotMemory, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One pass of the memory's N streams: chunks ``tokens`` [N, Q] at ``position_ids`` [N, Q], row i
        over the memory's row i: logits [N, Q, V] (float32). The model's attention must be the bounded
        attention (:func:`rmm.integration.install`). The model's own cache holds no attention entry: a
        hybrid model's recurrent state continues there from the row's last pass; any other model gets an
        empty one (:func:`rmm.integration.attention_free_cache`)."""
        cache = memory.carried.cache if memory.carried is not None else self._empty_cache
        state = {"use_cache": False} if cache is None else {"use_cache": True, self._cache_keyword: cache}
        with integration.active(memory):  # the attention function finds it there, not in kwargs
            out = self.model(input_ids=tokens, position_ids=position_ids, **state)
        if memory.carried is not None:
            self.state_bytes = memory.carried.bytes_per_row()
        return out.logits.float()

    @functools.cached_property
    def _empty_cache(self) -> DynamicCache | None:
        return integration.attention_free_cache(self.model)

    @functools.cached_property
    def _cache_keyword(self) -> str:
        return integration.cache_keyword(self.model)

    def new_memory(self, n_tokens: int, plan: RecordingPlan, rows: int = 1) -> SlotMemory:
        """A memory of ``rows`` streams of up to ``n_tokens`` tokens under ``plan``."""
        retained, chunk = plan.slots(n_tokens)
        carried = integration.CarriedState(self.model) if self.facts.carried else None
        return SlotMemory(
            plan,
            self.facts.shape,
            retained,
            chunk,
            self.facts.rotary,
            self.facts.dtype,
            self.facts.device,
            rows,
            self.facts.holds,
            carried,
            self.facts.dims["value_head_dim"],
            self.facts.layer_shapes,
            self.facts.sources,
        )

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

        The streams are the rows of one :class:`~rmm.memory.SlotMemory`: each has its own slots,
        policy, positions and decisions, and streams share no entry, so a stream's outcome does not
        depend on the others (to fp32 rounding of the batched products). Every pass takes every running
        stream's next chunk (a shorter one padded); a finished stream leaves and the next request takes
        its row (requests are drawn lazily, outside the model's attention switch, so a request may run
        the model, e.g. an oracle's reference pass, while it is made).

        Yields (index of the request, its result, its share of the passes' wall time in seconds) as
        each stream finishes.
        """
        batch = self.options.batch if batch is None else batch
        StreamOptions(batch=batch)  # checks it
        pending = iter(enumerate(requests))
        rows: list[_Stream | None] = []  # the memory's rows: a running stream, or None once it finished
        memory: SlotMemory | None = None
        while True:
            free = [row for row, stream in enumerate(rows) if stream is None]
            for index, request in itertools.islice(pending, len(free) + batch - len(rows)):
                n = request.tokens.numel()
                if n < 2:
                    raise ValueError(f"a stream needs at least 2 tokens to score one prediction, got {n}")
                self.self_check(request.tokens)
                stream = _Stream(self, request, index)
                if free:
                    rows[free.pop(0)] = stream
                else:
                    rows.append(stream)
            running = [stream for stream in rows if stream is not None]
            if not running:
                return
            memory = self._fit(memory, rows)
            rows = running
            with integration.install(self.model):
                while not any(stream.done for stream in rows):
                    self._pass(memory, rows)
            outcomes = [(s.index, s.result(memory), s.time.seconds) for s in rows if s.done]
            rows = [None if stream.done else stream for stream in rows]
            yield from outcomes

    def _check_padding(self, starts: list[int], lengths: list[int]) -> None:
        """Refuse a pass whose padded rows (a shorter chunk padded to the pass's widest) would reach past
        the model's table of positions (padded queries continue the positions: :mod:`rmm.memory`)."""
        width = max(lengths)
        reach = max(start + width for start, length in zip(starts, lengths, strict=True) if length < width)
        limit = self.facts.max_positions
        if limit is not None and reach > limit:
            raise UnsupportedModelError(
                f"{self.facts.name} has a table of {limit} positions, but a "
                f"document's last chunk, padded to the {width} tokens of the batch's pass, reaches position "
                f"{reach - 1}; cut the documents to a multiple of the chunk below {limit} "
                "tokens, or use batch=1"
            )

    def _fit(self, memory: SlotMemory | None, rows: list[_Stream | None]) -> SlotMemory:
        """The memory for ``rows`` (index: the memory's row; None: a finished stream's row that no new one
        took): made for the first streams, or with the free rows dropped and rows added as needed, grown
        where a new stream needs more slots; a new stream's row emptied."""
        running = [stream for stream in rows if stream is not None]
        longest = max(stream.tokens.numel() for stream in running)
        plan = (
            self.plan.recording.observed()
            if any(s.hooks.observer is not None for s in running)
            else self.plan.recording
        )
        if memory is None:
            memory = self.new_memory(longest, plan, rows=len(rows))
        else:
            if len(rows) > memory.rows:
                memory.add_rows(len(rows) - memory.rows)
            if len(running) < len(rows):
                memory.keep_rows([row for row, stream in enumerate(rows) if stream is not None])
        memory.grow(*plan.slots(longest))
        if plan.record_attention:
            memory.record_all_attention()
        for row, stream in enumerate(running):  # the rows, renumbered as the memory kept them
            if stream.row < 0:  # a new stream
                memory.reset_row(row)
            stream.row = row
        return memory

    def _pass(self, memory: SlotMemory, rows: list[_Stream]) -> None:
        """One forward pass of every row's next chunk, then each stream's decision."""
        start = self.clock.start()
        starts = [stream.schedule[stream.step][0] for stream in rows]
        lengths = [stream.next_length for stream in rows]
        if min(lengths) < max(lengths):
            self._check_padding(starts, lengths)
            padded = [s for s, n in zip(rows, lengths, strict=True) if n < max(lengths)]
            if self.facts.carried and any(s.step + 1 < len(s.schedule) for s in padded):
                raise UnsupportedModelError(
                    f"{self.facts.name} carries recurrent state, which padding a chunk "
                    "before a stream's last would change; stream its documents with batch=1"
                )
        position_ids = memory.begin_chunk(starts, lengths)  # [N, Q]
        width = max(lengths)
        tokens, targets = [], []
        for stream, first, length in zip(rows, starts, lengths, strict=True):
            at = [first + min(q, length - 1) for q in range(width)]  # a padded query repeats the last token
            tokens.append([stream.ids[p] for p in at])
            targets.append([stream.ids[min(p + 1, len(stream.ids) - 1)] for p in at])
        tokens_t = to_device(tokens, self.facts.device)
        targets_t = to_device(targets, self.facts.device)
        tracking = self.plan.recording.track_gradient
        # autograd only for a policy that needs the gradient utility, and only for this pass
        with torch.enable_grad() if tracking else contextlib.nullcontext():
            logits = self.forward(memory, tokens_t, position_ids)  # [N, Q, V]
            # in place unless autograd tracks it (out= is not differentiable): the logits are not kept
            log_probs = torch.log_softmax(logits, dim=-1, out=None if tracking else logits)
            token_nll = -log_probs.gather(-1, targets_t[..., None])[..., 0]  # [N, Q]
            scored = [
                min(first + length, stream.tokens.numel() - 1) - first
                for stream, first, length in zip(rows, starts, lengths, strict=True)
            ]
            if tracking:
                counted = (
                    torch.arange(width, device=self.facts.device)
                    < to_device(scored, self.facts.device)[:, None]
                )
                record_gradients(memory, (token_nll * counted).sum() if max(scored) > 0 else None)
        best, argmax, runner_up = top_two(log_probs.detach())  # how far the argmax is ahead of the runner-up
        outcome = (token_nll.detach(), argmax == targets_t, best - runner_up)
        memory.count_attended()
        self._decide(memory, rows, outcome, scored)
        self.clock.stop(start, [stream.time for stream in rows])

    def _decide(
        self,
        memory: SlotMemory,
        rows: list[_Stream],
        outcome: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scored: list[int],
    ) -> None:
        """After a pass: record each stream's outcomes (``outcome``: nll, correct, margin [N, Q]; the first
        ``scored[i]`` of row i have a target), let score-based policies observe their chunk, and at a
        boundary choose what every row keeps, then compact all rows at once."""
        plan = self.plan.recording
        _copy_all(
            (
                stream.outcome_slots(stream.schedule[stream.step][0], scored[i]),
                (x[i, : scored[i]] for x in outcome),
            )
            for i, stream in enumerate(rows)
        )
        views = [memory.row(i) for i in range(len(rows))]
        stops = self._observe(rows, views, outcome, scored)
        deciding = [i for i, stream in enumerate(rows) if not stream.done]
        if not deciding:
            return
        now = to_device(stops, self.facts.device)
        if plan.rule is None:
            keep = self._select(memory, rows, views, stops, deciding, now)
        else:
            keep = rule_keep(plan.rule, now, memory.chunk_key_pos())
            if plan.exempt:  # layers the rule leaves alone keep what their window shows
                exempt = to_device(plan.exempt, keep.device)[:, None, None, None]
                keep = torch.where(exempt, memory.alive(now), keep)
        evicted = memory.compact(keep, now)
        for i in deciding:
            if rows[i].hooks.on_boundary is not None:
                rows[i].hooks.on_boundary(views[i], stops[i], evicted[:, i, :, : views[i].n])

    def _observe(
        self,
        rows: list[_Stream],
        views: list[RowView],
        outcome: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scored: list[int],
    ) -> list[int]:
        """Step every stream past its chunk, call its chunk hooks and let a score-based policy observe its
        row's ``views``; returns each stream's stop (the position the chunk ends before)."""
        score_based = self.plan.recording.rule is None
        outcomes = (
            self._outcomes(outcome, scored) if score_based and "outcomes" in rows[0].policy.needs else None
        )
        stops = []
        for i, (stream, view) in enumerate(zip(rows, views, strict=True)):
            stop = stream.schedule[stream.step][1]
            stops.append(stop)
            stream.step += 1
            hooks, policy = stream.hooks, stream.policy
            if hooks.on_chunk is not None:
                hooks.on_chunk(stop, outcome[0][i, : scored[i]])
            if score_based:  # a score-based policy observes the chunk
                own = {} if outcomes is None else {k: v[i, : view.n_q] for k, v in outcomes.items()}
                stream.obs = Observation(
                    view.chunk_key_pos(),
                    view.query_pos,
                    **view.observed(policy.needs),
                    **own,
                    **self.plan.constants,
                )
                policy.observe(view.state_view(), stream.obs)
            if hooks.observer is not None:
                hooks.observer(view.chunk_attention(), view.chunk_key_pos(), view.query_pos)
        return stops

    def _outcomes(
        self, outcome: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scored: list[int]
    ) -> dict[str, torch.Tensor]:
        """Per-query outcomes [N, Q] a policy observes (``correct``, ``prob``, ``nll``), 0 for a query
        without a target (past the first ``scored[i]`` of row i)."""
        width = outcome[0].shape[1]
        device = self.facts.device
        targets = torch.arange(width, device=device) < to_device(scored, device)[:, None]
        nll = outcome[0].masked_fill(~targets, 0)
        return {"correct": (outcome[1] & targets).float(), "prob": torch.exp(-nll) * targets, "nll": nll}

    def _select(
        self,
        memory: SlotMemory,
        rows: list[_Stream],
        views: list[RowView],
        stops: list[int],
        deciding: list[int],
        now: torch.Tensor,
    ) -> torch.Tensor:
        """Score-based policies' keep mask [L, N, H, S] at the boundaries ``stops`` (``now`` [N]): each
        stream's policy scores its own row; selection, its margins and digests run once for the rows
        ``deciding`` (the others keep what they hold)."""
        valid = memory.alive(now)  # [L, N, H, S]: entries a layer's own window hides from now on are gone
        key_pos = torch.where(valid, memory.chunk_key_pos(), -1)
        width = valid.shape[-1]
        scores, bounds = [], []
        for i in deciding:
            stream, view = rows[i], views[i]
            obs = stream.obs
            obs.key_pos = key_pos[:, i, :, : view.n]  # no policy ranks what is gone
            score = stream.policy.score(view.state_view(), obs, stops[i])
            bounds.append(stream.policy.score_bounds(view.state_view(), obs, stops[i]))
            if stream.hooks.before_boundary is not None:
                stream.hooks.before_boundary(view, obs, stops[i], score)
            scores.append(torch.nn.functional.pad(score, (0, width - view.n)) if view.n < width else score)
        how = (self.options.scope, rows[deciding[0]].policy.scope_reduce, self.plan.floor)

        def decide(score: torch.Tensor, positions: torch.Tensor, alive: torch.Tensor):
            keep = select(score, positions, alive, self.plan.capacity, *how)
            return keep, decision_margin(score, positions, alive, keep, *how), kept_digest(keep, positions)

        if len(deciding) == len(rows):
            picked = (key_pos.movedim(1, 0), valid.movedim(1, 0))
        else:
            index = to_device(deciding, self.facts.device)
            picked = (
                key_pos.index_select(1, index).movedim(1, 0),
                valid.index_select(1, index).movedim(1, 0),
            )
        if len(deciding) == 1:
            keep, margin, digest = (x[None] for x in decide(scores[0], *(x[0] for x in picked)))
        else:  # one computation for every deciding row, each on its own [L, H, S]
            keep, margin, digest = torch.func.vmap(decide)(torch.stack(scores), *picked)
        margin = threshold_margins(margin, bounds, picked[1], keep, *how)  # lru's, the oracles' tau
        _copy_all((rows[i].decision_slots(stops[i]), (margin[j], digest[j])) for j, i in enumerate(deciding))
        if len(deciding) == len(rows):
            return keep.movedim(0, 1)
        full = valid.clone()
        full[:, index] = keep.movedim(0, 1)
        return full


def _copy_all(pairs: Iterable[tuple[Iterable[torch.Tensor], Iterable[torch.Tensor]]]) -> None:
    """Copy every source into its destination, (destinations, sources) per item, in one call per dtype
    (a stream's slices of a pass's batched outcomes into its own buffers)."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for destinations, sources in pairs:
        for destination, source in zip(destinations, sources, strict=True):
            if destination.numel():
                into, out = groups.setdefault(destination.dtype, ([], []))
                into.append(destination)
                out.append(source)
    for into, out in groups.values():
        torch._foreach_copy_(into, out)


# top_two on a CPU: the width of the blocks whose maxima are taken in one vectorised pass
TOP_TWO_BLOCK = 1024


def top_two(x: torch.Tensor, block: int = TOP_TWO_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The largest entry of ``x`` [..., V] along its last dim, its index and the runner-up value, each
    [...] (``x.topk(2)``; which index an exact tie for the largest reports is unspecified, as in topk).

    On a CPU, where ``topk`` is not vectorised, from the maxima of blocks of ``block`` entries (one pass
    over ``x``), then ``topk`` over the ``block`` entries that hold the largest: the runner-up is the
    larger of the second entry there and the best other block."""
    n_blocks = x.shape[-1] // block
    if x.device.type != "cpu" or n_blocks < 2:
        top = x.topk(2, dim=-1)
        return top.values[..., 0], top.indices[..., 0], top.values[..., 1]
    width = n_blocks * block
    maxima = x[..., :width].unflatten(-1, (n_blocks, block)).amax(dim=-1)  # [..., n_blocks]
    if width < x.shape[-1]:  # the last entries, a shorter block
        maxima = torch.cat([maxima, x[..., width:].amax(dim=-1, keepdim=True)], dim=-1)
    best_blocks = maxima.topk(2, dim=-1)
    # the block of entries holding the largest (the last block ends at V: it may overlap the one before,
    # whose entries are all at most the best other block's maximum)
    start = (best_blocks.indices[..., :1] * block).clamp_max(x.shape[-1] - block)  # [..., 1]
    inner = x.gather(-1, start + torch.arange(block, device=x.device))  # [..., block]
    top = inner.topk(2, dim=-1)
    runner_up = torch.maximum(top.values[..., 1], best_blocks.values[..., 1])
    return top.values[..., 0], start[..., 0] + top.indices[..., 0], runner_up


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
    """One stream's state while it runs: its row of the memory, chunk schedule, outcomes so far."""

    def __init__(self, engine: StreamingEngine, request: StreamRequest, index: int):
        self.index, self.policy, self.hooks = index, request.policy, request.hooks
        self.tokens = request.tokens
        self.ids: list[int] = request.tokens.tolist()  # read on the host to build each pass's batch
        n = self.tokens.numel()
        plan = engine.plan.recording if request.hooks.observer is None else engine.plan.recording.observed()
        self.schedule = engine.chunks(n, plan)
        self.step = 0
        self.row = -1  # its row in the memory (set when the memory takes it)
        self.obs: Observation | None = None  # the observation of its last chunk
        self.nll = torch.empty(n - 1, device=engine.facts.device)
        self.correct = torch.empty(n - 1, dtype=torch.bool, device=engine.facts.device)
        self.margin = torch.empty(n - 1, device=engine.facts.device)
        # per decision (at most one per chunk boundary), kept on the device until the end
        self.boundaries: list[int] = []
        self.decisions = torch.empty(len(self.schedule), *engine.facts.shape[:2], device=engine.facts.device)
        self.digests = torch.empty(self.decisions.shape, dtype=torch.long, device=engine.facts.device)
        self.time = StreamTime()  # its share of its passes' wall time

    @property
    def done(self) -> bool:
        return self.step == len(self.schedule)

    @property
    def next_length(self) -> int:
        start, stop = self.schedule[self.step]
        return stop - start

    def outcome_slots(self, start: int, n_scored: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the NLL, correctness and margin [Q'] of the chunk starting at ``start`` go (Q' scored
        queries)."""
        stop = start + n_scored
        return self.nll[start:stop], self.correct[start:stop], self.margin[start:stop]

    def decision_slots(self, now: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the margin [L, H] and the kept sets' digests [L, H] of the decision at ``now`` go."""
        k = len(self.boundaries)
        self.boundaries.append(now)
        return self.decisions[k], self.digests[k]

    def result(self, memory: SlotMemory) -> StreamResult:
        """The finished stream's result; its totals are read from its row of ``memory`` (one read)."""
        attended, age_sum, n_evicted = memory.totals[self.row].tolist()
        k = len(self.boundaries)
        return StreamResult(
            self.nll.float().cpu(),
            self.correct.cpu(),
            attended,
            age_sum,
            int(n_evicted),
            self.margin.float().cpu(),
            torch.tensor(self.boundaries, dtype=torch.long),
            self.decisions[:k].float().cpu(),
            self.digests[:k].cpu(),
            getattr(self.policy, "score_digits", None),
        )
