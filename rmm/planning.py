"""Planning a stream: what a policy under given options may do on a model, read once into
:class:`~rmm.facts.ModelFacts` (:func:`plan_stream`: every check, the recording plan, the per-head
capacities, the adaptive floor and the model constants the policy reads), so that
:class:`~rmm.engine.StreamingEngine` only assembles what the plan says. The checks that need only a config
run before the weights load too (rmm/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rmm import integration
from rmm.errors import UnsupportedModelError
from rmm.facts import ModelFacts
from rmm.model_config import ConfigFacts
from rmm.options import StreamOptions
from rmm.policies import Policy, PositionRule, ScorePolicy
from rmm.policies.select import adaptive_floor, capacities, check_allocation, check_positions, retained_slots
from rmm.recording import RecordingPlan


@dataclass(frozen=True)
class StreamPlan:
    """What a stream of ``policy`` under ``options`` on a model holds and how it decides.

    recording : which buffers the memory holds (:class:`~rmm.recording.RecordingPlan`); capacity : the
    retained entries per (layer, KV head), an int for all, a [L, H] tensor where they differ (an
    allocation, or windowed layers the policy leaves alone), None for a position rule or no budget;
    floor : the adaptive allocation's least per head (None otherwise); constants : the model constants the
    policy declares in its ``needs``, read once and handed to every observation (``output_projection``:
    W_o per layer and head, :func:`rmm.integration.output_projections`; ``rotary``: the model's
    rotations, calibrated in place by the self-check)."""

    recording: RecordingPlan
    capacity: int | torch.Tensor | None
    floor: int | None
    constants: dict[str, object]


def plan_stream(policy: Policy, options: StreamOptions, facts: ModelFacts) -> StreamPlan:
    """Check that ``policy`` under ``options`` can run exactly on the model of ``facts`` (raises ValueError
    or :class:`~rmm.errors.UnsupportedModelError` naming the fix) and plan its stream."""
    positions, scope, allocation = options.positions, options.scope, options.allocation
    check_windows(facts.name, facts.windows, policy, scope)
    check_stated(facts.stated, policy, options)
    check_carried(facts.name, facts.carried, policy, scope)
    # R is the largest per-head capacity under an allocation, and the widest window of a layer the policy
    # leaves alone (layers=global)
    recording = recording_plan(policy, positions, allocation, facts.shape[:2], scope)
    bounded = policy.budget is not None and recording.rule is None  # a score-based policy under a budget
    capacity: int | torch.Tensor | None = policy.capacity if bounded else None
    floor = None
    if bounded and allocation == "pyramid":
        capacity = capacities(allocation, policy.capacity, policy.always_kept, *facts.shape[:2])
    elif bounded and allocation == "adaptive":
        floor = adaptive_floor(policy.capacity)
    if allocation != "uniform" and policy.budget is None:
        raise ValueError(f"allocation={allocation} needs a budget: set budget, or allocation=uniform")
    integration.check_positions(facts.model, positions)
    if options.layers == "global" and policy.budget is not None:
        recording = recording.exempting(facts.windows)
    if facts.stated.keep_window is not None:  # the model would select keys within a longer pass by itself
        recording = replace(recording, pass_limit=facts.stated.keep_window)
    if not facts.rotary.candidates and recording.moves_positions:
        raise UnsupportedModelError(
            f"{facts.name} has no rotary position embedding (no `inv_freq` buffer, nor a sin/cos table in a "
            "rotary module), so its keys cannot move to other positions, which "
            f"positions={positions} with policy {policy.name} needs; use positions=original with a "
            "policy that reads no keys or queries"
        )
    if bounded and recording.exempt:  # a windowed layer keeps all its window shows
        per_layer = torch.tensor([recording.retained if e else policy.capacity for e in recording.exempt])
        capacity = per_layer[:, None].expand(facts.shape[:2]).clone()
    if isinstance(capacity, torch.Tensor):
        capacity = capacity.to(facts.device)
    needs, constants = getattr(policy, "needs", ()), {}
    if "output_projection" in needs:
        constants["output_projection"] = integration.output_projections(facts.model).to(facts.device)
    if "rotation" in needs:
        constants["rotary"] = facts.rotary
    return StreamPlan(recording, capacity, floor, constants)


def recording_plan(
    policy: Policy,
    positions: str,
    allocation: str = "uniform",
    shape: tuple[int, int] | None = None,
    scope: str = "head",
) -> RecordingPlan:
    """The recording plan of ``policy`` under ``positions`` (``original`` or ``cache``) and the budget
    ``allocation`` over ``shape`` = (n_layers, n_kv_heads) (needed unless ``allocation`` is uniform), after
    refusing what the policy cannot do under these and ``scope``."""
    check_allocation(allocation, scope, positions, policy)
    check_positions(policy, positions)
    retained = None if policy.budget is None else policy.capacity
    if isinstance(policy, PositionRule):
        return RecordingPlan(
            rule=policy.allowed,
            retained=retained,
            decision_chunk=policy.chunk,
            record_attention=False,
            record_queries=False,
            raw_keys=False,
            store_unrotated=False,
            track_gradient=False,
            n_sink_slots=policy.sink_positions if positions == "cache" else 0,
            sink_rank=policy.budget,
            state_names=(),
        )
    if not isinstance(policy, ScorePolicy):
        raise TypeError(f"{type(policy).__name__} must derive from PositionRule or ScorePolicy")
    if retained is not None and allocation != "uniform":
        if shape is None:
            raise ValueError(f"allocation={allocation} needs the model's (n_layers, n_kv_heads)")
        retained = retained_slots(allocation, retained, policy.always_kept, *shape)
    needs = policy.needs
    store_unrotated = positions == "cache"
    return RecordingPlan(
        rule=None,
        retained=retained,
        decision_chunk=policy.chunk,
        # the gradient utility is built from the attention probabilities
        record_attention=bool({"attention", "gradient"} & needs),
        record_queries="queries" in needs,
        # a policy that reads the keys as cached reads the memory's own (rotated) keys
        raw_keys="keys" in needs and not store_unrotated and not policy.cached_keys,
        store_unrotated=store_unrotated,
        track_gradient="gradient" in needs,
        n_sink_slots=0,
        sink_rank=policy.budget,
        state_names=tuple(policy.state_names),
    )


def layer_entries(
    budget: int, windows: list[int | None], exempt: tuple[bool, ...], attending: list[bool] | None = None
) -> list[int]:
    """Past entries each layer holds at most: B, or min(B, w) for a layer whose window shows w past entries
    (its budget beyond w is never used), or w for a windowed layer the policy leaves alone; 0 for a layer
    that does not attend (``attending``: per layer; default every layer attends)."""
    return [
        0
        if attending is not None and not attending[layer]
        else budget
        if w is None
        else (w if exempt and exempt[layer] else min(budget, w))
        for layer, w in enumerate(windows)
    ]


def check_stated(facts: ConfigFacts, policy: Policy, options: StreamOptions) -> None:
    """Refuse what ``policy`` under ``options`` cannot honour on a model by what its config states
    (``facts``): the runner runs this before the weights load, :func:`plan_stream` again on the model's."""
    check_keep_window(facts.keep_window, facts.name, policy)
    check_latent(facts.latent, facts.name, policy, options.scope)
    check_layer_shapes(facts.name, policy, options.allocation, facts.layer_shapes)
    check_shared(facts.name, facts.sources, policy, options.scope, options.allocation)


def check_keep_window(window: int | None, name: str, policy: Policy) -> None:
    """Refuse a chunk longer than the keep window W of a model with a bias per key (``window``:
    :func:`rmm.model_config.key_bias_window`): the model would select keys within the chunk itself."""
    if window is not None and policy.chunk > window:
        raise ValueError(
            f"{name} lets each query attend only the {window} keys of largest bias (its keep window), and a "
            f"chunk of {policy.chunk} tokens would have it select keys within the chunk itself; use chunk <= "
            f"{window}"
        )


def check_carried(name: str, carried: list[int], policy: Policy, scope: str) -> None:
    """Refuse what a model ``name`` with recurrent or convolutional mixers (``carried``: their layers)
    cannot do with a score-based policy: one set across all layers (``scope=global``; its mixers hold no
    entries), or the gradient utility (the reference does not carry a hybrid model's state through it)."""
    if not carried or not isinstance(policy, ScorePolicy):
        return
    if scope == "global":
        raise UnsupportedModelError(
            f"{name} has layers that hold no attention entries (recurrent or convolutional mixers), so one "
            "set cannot be shared across all layers; use scope=head or scope=layer"
        )
    if "gradient" in policy.needs:
        raise UnsupportedModelError(
            f"the gradient utility (rmm's weight=gradient) on {name}, whose mixers carry state across "
            "chunks, is not checked against the reference; use another weight"
        )


# what a policy may read (its ``needs``) that multi-head latent attention's own cache does not hold
PER_HEAD_ENTRIES = frozenset({"keys", "values", "output_projection"})


def check_latent(latent: bool, name: str, policy: Policy, scope: str) -> None:
    """Refuse what a score-based policy cannot honour under multi-head latent attention (a model ``name``
    whose config says so: ``latent``), whose own cache keeps one latent per token and layer that every head
    expands into its own key and value: sets per head (``scope=head``: the latents kept would be the union
    of the heads' sets, so the budget would bound nothing the model stores), and policies that read the
    expanded per-head keys or values (the model never stores them, and the reference, which holds the
    latents, has no rule for them). Needs the config only: the runner calls it before the weights load."""
    if not isinstance(policy, ScorePolicy) or not latent:
        return
    if scope == "head":
        raise UnsupportedModelError(
            f"{name} uses multi-head latent attention: its cache keeps one latent per token and layer for "
            "all heads, so sets chosen per head (scope=head) would keep the union of the heads' sets and "
            "the budget would not bound what the model stores; use scope=layer or scope=global"
        )
    reads = sorted(PER_HEAD_ENTRIES & set(policy.needs))
    if reads:
        raise UnsupportedModelError(
            f"policy {policy.name} reads {', '.join(reads)}, but {name} uses multi-head latent attention, "
            "whose cache holds a latent per token, not the per-head keys and values transformers expands "
            "from it (no reference rule reads those); use a policy that reads attention or positions only"
        )


# what a policy may read that the memory holds padded to the widest layer under per-layer shapes
PADDED_ENTRIES = frozenset({"keys", "values", "queries", "output_projection", "gradient"})


def check_layer_shapes(
    name: str, policy: Policy, allocation: str, shapes: list[tuple[int, int, int]] | None
) -> None:
    """Refuse what a score-based policy cannot honour on a model ``name`` whose layers differ in shape
    (``shapes``: per layer (KV heads, key and value head dimensions), :func:`~rmm.model_config.layer_shapes`
    where the config states them, which the runner checks before the weights load; the model's facts,
    which may read them from its modules). The memory holds every layer at the widest layer's KV heads
    and head dimension, zero-padded, so policies that read keys, values, queries, W_o or gradients (no
    reference rule checks them there) are refused, and so is ``allocation=adaptive`` where the layers'
    KV heads differ (its room per layer counts every head)."""
    if not isinstance(policy, ScorePolicy):
        return
    if shapes is None:
        return
    reads = sorted(PADDED_ENTRIES & set(policy.needs))
    if reads:
        raise UnsupportedModelError(
            f"policy {policy.name} reads {', '.join(reads)}, but {name} has per-layer head shapes, which the "
            "slot memory holds zero-padded to the widest layer (no reference rule reads them there); use a "
            "policy that reads attention or positions only"
        )
    if allocation == "adaptive" and len({shape[0] for shape in shapes}) > 1:
        raise UnsupportedModelError(
            f"{name} has layers with different numbers of KV heads, but allocation=adaptive gives each layer "
            "room for every head the memory holds; use allocation=uniform or pyramid"
        )


# what a layer that reads another layer's keys and values (KV sharing) cannot give a policy of that layer
SHARED_UNREAD = frozenset({"queries", "output_projection", "gradient"})


def check_shared(name: str, sources: list[int], policy: Policy, scope: str, allocation: str) -> None:
    """Refuse what a score-based policy cannot honour under KV sharing (``sources``: per layer, the layer
    whose keys and values it attends, :func:`~rmm.model_config.kv_sources`). The memory stores a shared entry
    once, in the layer that stores it, and evicts it once, by that layer's statistics, into which every
    layer that reads it adds its attention; a reading layer holds nothing. So one set across all layers
    (``scope=global``) and a non-uniform allocation (which give reading layers room) are refused, and so
    are policies that read queries, W_o or gradients (a reading layer's own, for another layer's entries)."""
    readers = [layer for layer, source in enumerate(sources) if source != layer]
    if not readers or not isinstance(policy, ScorePolicy):
        return
    where = f"{name} shares keys and values across layers (layers {readers[0]}-{readers[-1]} read others')"
    if scope == "global" or allocation != "uniform":
        raise UnsupportedModelError(
            f"{where}, which hold no entries of their own, so scope={scope} with allocation={allocation} "
            "would count them; use scope=head or scope=layer with allocation=uniform"
        )
    reads = sorted(SHARED_UNREAD & set(policy.needs))
    if reads:
        raise UnsupportedModelError(
            f"{where}; policy {policy.name} reads {', '.join(reads)}, which a reading layer has for another "
            "layer's entries (no reference rule reads them there); use a policy that reads attention, keys, "
            "values or positions"
        )


def check_windows(name: str, layer_windows: list[int | None], policy: Policy, scope: str) -> None:
    """Refuse what a model ``name``'s own windows (sliding or chunked layers) and a score-based policy
    cannot do together: one set shared across layers (``scope=global``), or a policy that reads entries
    further back than a window keeps them (its ``lookback``)."""
    windows = [w for w in layer_windows if w is not None]
    if not windows or not isinstance(policy, ScorePolicy):
        return
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
