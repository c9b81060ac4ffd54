"""What the runtime's caches see of a tensor: its identity (memory, layout, version), the
bounded memo of results kept by it (:class:`KeptByIdentity`), the range of values of tensors
the runtime made from host ints (:func:`known_range`), and what dynamo's guards see of an
argument (:func:`meta`)."""

from __future__ import annotations

import collections
import threading

import torch


def identity(value: torch.Tensor) -> tuple | None:
    """What identifies a tensor's contents: its memory, layout, dtype, device and version
    counter (a view of the same memory as another dtype is another tensor). Not
    ``id()``: bindings arrive as fresh views (leading dimensions added), so their ids never
    repeat. Whoever keys a cache by it keeps the tensor alive, so no other tensor can reuse its
    memory while the entry exists; an in-place change bumps the version shared by all views.

    ``None`` for a tensor made under ``torch.inference_mode()``: it has no version counter, so an
    in-place change cannot be seen, and nothing may be cached under it."""
    if value.is_inference():
        return None
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            tuple(value.stride()), value.dtype, value.device, value._version)


class KeptByIdentity:
    """The last ``size`` results made from tensors, by a key holding the tensors' identities:
    a caller that passes the same unchanged tensors again gets the same result. An entry keeps
    its tensors alive, so that no other tensor takes their memory (and identity) while it
    exists. Safe to share between threads."""

    def __init__(self, size: int):
        self._size = size
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: tuple, tensors, make):
        """The result kept under ``key``, else ``make()``, kept with ``tensors`` (what ``key``
        identifies). Nothing is kept when ``make`` raises."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept[1]
        result = make()
        with self._lock:
            self._kept[key] = (tensors, result)
            if len(self._kept) > self._size:
                self._kept.popitem(last=False)
        return result

    def find(self, key: tuple):
        """The result kept under ``key``, or ``None``."""
        with self._lock:
            kept = self._kept.get(key)
            return None if kept is None else kept[1]


# The ranges of the values of tensors made from host ints, by identity.
_KNOWN_KEPT = 256
_known = KeptByIdentity(_KNOWN_KEPT)


def remember_range(value: torch.Tensor, low: int, high: int) -> None:
    """Remember that ``value``'s entries lie in ``low .. high`` (a tensor made from host ints,
    unchanged since): checks of its values may then use the range instead of reading them
    (a host synchronisation on a GPU)."""
    seen = identity(value)
    if seen is not None:
        _known.get(seen, value, lambda: (low, high))


def known_range(value: torch.Tensor) -> tuple | None:
    """``(low, high)`` remembered for ``value`` (or a view of it with the same layout,
    unchanged since: :func:`identity`), or ``None``."""
    seen = identity(value)
    return None if seen is None else _known.find(seen)


def version(value: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place change), or ``None`` for an
    inference tensor, which has none (see :func:`identity`)."""
    return None if value.is_inference() else value._version


def meta(value) -> tuple:
    """What dynamo's guards and flexspec's checks see of an argument (not its values)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.stride(), value.requires_grad)
    return (type(value),)
