"""What the engine reads of a loaded model once (:class:`ModelFacts`): its stated config, description,
windows, attending and carried layers, layer shapes, rotary and maximum positions."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from rmm import integration
from rmm.model_config import ConfigFacts, config_facts, describe_model
from rmm.rotary import Rotary


@dataclass
class ModelFacts:
    """What the engine reads of ``model`` once.

    stated : what its text config states (:class:`~rmm.model_config.ConfigFacts`, with the per-layer
    shapes read from its modules where the config states none); dims :
    :func:`rmm.model_config.describe_model`; windows : per layer, the past entries its own window shows
    (None: all); attending : per layer, whether it attends; carried : layers with recurrent or
    convolutional state; rotary : its rotations (calibrated in place by the self-check); max_positions :
    the positions a stream may reach (a rotary table's rows, or learned absolute positions; None:
    unbounded); vocab : the token ids its input embedding has rows for (None: not read); device, dtype :
    its parameters'.
    """

    model: PreTrainedModel
    stated: ConfigFacts
    dims: dict[str, Any]
    windows: list[int | None]
    attending: list[bool]
    carried: list[int]
    rotary: Rotary
    max_positions: int | None
    vocab: int | None
    device: torch.device
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.stated.name

    @property
    def config(self) -> PretrainedConfig:
        return self.stated.config

    @property
    def sources(self) -> list[int]:
        """Per layer, the layer whose keys and values it attends (itself, or under KV sharing the one that
        stores them)."""
        return self.stated.sources

    @property
    def layer_shapes(self) -> list[tuple[int, int, int]] | None:
        """Per layer (KV heads, key and value head dimensions) where layers differ (None: one shape)."""
        return self.stated.layer_shapes

    @property
    def holds(self) -> list[bool]:
        """Per layer, whether it holds entries: it attends, over its own keys and values (not another
        layer's, KV sharing)."""
        return [a and s == i for i, (a, s) in enumerate(zip(self.attending, self.sources, strict=True))]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, key head dimension) of the memory (the widest layer's where layers differ)."""
        return self.dims["n_layers"], self.dims["n_kv_heads"], self.dims["head_dim"]


def model_facts(model: PreTrainedModel) -> ModelFacts:
    """Read ``model`` once (:class:`ModelFacts`), after refusing a model whose config says the bounded
    attention cannot reproduce it (:func:`rmm.integration.check_model`)."""
    dims = describe_model(model)  # one number of layers, heads and head dimension, or refused
    config = model.config.get_text_config()
    facts = config_facts(config, integration.name_of(model))
    integration.check_model(model)
    shapes = None
    if facts.layer_shapes is None and not facts.latent:  # shapes the config does not state (MiMo-V2-Flash)
        stated = (dims["n_kv_heads"], dims["head_dim"], dims["value_head_dim"])
        shapes = integration.module_shapes(model, stated)
    attends = set(integration.attention_layers(model))
    windows, carried = integration.layer_windows(model), integration.carried_layers(model)
    device = next(model.parameters()).device
    rotary = Rotary(model).to(device)
    if shapes is not None:
        widest = (max(shape[i] for shape in shapes) for i in range(3))
        dims = dims | dict(zip(("n_kv_heads", "head_dim", "value_head_dim"), widest, strict=True))
        facts = replace(facts, layer_shapes=shapes)
    return ModelFacts(
        model=model,
        stated=facts,
        dims=dims,
        windows=windows,
        attending=[layer in attends for layer in range(config.num_hidden_layers)],
        carried=carried,
        rotary=rotary,
        max_positions=rotary.max_positions if rotary.candidates else dims["max_position_embeddings"],
        vocab=_vocabulary(model),
        device=device,
        dtype=next(model.parameters()).dtype,
    )


def _vocabulary(model: PreTrainedModel) -> int | None:
    """The rows of ``model``'s input embedding (None where the model has no embedding module to read)."""
    try:
        embedding = model.get_input_embeddings()
    except NotImplementedError:
        return None
    return getattr(embedding, "num_embeddings", None)
