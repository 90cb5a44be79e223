"""``model.repeat_kv``: a grouped-query model rewritten with one KV head per query head.

With G = n_heads / n_kv_heads > 1, every query head of a group reads the same key and value head. A policy
that keeps a separate selection per query head (ReST-KV's official code repeats the KV heads with
``repeat_kv`` before it compresses) needs a memory per query head; the engine's memory is per KV head. This
rewrites the model so that each KV head's key and value projections appear G times, once for every query head
of its group (query head i reads KV head i // G, as transformers' ``repeat_kv``): the function the model
computes is the same, and the engine then holds G copies of every entry, one per query head, each evicted on
its own. KV memory is G times the model's own.

Only models whose attention modules project keys and values with their own ``k_proj`` and ``v_proj``
(``nn.Linear``, n_kv_heads x head_dim outputs) are rewritten; any other layout is refused.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from rmm.errors import UnsupportedModelError


def _repeat_rows(weight: torch.Tensor, n_kv: int, group: int) -> torch.Tensor:
    """[n_kv * D, ...] -> [n_kv * G * D, ...], each head's D rows repeated G times in a row."""
    heads = weight.reshape(n_kv, -1, *weight.shape[1:])
    return heads.repeat_interleave(group, dim=0).reshape(-1, *weight.shape[1:])


def _repeated(old: nn.Linear, n_kv: int, group: int) -> nn.Linear:
    """A projection of n_kv heads as one of n_kv * G heads, each head's rows repeated G times in a row."""
    new = nn.Linear(
        old.in_features,
        old.out_features * group,
        bias=old.bias is not None,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )
    new.weight.data.copy_(_repeat_rows(old.weight.data, n_kv, group))
    if old.bias is not None:
        new.bias.data.copy_(_repeat_rows(old.bias.data, n_kv, group))
    return new.requires_grad_(old.weight.requires_grad)


def repeat_kv_heads(model: PreTrainedModel) -> PreTrainedModel:
    """Rewrite ``model`` in place so that it has as many KV heads as query heads (see the module docstring).

    A model without grouped-query attention is returned unchanged. Raises :class:`UnsupportedModelError`
    when an attention module does not project keys and values with ``k_proj`` and ``v_proj`` of
    n_kv_heads x head_dim outputs each, or when the model has no such module.
    """
    config = model.config.get_text_config()
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    if n_kv == n_heads:
        return model
    group = n_heads // n_kv
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    modules = [m for m in model.modules() if hasattr(m, "k_proj") or hasattr(m, "v_proj")]
    for module in modules:
        for name in ("k_proj", "v_proj"):
            projection = getattr(module, name, None)
            if not isinstance(projection, nn.Linear) or projection.out_features != n_kv * head_dim:
                raise UnsupportedModelError(
                    f"model.repeat_kv: {type(module).__name__} ({config.model_type}) has no {name} of "
                    f"{n_kv} x {head_dim} outputs (found {type(projection).__name__}); its keys and values "
                    "cannot be repeated per query head here: leave model.repeat_kv unset"
                )
    if not modules:
        raise UnsupportedModelError(
            f"model.repeat_kv: {type(model).__name__} ({config.model_type}) has no attention module with "
            "k_proj and v_proj; leave model.repeat_kv unset"
        )
    for module in modules:
        for name in ("k_proj", "v_proj"):
            setattr(module, name, _repeated(getattr(module, name), n_kv, group))
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = 1
        if hasattr(module, "num_key_value_heads"):
            module.num_key_value_heads = n_heads
    config.num_key_value_heads = n_heads
    if model.config is not config and hasattr(model.config, "num_key_value_heads"):
        model.config.num_key_value_heads = n_heads
    return model
