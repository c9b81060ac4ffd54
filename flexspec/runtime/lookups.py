"""The range checks of a spec's tensor lookups: an index that leaves its tensor makes a kernel
read garbage (an inductor error on the CPU). Interval analysis proves most lookups in range once
per spec and shape (:func:`unproven_lookups`); the others are evaluated exactly on every point
they read (:func:`check_lookups`; on a CUDA device without reading them back,
:func:`assert_lookups`), and :class:`LookupCheck` skips values checked last."""

from __future__ import annotations

import functools
import math

import torch

from flexspec import ir, limits
from flexspec.errors import BindingError
from flexspec.ir import tensor_key
from flexspec.ir.intervals import bounds, index_ranges, lookup_ranges
from flexspec.kernels.evaluate import evaluate, index_grid
from flexspec.runtime.capture import in_graph_memory
from flexspec.runtime.identity import KeptByIdentity, identity, known_range

# Sets of values a plan's lookups were checked on, kept (see LookupCheck).
CHECKED_KEPT = 8


def shapes_key(values: dict) -> tuple:
    return tuple(sorted((key, tuple(value.shape)) for key, value in values.items()))


# The size each index variable runs over in a lookup (index_ranges: q over the rows).
_EXTENTS = {"b": "B", "h": "H", "q": "Q_LEN", "kv": "KV_LEN"}


@functools.lru_cache(maxsize=1024)
def unproven_lookups(spec: ir.AttentionIR, sizes: tuple, shapes: tuple) -> tuple:
    """The (tensor, dim, index) lookups that interval analysis cannot keep inside their tensor.
    An index that is an index variable over a dimension of exactly its extent (``doc_ids[b,
    kv]`` with ``doc_ids`` of ``[B, KV_LEN]``) is in range at any size: only the others are
    analysed (a growing cache proves its lookups at every step)."""
    sizes, shapes = dict(sizes), dict(shapes)
    ranges = index_ranges(sizes)
    unproven = []
    for tensor, dim, index in _lookups(spec):
        size = shapes[tensor_key(tensor)][dim]
        extent = _EXTENTS.get(index.name) if isinstance(index, ir.Var) else None
        if (extent is None or size != sizes[extent]) and not _inside(bounds(index, ranges), size):
            unproven.append((tensor, dim, index))
    return tuple(unproven)


def _inside(span: tuple | None, size: int) -> bool:
    """Whether an index bounded by ``span`` (``None``: unbounded) stays in ``0 .. size - 1``."""
    return span is not None and span[0] >= 0 and span[1] < size


@functools.lru_cache(maxsize=256)
def _lookups(spec: ir.AttentionIR) -> tuple:
    """``(tensor, dim, index)`` of every tensor lookup of ``spec``."""
    return tuple((tensor, dim, index) for tensor, dim, index, _ in lookup_ranges(spec, None))


def check_lookups(spec: ir.AttentionIR, sizes: dict, values: dict,
                  unproven: tuple | None = None) -> None:
    """Every index of every lookup must stay inside its tensor, or the kernel reads garbage (an
    inductor error on the CPU).

    Interval analysis proves most lookups safe once per spec and shape; an index it cannot
    bound is evaluated exactly, in chunks, on every point it reads; an index with more points
    than :data:`flexspec.limits.MAX_INDEX_CHECK_POINTS` is refused, with the fix (clamp it).
    """
    if unproven is None:
        unproven = unproven_lookups(spec, tuple(sorted(sizes.items())), shapes_key(values))
    where = _where(sizes)
    for tensor, dim, index, size, low, high in _index_bounds(spec, sizes, values, unproven):
        low, high = int(low), int(high)
        if low < 0 or high >= size:
            raise BindingError(
                f"'{tensor.name}' is indexed by {index} in dimension {dim}, which reaches "
                f"{low}..{high} {where}, but that dimension has {size} entries")


def assert_lookups(spec: ir.AttentionIR, sizes: dict, values: dict, unproven: tuple) -> None:
    """:func:`check_lookups` without reading a value back: each index's range is computed on
    the values' device and asserted there (``torch._assert_async``), so a call on a GPU never
    waits for it, and a captured step checks it at every replay. An index out of range stops
    the program with a device-side assertion that names the lookup, where the CPU raises a
    :class:`BindingError`."""
    where = _where(sizes)
    for tensor, dim, index, size, low, high in _index_bounds(spec, sizes, values, unproven,
                                                             reads_checked=False):
        torch._assert_async(torch.logical_and(low >= 0, high < size),
                            f"flexspec: '{tensor.name}' is indexed by {index} in dimension "
                            f"{dim} outside its {size} entries {where}")


def _where(sizes: dict) -> str:
    """The lengths a lookup's error names."""
    return f"for Q_LEN={sizes['Q_LEN']}, KV_LEN={sizes['KV_LEN']}"


def _index_bounds(spec: ir.AttentionIR, sizes: dict, values: dict, unproven: tuple, *,
                  reads_checked: bool = True):
    """``(tensor, dim, index, size, low, high)`` of each unproven lookup that reads any point,
    ``low`` and ``high`` 0-d tensors on the values' device (a :class:`BindingError` for an
    index with more points than the limit). Without ``reads_checked`` nothing is read back,
    not even to check the reads inside an index (``q + q_offset[b]``): each of those is an
    unproven lookup of its own, asserted too, or one proven in range."""
    extent = {var: sizes[size] for var, size in _EXTENTS.items()}
    where = _where(sizes)
    for tensor, dim, index in unproven:
        size = values[tensor_key(tensor)].shape[dim]
        used = ir.free_vars(index)
        dims = [n if name in used else 1 for name, n in extent.items()]
        if not math.prod(dims):
            continue
        limits.check_index_points(math.prod(dims), tensor.name, dim, str(index), size, where,
                                  error=BindingError)
        low, high = _index_range(index, dims, values, values[tensor_key(tensor)].device,
                                 reads_checked)
        yield tensor, dim, index, size, low, high


def _index_range(index: ir.Expr, dims: list, values: dict, device,
                 reads_checked: bool = True) -> tuple:
    """``(min, max)`` of ``index`` over the grid of ``dims`` (b, h, q, kv) as 0-d tensors on
    ``device``, evaluated in slices of the longest axis holding at most
    :data:`flexspec.limits.EXACT_INDEX_CHECK_LIMIT` points each, so memory stays bounded at
    any length."""
    grid = index_grid(*dims, device=device)
    axis = max(range(4), key=lambda i: dims[i])
    name = ("b", "h", "q", "kv")[axis]
    step = max(1, limits.EXACT_INDEX_CHECK_LIMIT // (math.prod(dims) // dims[axis]))
    low = high = None
    for start in range(0, dims[axis], step):
        part = {**grid, name: grid[name].narrow(axis, start, min(step, dims[axis] - start))}
        found = evaluate(index, part, values, reads_checked=reads_checked)
        part_low, part_high = found.min(), found.max()
        low = part_low if low is None else torch.minimum(low, part_low)
        high = part_high if high is None else torch.maximum(high, part_high)
    return low, high


class LookupCheck:
    """The lookups of one plan that interval analysis could not prove in range, checked by
    value: on the values of a call unless the tensors the check reads (the looked-up ones and
    those their indices read) are ones checked already, unchanged (the last
    :data:`CHECKED_KEPT` sets of them: calls that take turns, such as the runs of batch rows of
    a wide decode call, are each checked once, not on every call). A check reads the indices'
    ranges back on the CPU and asserts them on a CUDA device (:func:`assert_lookups`)."""

    def __init__(self, spec: ir.AttentionIR, sizes: dict, values: dict):
        """Proves what it can and checks the rest on ``values`` (those of the call that makes
        the plan)."""
        self.spec, self.sizes = spec, sizes
        self.unproven = unproven_lookups(spec, tuple(sorted(sizes.items())), shapes_key(values))
        # the tensors each unproven index reads (a q_offset made from an int has a known range)
        self._reads = tuple(tuple(ir.tensor_keys(index)) for _, _, index in self.unproven)
        # the sets of values checked, by identity (kept alive with them)
        self._checked = KeptByIdentity(CHECKED_KEPT)
        self.check(values)

    def __bool__(self) -> bool:
        return bool(self.unproven)

    def check(self, values: dict) -> None:
        if self._in_range_by_known_values(values):
            return
        read = self._read_tensors(values)
        # on a CUDA device a read back would wait for the device at every decoding step
        checker = assert_lookups if read[0].device.type == "cuda" else check_lookups
        # inside a CUDA graph capture (or its warm-up) the assertion is recorded, to run at
        # every replay with whatever the tensors hold then
        found = None if in_graph_memory(read[0].device) else \
            tuple(identity(value) for value in read)
        if found is None or None in found:  # an inference tensor: its changes cannot be seen
            checker(self.spec, self.sizes, values, self.unproven)
            return
        self._checked.get(found, read,
                          lambda: checker(self.spec, self.sizes, values, self.unproven))

    def _in_range_by_known_values(self, values: dict) -> bool:
        """Whether interval analysis keeps every unproven lookup in range once the tensors its
        index reads have the ranges the runtime knows for them (offsets made from host ints:
        :func:`~flexspec.runtime.identity.known_range`), with no read of their values (a host
        synchronisation on a GPU at every decoding step)."""
        ranges = None
        for (tensor, dim, index), reads in zip(self.unproven, self._reads):
            if not reads:
                return False
            tables = {}
            for key in reads:
                found = known_range(values[key])
                if found is None:
                    return False
                tables[key] = found
            ranges = ranges or index_ranges(self.sizes)
            if not _inside(bounds(index, ranges, tables), values[tensor_key(tensor)].shape[dim]):
                return False
        return True

    def _read_tensors(self, values: dict) -> list:
        """The values a check of the unproven lookups reads: each looked-up tensor and the
        tensors its index reads (a new ``q_offset`` with the same ``doc_ids`` is checked
        anew)."""
        keys = [tensor_key(t) for t, _, _ in self.unproven]
        keys += [key for reads in self._reads for key in reads]
        return [values[key] for key in dict.fromkeys(keys)]
