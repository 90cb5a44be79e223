"""What a model's (text) config states, read without its weights (the runner refuses from these before
the weights load; :func:`rmm.facts.model_facts` reads them again from the loaded model): its attention
heads, multi-head latent attention, per-layer head shapes, KV sharing across layers and a keep window over a
bias per key, gathered in :class:`ConfigFacts`; and the one number of layers, heads and head dimension the
memory is sized by (:func:`describe_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from rmm.errors import UnsupportedModelError


@dataclass(frozen=True)
class ConfigFacts:
    """What a model's (text) ``config`` states. name : how errors name it; latent : multi-head latent
    attention (:func:`latent_attention`); layer_shapes : per layer (KV heads, key and value head dimensions)
    where layers differ (:func:`layer_shapes`; None: one shape); sources : per layer, the layer whose keys
    and values it attends (:func:`kv_sources`); keep_window : the keep window over a bias per key
    (:func:`key_bias_window`; None: no bias per key)."""

    name: str
    config: PretrainedConfig
    latent: bool
    layer_shapes: list[tuple[int, int, int]] | None
    sources: list[int]
    keep_window: int | None


def config_facts(config: PretrainedConfig, name: str) -> ConfigFacts:
    """The facts of a model ``name`` of (text) ``config``, after refusing one that states no attention heads
    (:func:`check_attention_heads`)."""
    check_attention_heads(config, name)
    return ConfigFacts(
        name=name,
        config=config,
        latent=latent_attention(config),
        layer_shapes=layer_shapes(config),
        sources=kv_sources(config),
        keep_window=key_bias_window(config),
    )


def latent_attention(config: PretrainedConfig) -> bool:
    """Whether a (text) config describes multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, Kimi):
    one latent per token and layer (``kv_lora_rank`` channels and a shared rotated key part of
    ``qk_rope_head_dim``), expanded into per-head keys and values of other head dimensions."""
    return bool(getattr(config, "kv_lora_rank", None)) and bool(getattr(config, "qk_nope_head_dim", None))


def layer_shapes(config: PretrainedConfig) -> list[tuple[int, int, int]] | None:
    """Each layer's (KV heads, key head dimension, value head dimension) where a heterogeneous (text)
    config keeps them per layer (``per_layer_config``: Gemma 4's full-attention layers have wider heads
    and, with ``attention_k_eq_v``, fewer KV heads); None when every layer has the config's one shape."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    if not {"head_dim", "num_key_value_heads"} & set(config.per_layer_attributes or ()):
        return None
    shapes = []
    for layer in config.per_layer_config:
        n_kv = getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
        shapes.append((int(n_kv), int(head_dim), int(head_dim)))
    return shapes


def kv_sources(config: PretrainedConfig) -> list[int]:
    """Per layer, the layer whose keys and values it attends: itself, or under KV sharing (Gemma 3n and
    Gemma 4's last ``num_kv_shared_layers``, ``kv_sharing_modes`` "reuse") the earlier layer of its type
    that stores them ("store"). Raises :class:`UnsupportedModelError` for a reading layer with no such
    layer (every layer shared: the keys and values come from another model)."""
    n_layers = config.num_hidden_layers
    modes = (
        getattr(config, "kv_sharing_modes", None) if getattr(config, "num_kv_shared_layers", 0) else None
    ) or []
    stores = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    sources = list(range(n_layers))
    for layer, mode in enumerate(modes):
        if mode != "reuse":
            continue
        source = stores.get(config.layer_types[layer])
        if source is None or source >= layer:
            raise UnsupportedModelError(
                f"layer {layer} ({config.model_type}) attends keys and values that no earlier layer of its "
                "type stores (KV sharing across models: an assistant reads its target's); not supported"
            )
        sources[layer] = source
    return sources


def check_attention_heads(config: PretrainedConfig, name: str) -> None:
    """Refuse a (text) config that states no attention heads (``num_attention_heads``): a model without
    attention layers (Mamba, RWKV, xLSTM: recurrent or state-space layers only), or one whose attention
    layers are split over sub-models of their own (BLT's byte-level encoder, patch transformer and decoder,
    each a sub-config with its own layers and heads)."""
    try:
        if config.num_attention_heads is not None:
            return
    except AttributeError:
        pass
    except Exception:  # transformers gives no global value of a per-layer attribute: heads per layer
        return
    stacks = sorted(key for key in getattr(config, "sub_configs", None) or {} if _has_heads(config, key))
    if stacks:
        raise UnsupportedModelError(
            f"{name} splits its attention layers over sub-models with their own layers and heads "
            f"({', '.join(stacks)}) and states none for the model itself (BLT: a local encoder and decoder "
            "over bytes, a global transformer over the patches an entropy model forms in each pass, "
            "cross-attention between bytes and patches); the slot memory holds one stack of self-attention "
            "layers over the stream's tokens, so this model is not supported"
        )
    kinds = sorted(set(getattr(config, "layer_types", None) or []))
    raise UnsupportedModelError(
        f"{name} has no attention layers, so it keeps no KV cache and there is nothing for a KV eviction "
        "policy to bound: its config states no attention heads (num_attention_heads)"
        + (f", its layer types are {', '.join(kinds)}" if kinds else "")
        + " (recurrent or state-space layers, as Mamba's, RWKV's and xLSTM's, whose state does not grow "
        "with the stream)"
    )


def _has_heads(config: PretrainedConfig, key: str) -> bool:
    return getattr(getattr(config, key, None), "num_attention_heads", None) is not None


def key_bias_window(config: PretrainedConfig) -> int | None:
    """The keep window W of a model that adds a learned bias per key and KV head, computed from that
    token's values, to every attention logit, and lets each query attend only the W keys of largest bias
    that it sees (Doge's dynamic mask, ``keep_window_size``); None for any other model."""
    window = getattr(config, "keep_window_size", None)
    return int(window) if window else None


def describe_model(model: PreTrainedModel) -> dict[str, Any]:
    """Shape facts the engine needs for its memory and KV-bytes accounting, read from the (text) config.

    ``n_kv_heads`` and ``head_dim`` are those of the keys the attention function receives, and
    ``value_head_dim`` of its values. Under multi-head latent attention (:func:`latent_attention`) those
    are the per-head keys (``qk_nope_head_dim + qk_rope_head_dim``) and values (``v_head_dim``) that the
    model expands from its latents for every query head, and ``latent_dim`` is what its own cache keeps
    per token and layer (``kv_lora_rank + qk_rope_head_dim``; None for other models).

    Where the config keeps shapes per layer (:func:`layer_shapes`) they are the widest layer's, which the
    slot memory holds every layer in.

    Raises :class:`UnsupportedModelError` when the config states no attention heads
    (:func:`check_attention_heads`) or not one number of layers, heads, KV heads and head dimension.
    """
    config = model.config.get_text_config()
    check_attention_heads(config, f"{type(model).__name__} ({config.model_type})")
    try:
        n_heads = config.num_attention_heads
        per_layer = layer_shapes(config)
        if per_layer is not None:
            n_kv, head_dim, value_dim = (max(shape[i] for shape in per_layer) for i in range(3))
            latent_dim = None
        elif latent_attention(config):
            n_kv = n_heads
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            value_dim = config.v_head_dim
            latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
        else:
            n_kv = getattr(config, "num_key_value_heads", None) or n_heads
            head_dim = value_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
            latent_dim = None
        positions = getattr(config, "max_position_embeddings", None)
        return {
            "n_layers": config.num_hidden_layers,
            "n_heads": n_heads,
            "n_kv_heads": n_kv,
            "head_dim": head_dim,
            "value_head_dim": value_dim,
            "latent_dim": latent_dim,
            "max_position_embeddings": positions if positions and positions > 0 else None,  # XLNet: -1
            "model_type": config.model_type,
        }
    except Exception as err:  # a missing attribute, or one transformers refuses to give globally
        raise UnsupportedModelError(
            f"{type(model).__name__} ({config.model_type}) does not state one number of layers, attention "
            f"heads and head dimension for all its layers ({type(err).__name__}: {str(err)[:160]}); the slot "
            "memory needs them, so this model is not supported"
        ) from err
