"""What the runtime's caches see of a tensor: its identity (memory, layout, version) and what
dynamo's guards see of an argument (:func:`meta`)."""

from __future__ import annotations

import torch


def identity(value: torch.Tensor) -> tuple | None:
    """What identifies a tensor's contents: its memory, layout and version counter. Not
    ``id()``: bindings arrive as fresh views (leading dimensions added), so their ids never
    repeat. Whoever keys a cache by it keeps the tensor alive, so no other tensor can reuse its
    memory while the entry exists; an in-place change bumps the version shared by all views.

    ``None`` for a tensor made under ``torch.inference_mode()``: it has no version counter, so an
    in-place change cannot be seen, and nothing may be cached under it."""
    if value.is_inference():
        return None
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            tuple(value.stride()), value._version)


def version(value: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place change), or ``None`` for an
    inference tensor, which has none (see :func:`identity`)."""
    return None if value.is_inference() else value._version


def meta(value) -> tuple:
    """What dynamo's guards and flexspec's checks see of an argument (not its values)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.stride(), value.requires_grad)
    return (type(value),)
