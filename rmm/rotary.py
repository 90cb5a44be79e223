"""Rotary position maths: rotations of keys and queries by arbitrary position offsets.

RoPE rotates every frequency pair (i, i + rot_dim / 2) of a head vector by ``position * inv_freq[i]``
(the ``rotate_half`` convention of Llama, Mistral, Qwen2, SmolLM and GPT-NeoX, whose partial rotary
leaves the channels past ``rot_dim`` unrotated). Rotations compose, so a key rotated at ``p`` and then
by ``delta`` is the key at ``p + delta``, and rotating by ``-p`` recovers the unrotated (pre-RoPE) key.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rmm.models import UnsupportedModelError


class Rotary:
    """Rotations by arbitrary position offsets, using the model's own rotary frequencies.

    ``attention_scaling`` (YaRN, LongRoPE) is already applied once by the model and is deliberately
    not applied again.
    """

    def __init__(self, model: PreTrainedModel):
        modules = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
        if not modules or not hasattr(modules[0], "inv_freq"):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no rotary embedding module with `inv_freq`; "
                "the harness supports RoPE models (Llama, Mistral, Qwen2, SmolLM, GPT-NeoX)"
            )
        self.inv_freq = modules[0].inv_freq.detach().float()  # [rot_dim / 2]
        self.rot_dim = 2 * self.inv_freq.numel()

    def table(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of a rotation by ``delta`` [..., P] positions: [..., P, rot_dim / 2] each."""
        angles = delta.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` [..., P, head_dim] by a precomputed :meth:`table` broadcastable to it."""
        cos, sin = table
        half = self.rot_dim // 2
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half : self.rot_dim], xf[..., self.rot_dim :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)

    def rotate(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., P, head_dim] by ``delta`` positions, ``delta`` broadcastable to [..., P]."""
        return self.apply(x, self.table(delta))

    def to(self, device: torch.device) -> Rotary:
        self.inv_freq = self.inv_freq.to(device)
        return self
