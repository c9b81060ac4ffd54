"""Every limit flexspec enforces, in one place, and the checks that apply them.

Two kinds of limit:

* **ranges**: what the kernels' dtypes hold. Positions and integer arithmetic are int64 in the
  reference and FlexAttention's CPU kernels, int32 in FlexAttention's GPU kernels
  (flexspec.workarounds: gpu-int32-indices); scores are float32. A number beyond its dtype would be computed wrongly where the reference,
  in float64 and Python ints, is exact, so it is refused before anything runs.
* **sizes**: what flexspec builds for a user's numbers (lengths, parameters, ``--bind`` text,
  files). Every such allocation is checked first against :data:`MEMORY_BUDGET`, counting what
  the computation holds at its peak, not only its result.

The checks raise the flexspec error their caller names (a :class:`SpecCheckError` for a spec's
text, a :class:`BindingError` for a call's inputs, :class:`SpecError` otherwise), with the number,
the limit and what to do instead. This module imports nothing of flexspec but its errors, and
no torch, so every layer, the pure-Python front end included, applies the same numbers.
"""

from __future__ import annotations

import math

from flexspec.errors import SpecError

# ---------------------------------------------------------------------------------------------
# Ranges of the kernels' dtypes

INT_RANGES = {"int64": (-2**63, 2**63 - 1), "int32": (-2**31, 2**31 - 1)}
INT64 = INT_RANGES["int64"]
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32; less rounds to 0
# Query offsets stay this far inside int64, so q + q_offset (and a few sums of it) cannot wrap.
POSITION_LIMIT = 2**62


def kernel_int_dtype(device_type: str) -> str:
    """The int dtype the compiled kernels compute positions in on ``device_type``: int32 on
    CUDA (flexspec.workarounds: gpu-int32-indices), int64 elsewhere."""
    return "int32" if device_type == "cuda" else "int64"


def fits_int(value, dtype: str = "int64") -> bool:
    """Whether ``value`` (an int, or a float bound) lies in the range of ``dtype``."""
    lo, hi = INT_RANGES[dtype]
    return lo <= value <= hi


def fits_float32(value: float) -> bool:
    """Whether a float keeps its value in float32 (0, infinities and NaN are themselves)."""
    return value == 0 or not math.isfinite(value) or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX


def check_int_constant(value: int, what: str = "", *, error=SpecError, span=None) -> None:
    """An int the kernels compute with must fit in int64."""
    if not fits_int(value):
        raise error(f"{what}{value} does not fit in a 64-bit int, which the kernels compute "
                    "positions with; use a number within +-9.2e18", span)


def check_float_constant(value: float, what: str = "", *, error=SpecError, span=None,
                         finite: bool = False) -> None:
    """A float the kernels compute with must keep its value in float32 (and be finite where
    ``finite``)."""
    if finite and not (math.isfinite(value) and fits_float32(value)):
        raise error(f"{what}{value!r} is not a finite float32 value (0, or from 1.4e-45 to "
                    "3.4e38 in magnitude)", span)
    if not fits_float32(value):
        raise error(f"{what}{value!r} is beyond float32 (the kernels compute scores in float32, "
                    "from 1.4e-45 to 3.4e38 in magnitude); use a value in that range", span)


def check_float_literal(text: str, value: float, *, error=SpecError, span=None) -> None:
    """A number written in a spec or a definition must be read as itself: one beyond even
    float64 (``1e400``, ``1e-400``) would become inf or 0 without a word. It is refused as
    :func:`check_float_constant` refuses one beyond float32 (``1e39``), which it is too."""
    mantissa = text.lower().split("e")[0]
    if math.isinf(value) or (value == 0 and mantissa.strip("0.") != ""):
        raise error(f"{text} is beyond float32 (the kernels compute scores in float32, from "
                    "1.4e-45 to 3.4e38 in magnitude); use a value in that range", span)


def check_position(value: int, name: str, *, error=SpecError) -> None:
    """A query position offset must stay well inside int64 (see :data:`POSITION_LIMIT`)."""
    if not -POSITION_LIMIT <= value < POSITION_LIMIT:
        raise error(f"{name} = {value} is out of range; positions must stay well inside int64 "
                    f"(within +-2**62)")


def check_int_range(text: str, lo: float, hi: float, dtype: str, where: str, *,
                    error=SpecError) -> None:
    """Integer arithmetic ``text`` whose values span ``lo..hi`` (sound bounds) must fit the int
    dtype the kernel computes it in: beyond it the kernel wraps silently."""
    if fits_int(lo, dtype) and fits_int(hi, dtype):
        return
    bits = dtype[3:]
    raise error(f"'{text}' reaches {_number(lo)}..{_number(hi)} {where}, beyond the {bits}-bit "
                f"ints it is computed in ({_number(INT_RANGES[dtype][0])}.."
                f"{_number(INT_RANGES[dtype][1])}), where it would wrap around silently; use "
                "smaller factors, or float arithmetic (multiply by a float such as 1.0 first)")


def _number(value: float) -> str:
    return f"{int(value)}" if abs(value) < 1e15 else f"{value:.3g}"


# ---------------------------------------------------------------------------------------------
# Sizes of the front end: what the recursive passes and inlining handle

# The most IR nodes inlining may write for one spec or definition: the registry's largest
# pattern writes 122; a chain that doubles at every line reaches this in 14 lines.
MAX_INLINED_NODES = 20_000
# The deepest IR the recursive passes handle within Python's default recursion limit, with
# room to spare (about three frames per level when two IRs are compared).
MAX_IR_DEPTH = 200
# The longest file the CLI reads (check, fmt, render of a path): /dev/zero never ends.
MAX_FILE_CHARS = 16 * 1024 * 1024
# --bind values are typed in by hand: a few million is already far more than a picture shows.
MAX_BIND_VALUES = 1 << 24

# ---------------------------------------------------------------------------------------------
# Memory: every allocation that grows with a user's numbers fits this total at its peak

MEMORY_BUDGET = 8 * 1024**3
# The dense reference holds about this many [B, H, Q_LEN, KV_LEN] float64 arrays at once
# (measured: 8.55 GiB peak RSS with alibi at S = 16384, where one array is 2 GiB), and a dense
# mask about as many int64 intermediates (4.5 GiB peak for a 256 MiB mask): each array gets a
# share of the budget.
DENSE_PEAK_ARRAYS = 4
MAX_DENSE_ARRAY_BYTES = MEMORY_BUDGET // DENSE_PEAK_ARRAYS
# The most entries of one built-in or learnable table (1 GiB of float32): a parameter such as
# rel_bias(max_distance=2**40) would otherwise ask the allocator for 8 TB. The reference reads
# a table in float64 (2 GiB), a share of the budget like a dense array's.
MAX_TABLE_ENTRIES = 1 << 28
# One block mask's tables and tile classes (about 1M x 1M positions in blocks of 128 for one
# batch and head row); bytes per tile: four int32 index tables (two per side), the int8
# classes and a bool scratch.
MAX_BLOCK_MASK_BYTES = MEMORY_BUDGET
BLOCK_MASK_BYTES_PER_TILE = 4 * 4 + 2
# Index expressions that interval analysis cannot bound are evaluated exactly, in chunks of at
# most EXACT_INDEX_CHECK_LIMIT points (an int64 array of 128 MiB), on at most
# MAX_INDEX_CHECK_POINTS points in all (a few seconds); beyond, the call is refused: an
# unchecked read out of range is an inductor error on the CPU and garbage on a GPU.
EXACT_INDEX_CHECK_LIMIT = 1 << 24
MAX_INDEX_CHECK_POINTS = 1 << 28
# Not an error: grids of more tiles (batch x heads x NQ x NK) leave the fused block-mask
# program, which holds float64 bounds for every tile of every node at once, for the eager one.
MAX_FUSED_TILES = 1 << 24


def gib(n: float) -> str:
    """``n`` bytes in GiB, for messages."""
    return f"{n / 1024**3:.1f} GiB"


def check_dense(batch: int, heads: int, q_len: int, kv_len: int,
                max_bytes: int | None = None) -> None:
    """The dense reference (and a dense mask) for these sizes must fit the budget: each of the
    :data:`DENSE_PEAK_ARRAYS` arrays it holds at once within :data:`MAX_DENSE_ARRAY_BYTES`
    (``max_bytes`` instead, where given)."""
    limit = MAX_DENSE_ARRAY_BYTES if max_bytes is None else max_bytes
    need = batch * heads * q_len * kv_len * 8
    if need > limit:
        raise SpecError(
            f"the dense reference would need {gib(need)} per score array for B={batch}, "
            f"H={heads}, Q_LEN={q_len}, KV_LEN={kv_len} (limit {gib(limit)} per array; the "
            f"computation holds about {DENSE_PEAK_ARRAYS} such arrays at once); use smaller "
            "shapes")


def dense_fits(batch: int, heads: int, q_len: int, kv_len: int) -> bool:
    """Whether :func:`check_dense` passes for these sizes."""
    return batch * heads * q_len * kv_len * 8 <= MAX_DENSE_ARRAY_BYTES


def check_table(name: str, shape: tuple) -> None:
    """A table flexspec allocates (a built-in or learnable tensor, a demo value) must hold at
    most :data:`MAX_TABLE_ENTRIES` entries."""
    entries = math.prod(shape)
    if entries > MAX_TABLE_ENTRIES:
        raise SpecError(f"tensor '{name}' would hold {entries:,} entries (shape "
                        f"{list(shape)}); flexspec allocates at most {MAX_TABLE_ENTRIES:,} for "
                        "one table: use smaller parameters, or pass your own tensor by name")


def check_block_mask(batch: int, heads: int, nq: int, nk: int, what: str, *,
                     error=SpecError) -> None:
    """A block mask of ``batch x heads x nq x nk`` tiles must fit :data:`MAX_BLOCK_MASK_BYTES`;
    ``what`` says which lengths and blocks gave those tiles."""
    size = batch * heads * nq * nk * BLOCK_MASK_BYTES_PER_TILE
    if size > MAX_BLOCK_MASK_BYTES:
        raise error(f"a block mask for {what} has {nq} x {nk} tiles per row of {batch} x "
                    f"{heads} (batch x heads): {size / 1024**3:.0f} GiB of tables, more than "
                    f"the {MAX_BLOCK_MASK_BYTES // 1024**3} GiB flexspec builds; use a larger "
                    "block_size, or shorter sequences")


def check_bind_count(total: int, name: str) -> None:
    """``--bind`` text must stay within :data:`MAX_BIND_VALUES` values (checked while counting,
    before any list is built)."""
    if total > MAX_BIND_VALUES:
        raise SpecError(f"--bind {name}: more than {MAX_BIND_VALUES} values; the command line "
                        "draws and explains small examples")


def check_file_length(length: int, path: str) -> None:
    """A file the CLI reads must hold at most :data:`MAX_FILE_CHARS` characters."""
    if length > MAX_FILE_CHARS:
        raise SpecError(f"cannot read {path}: it is longer than {MAX_FILE_CHARS} characters, "
                        "which no .attn file needs")


def check_index_points(points: int, tensor: str, dim: int, index: str, size: int, where: str, *,
                       error=SpecError) -> None:
    """An index that interval analysis cannot keep inside its tensor is checked by evaluating
    it on every point it reads; there must be at most :data:`MAX_INDEX_CHECK_POINTS` of them."""
    if points > MAX_INDEX_CHECK_POINTS:
        raise error(f"cannot check that '{tensor}' stays in range in dimension {dim}: its index "
                    f"{index} is not bounded by the sizes, and checking it means evaluating it "
                    f"at {points:,} points {where} (flexspec evaluates at most "
                    f"{MAX_INDEX_CHECK_POINTS:,}); clamp the index into the tensor, as in "
                    f"clamp({index}, 0, {size - 1}), so it is proven in range, or use shorter "
                    "sequences")
