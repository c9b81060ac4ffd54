"""What the runtime's caches see of a tensor: its identity (memory, layout, version) and what
dynamo's guards see of an argument (:func:`meta`)."""

from __future__ import annotations

import torch


def identity(value: torch.Tensor) -> tuple:
    """What identifies a tensor's contents: its memory, layout and version counter. Not
    ``id()``: bindings arrive as fresh views (leading dimensions added), so their ids never
    repeat. Whoever keys a cache by it keeps the tensor alive, so no other tensor can reuse its
    memory while the entry exists; an in-place change bumps the version shared by all views."""
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            tuple(value.stride()), value._version)


def meta(value) -> tuple:
    """What dynamo's guards and flexspec's checks see of an argument (not its values)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.stride(), value.requires_grad)
    return (type(value),)
