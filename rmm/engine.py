"""The streaming engine: one document, chunk by chunk, through a causal LM with a bounded memory.

After every chunk a score-based policy observes what the chunk recorded; at a boundary the engine runs
score -> select (:mod:`rmm.policies.select`) -> :meth:`~rmm.memory.SlotMemory.compact`. Which buffers
the memory holds is the stream's :class:`~rmm.recording.RecordingPlan`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from rmm import integration, selfcheck
from rmm.memory import SlotMemory
from rmm.models import UnsupportedModelError, describe_model
from rmm.policies import Observation, Policy, ScorePolicy
from rmm.policies.select import SCOPES, adaptive_floor, capacities, check_allocation, rule_keep, select
from rmm.recording import RecordingPlan, recording_plan
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
    """

    nll: torch.Tensor
    correct: torch.Tensor
    attended_total: float
    evicted_age_sum: float
    evicted_count: int


class StreamingEngine:
    """Streams token sequences through ``model`` under ``policy`` with budget B and chunk C.

    ``allocation`` (``uniform``, ``adaptive`` or ``pyramid``) splits the budget across KV heads and
    layers (:mod:`rmm.policies.select`, docs/semantics.md); the capacities are computed once here.

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
    ):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        check_allocation(allocation, scope, positions, policy)
        check_layers(layers, allocation)
        if allocation != "uniform" and policy.budget is None:
            raise ValueError(f"allocation={allocation} needs a budget: set budget, or allocation=uniform")
        self.plan = recording_plan(policy, positions)
        integration.check_model(model, positions)
        self.windows = integration.layer_windows(model)  # per layer: past entries its window shows, or None
        check_windows(model, self.windows, policy, scope)
        dims = describe_model(model)
        self.shape = (dims["n_layers"], dims["n_kv_heads"], dims["head_dim"])
        if allocation != "uniform":  # R: the largest per-head capacity
            self.plan = recording_plan(policy, positions, allocation, self.shape[:2])
        if layers == "global" and policy.budget is not None:
            self.plan = self.plan.exempting(self.windows)
        self.model, self.policy, self.positions, self.scope = model, policy, positions, scope
        self.allocation, self.layers = allocation, layers
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
            per_layer = torch.tensor([self.plan.capacity if e else policy.capacity for e in self.plan.exempt])
            self.capacity = per_layer[:, None].expand(self.shape[:2]).clone()
        if isinstance(self.capacity, torch.Tensor):
            self.capacity = self.capacity.to(self.device)
        self.dtype = next(model.parameters()).dtype
        self.rotary = Rotary(model).to(self.device)
        if not self.rotary.candidates and selfcheck.moves_positions(self.plan):
            raise UnsupportedModelError(
                f"{integration.describe(model)} has no rotary position embedding (no `inv_freq` buffer), so "
                f"its keys cannot move to other positions, which positions={positions} with policy "
                f"{policy.name} needs; use positions=original with a policy that reads no keys or queries"
            )
        self.max_positions = None if self.rotary.candidates else dims["max_position_embeddings"]
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
            raise UnsupportedModelError(
                f"{integration.describe(self.model)} has learned absolute positions up to "
                f"{self.max_positions}, but a stream has {tokens.numel()} tokens; cut the documents "
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

    def forward(self, memory: SlotMemory, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One pass of the chunk ``tokens`` [Q] at ``position_ids`` [Q] over ``memory``: logits [Q, V]
        (float32). The model's attention must be the bounded attention (:func:`rmm.integration.install`)."""
        with integration.active(memory):  # the attention function finds the memory there, not in kwargs
            out = self.model(input_ids=tokens[None], position_ids=position_ids[None], use_cache=False)
        return out.logits[0].float()

    def new_memory(self, n_tokens: int, plan: RecordingPlan) -> SlotMemory:
        retained, chunk = plan.slots(n_tokens)
        return SlotMemory(plan, self.shape, retained, chunk, self.rotary, self.dtype, self.device)

    @torch.no_grad()
    def stream(
        self,
        tokens: torch.Tensor,
        observer: AttentionObserver | None = None,
        before_boundary: DecisionHook | None = None,
        on_boundary: BoundaryHook | None = None,
        on_chunk: ChunkHook | None = None,
    ) -> StreamResult:
        """Score every next-token prediction of ``tokens`` [n] (n >= 2)."""
        n = tokens.numel()
        if n < 2:
            raise ValueError(f"a stream needs at least 2 tokens to score one prediction, got {n}")
        self.self_check(tokens)
        with integration.install(self.model):
            return self._stream(tokens.to(self.device), observer, before_boundary, on_boundary, on_chunk)

    def _stream(
        self,
        tokens: torch.Tensor,
        observer: AttentionObserver | None,
        before_boundary: DecisionHook | None,
        on_boundary: BoundaryHook | None,
        on_chunk: ChunkHook | None,
    ) -> StreamResult:
        n = tokens.numel()
        policy = self.policy
        plan = self.plan if observer is None else self.plan.observed()
        memory = self.new_memory(n, plan)
        nll = torch.empty(n - 1, device=self.device)
        correct = torch.empty(n - 1, dtype=torch.bool, device=self.device)
        attended, age_sum, n_evicted = 0.0, 0.0, 0
        for start, stop in self.chunks(n, plan):
            query_pos = torch.arange(start, stop, device=self.device)
            position_ids = memory.begin_chunk(query_pos)
            n_scored = min(stop, n - 1) - start
            targets = tokens[start + 1 : start + 1 + n_scored]
            # autograd only for a policy that needs the gradient utility, and only for this pass
            with torch.enable_grad() if memory.track_gradient else contextlib.nullcontext():
                logits = self.forward(memory, tokens[start:stop], position_ids)  # [Q, V]
                log_probs = torch.log_softmax(logits[:n_scored], dim=-1)
                token_nll = -log_probs.gather(-1, targets[:, None])[:, 0]
                if memory.track_gradient:
                    memory.record_gradient(token_nll.sum() if n_scored else None)
            token_nll, log_probs = token_nll.detach(), log_probs.detach()
            token_correct = log_probs.argmax(dim=-1) == targets
            nll[start : start + n_scored] = token_nll
            correct[start : start + n_scored] = token_correct
            attended += memory.attended_total()
            if on_chunk is not None:
                on_chunk(stop, token_nll)
            obs = None
            if plan.rule is None:  # a score-based policy observes the chunk
                outcomes = {}
                if "outcomes" in policy.needs:
                    outcomes = _outcomes(query_pos, token_nll, token_correct)
                observed = memory.observed(policy.needs)
                obs = Observation(memory.chunk_key_pos(), query_pos, **observed, **outcomes, **self.constants)
                policy.observe(memory.state_view(), obs)
            if observer is not None:
                observer(memory.chunk_attention(), memory.chunk_key_pos(), query_pos)
            if stop < n:
                key_pos = memory.chunk_key_pos()
                if obs is not None:
                    # entries a layer's own window hides from now on are gone: no policy ranks them
                    valid = memory.alive(stop)
                    obs.key_pos = key_pos = torch.where(valid, key_pos, -1)
                    scores = policy.score(memory.state_view(), obs, stop)
                    if before_boundary is not None:
                        before_boundary(memory, obs, stop, scores)
                    keep = select(
                        scores, key_pos, valid, self.capacity, self.scope, policy.scope_reduce, self.floor
                    )
                else:
                    keep = rule_keep(plan.rule, stop, key_pos)
                    if plan.exempt:  # layers the rule leaves alone keep what their window shows
                        exempt = torch.tensor(plan.exempt, device=keep.device)[:, None, None]
                        keep = torch.where(exempt, memory.alive(stop), keep)
                evicted = memory.compact(keep)
                evicted_pos = evicted[evicted >= 0]
                age_sum += float((stop - evicted_pos).sum())
                n_evicted += evicted_pos.numel()
                if on_boundary is not None:
                    on_boundary(memory, stop, evicted)
        return StreamResult(nll.float().cpu(), correct.cpu(), attended, age_sum, n_evicted)


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
