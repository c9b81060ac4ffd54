"""The contract between the runtime and its backends: what a backend is asked (:class:`Request`,
the facts of one call), what it is given (:class:`Plan`, immutable, with :class:`PlanMasks`
for its block masks), what it gives back (:class:`Prepared`), and how it hands a call back
(:class:`Replan`). The decision among backends is a :class:`Choice`.

Keys and values come in one of two layouts. *Contiguous*: ``k`` and ``v`` are ``(B, Hkv,
KV_LEN, D)`` tensors. *Paged*: the keys and values of many sequences lie in the pages of one
pool (``[Hkv, pages * page_size, D]``); the request carries the pool's :class:`PageGeometry`
and a call's :class:`PageTables` say where each row's sequence lies. Only a backend that says it
reads pages (:attr:`Backend.reads_pages`) is given paged calls; for any other, the runtime
copies the sequences out of their pages first (a contiguous call).

Backends import this module and nothing of the runtime above it (planning, caches, the
``Attention`` facade); the runtime builds plans, backends only read them. Nothing here names a
particular backend: facts only one backend reads are namespaced (``"fa4.installed"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.kernels.tensors import add_leading_dims
from flexspec.runtime.bindings import contiguous
from flexspec.runtime.capture import in_graph_memory
from flexspec.runtime.lookups import LookupCheck


class BackendError(SpecError):
    """The backend asked for cannot run this spec on these inputs."""


# The query block of a paged plan's block masks (FlexAttention's default); their key block is
# the page, so that a key block is one page of the pool.
PAGED_QUERY_BLOCK = 128


@dataclass(frozen=True)
class PageGeometry:
    """The shape of a paged pool: ``pages`` pages of ``page_size`` positions each, of which one
    sequence holds at most ``max_pages``."""

    page_size: int
    pages: int
    max_pages: int

    @property
    def capacity(self) -> int:
        """The positions a sequence may hold (the KV_LEN its spec sees)."""
        return self.max_pages * self.page_size

    @property
    def positions(self) -> int:
        """The positions of the whole pool."""
        return self.pages * self.page_size

    @property
    def block_size(self) -> tuple:
        """The blocks of a paged plan's block masks: a page wide."""
        return (PAGED_QUERY_BLOCK, self.page_size)


@dataclass(frozen=True, eq=False)
class PageTables:
    """Where the sequences a paged call reads lie in its pool, as they were when the call's read
    was made (copies: later appends and releases do not change them). Row ``b`` of the call
    reads the sequence of slot ``slots[b]``: its logical page ``i`` is the pool's page
    ``pages[b, i]`` (entries past its pages are never read), and it holds ``lengths[b]``
    positions. ``page_slot`` and ``page_index`` say, for each page of the pool, which slot holds
    it and as which of its logical pages (-1 where the page is free)."""

    geometry: PageGeometry
    slots: torch.Tensor        # [B] int64
    pages: torch.Tensor        # [B, max_pages] int32
    lengths: torch.Tensor      # [B] int64
    page_slot: torch.Tensor    # [pages] int64
    page_index: torch.Tensor   # [pages] int64

    def physical(self, positions: torch.Tensor) -> torch.Tensor:
        """The pool index of each logical position (``[B, ...]``) of each row."""
        page = self.geometry.page_size
        index = (positions // page).reshape(positions.shape[0], -1)
        found = self.pages.long().gather(1, index).reshape(positions.shape)
        return found * page + positions % page

    def gather(self, pool: torch.Tensor) -> torch.Tensor:
        """The rows' sequences of ``pool`` (``[Hkv, pages * page_size, D]``) laid out
        contiguously, ``[B, Hkv, capacity, D]`` (a copy), zero past each row's length: what
        other sequences or earlier owners left in the pages a position past the length maps to
        (a NaN) never reaches a row, whose mask leaves those positions out but whose kernel may
        still multiply them by a weight of 0."""
        positions = torch.arange(self.geometry.capacity, device=pool.device)
        where = self.physical(positions.expand(self.slots.shape[0], -1))
        valid = (positions < self.lengths.unsqueeze(1)).view(1, *where.shape, 1)
        found = pool[:, where]
        return torch.where(valid, found, torch.zeros((), dtype=found.dtype,
                                                     device=found.device)).permute(1, 0, 2, 3)


@dataclass(frozen=True)
class Request:
    """The facts of one call that the choice of backend depends on."""

    device_type: str                 # "cuda", "cpu", "mps", "xpu"
    capability: tuple | None         # CUDA compute capability, e.g. (9, 0); None elsewhere
    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    grads: bool                      # q, k, v or a captured tensor require gradients
    table_grads: bool                # a tensor the score reads requires gradients
    score_tensors: bool = False      # the score reads a tensor (alibi slopes, a bias table)
    block_size: tuple = (128, 128)
    reference_fits: bool = True      # the dense reference fits its memory budget
    lse: bool = False                # the call asks for the log-sum-exp too (return_lse)
    scale: float | None = None       # the call's scale (None: 1 / sqrt(D))
    # what backends found out about the environment ((name, value) pairs, names namespaced by
    # who reads them: "fa4.installed"); see Backend.facts
    facts: tuple = ()
    # (backend, what went wrong) for the backends that failed to compile this spec before
    failed: tuple = ()
    # kernel options given to compile or tuned for this call ((name, value) pairs, sorted):
    # FlexAttention's backends run with them over their own (flexspec.runtime.tuning)
    kernel_options: tuple = ()
    # the pool's geometry where the keys and values are paged (kv_len is then a sequence's
    # capacity), else None
    pages: PageGeometry | None = None

    @property
    def layout(self) -> str:
        """``"paged"`` or ``"contiguous"``: how the keys and values lie (auto's order differs)."""
        return "contiguous" if self.pages is None else "paged"

    @property
    def key_positions(self) -> int:
        """The rows of keys the kernel is given, over every batch row and head: the pool's for
        a paged call, ``batch * kv_heads * kv_len`` otherwise."""
        if self.pages is not None:
            return self.kv_heads * self.pages.positions
        return self.batch * self.kv_heads * self.kv_len

    @property
    def mode(self) -> str:
        """``"backward"`` when the call needs gradients, else ``"forward"`` (auto's order
        differs between them)."""
        return "backward" if self.grads else "forward"

    def fact(self, name: str, default=None):
        """The value of the fact ``name`` (see :attr:`facts`), or ``default``."""
        return dict(self.facts).get(name, default)

    def failure(self, backend: str) -> str | None:
        """What went wrong when ``backend`` compiled this spec before, or ``None``."""
        return dict(self.failed).get(backend)

    @property
    def blocks_of_128(self) -> bool:
        """Both block sizes are multiples of 128: what FLASH needs, and what Triton's default
        tiles (up to 128 wide) divide."""
        return not any(size % 128 for size in self.block_size)

    @property
    def dense_flops(self) -> float:
        """Forward FLOPs of the two matrix products if nothing were masked."""
        return 2.0 * self.batch * self.heads * self.q_len * self.kv_len * (
            self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class Choice:
    """The backend a call runs on, why, why each other backend was not taken, and the others
    that could run it (best first: where a call handed back goes)."""

    backend: str
    reason: str
    rejected: tuple = field(default=())   # (backend, reason) pairs
    viable: tuple = field(default=())     # (backend, reason auto would take it for) pairs


class PlanMasks(Protocol):
    """The block masks of one plan's mask at its sizes (built by the runtime's cache)."""

    reads: tuple      # keys of the tensors the mask reads
    batch: int        # the batch and head extents its block masks have
    heads: int

    def get(self, values: dict, device, every_tile: bool = False) -> object:
        """The BlockMask for these tensor values (with ``every_tile``, one that may list every
        tile of the grid, the mask evaluated in each)."""

    def partial_only(self) -> "PlanMasks":
        """The same masks with full tiles listed as partial ones, for a forward pass on
        FlexAttention's decoding kernel."""


class Slot(NamedTuple):
    """A tensor given by name at each call: its name, tensor key and declared dimensions."""

    name: str
    key: str
    ndim: int


@dataclass(frozen=True, kw_only=True, eq=False)
class InputPlan:
    """What the tensors of calls with one input signature need, decided once: the sizes, the IR
    specialized to the bindings' shapes, the values that do not change between calls, a slot
    per tensor passed by name, the block masks, and the lookups checked by value. A
    :class:`Plan` is one with the backend's part added; ``Attention.block_mask`` keeps one of
    these alone per signature."""

    sizes: dict
    spec: ir.AttentionIR            # specialized to the bindings' shapes
    fixed: dict                     # tensor values that do not change between calls
    slots: tuple                    # a Slot per tensor passed by name
    masks: PlanMasks
    lookups: LookupCheck
    # Under no_grad, run on detached tensors: FlexAttention refuses inputs that require
    # gradients where it has no backward, and FLASH captured tables that do, even though
    # nothing is recorded under no_grad
    detach: bool = False
    # (bindings, their data pointers, values) of the last call whose bindings needed no copy:
    # one tuple, replaced whole (calls may come from several threads)
    _last_values: list = field(default_factory=lambda: [None], compare=False, repr=False)

    def values(self, bindings: dict) -> dict:
        """The tensor values of one call: the plan's fixed ones and this call's bindings. A
        call with the very bindings of the last one (the same tensors at the same addresses)
        gets the same values, so that what was made of them (a score_mod, a block mask) is
        found again: a detached tensor or a view is a new object at every call."""
        if not self.slots:
            return self.fixed
        given = tuple(bindings[slot.name] for slot in self.slots)
        last = self._last_values[0]
        if last is not None and all(a is b for a, b in zip(given, last[0])) and \
                last[1] == _addresses(given):
            return last[2]
        values, copied = dict(self.fixed), False
        for slot, binding in zip(self.slots, given):
            value = contiguous(binding)
            copied = copied or value is not binding
            value = value if value.dim() == slot.ndim else add_leading_dims(value, slot.ndim)
            values[slot.key] = value.detach() if self.detach else value
        # a call in a CUDA graph's memory is not remembered: its tensors get new contents at
        # every replay, and the graph refuses tensors of its pool that something outside keeps
        addresses = None if copied or in_graph_memory(given[0].device) else _addresses(given)
        if addresses is not None:
            self._last_values[0] = (given, addresses, values)
        return values


def _addresses(tensors: tuple) -> tuple | None:
    """The data pointers of ``tensors``, or ``None`` where one has none (a tensor subclass
    without storage): such calls are not remembered."""
    try:
        return tuple(tensor.data_ptr() for tensor in tensors)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


@dataclass(frozen=True, kw_only=True, eq=False)
class Plan(InputPlan):
    """Everything about a call that depends only on its input signature, decided once: the
    facts, the choice and the backend's own part (``state``, what its ``prepare`` returned).
    ``fallback`` is the plan a call handed back (:class:`Replan`) runs on instead, or the
    :class:`BackendError` that says why none can; ``None`` when the backend never hands back."""

    text: str                       # the spec as the user wrote it, for messages
    asked: str                      # the backend asked for ("auto", "flex", ...)
    device: torch.device
    request: Request
    choice: Choice
    backend: "Backend"
    score_keys: frozenset           # keys of the tensors the score reads
    gqa: bool
    scale: float | None = None      # the call's scale (None: 1 / sqrt(D))
    needs_values: bool = False      # calls gather their tensor values (see values)
    state: object = None
    fallback: object = None
    # the learnable tensors the call gave, kept alive: the plan's key holds their ids, which a
    # new tensor could otherwise take once they are freed (a module's replaced parameters)
    learnables: tuple = ()
    # the spec as written, before its rows were placed (q_offset, kv_lengths) and its tensors
    # specialized: what is proven of every placement (a paged read's every-page rule) reads it
    written: ir.AttentionIR | None = None


@dataclass(frozen=True)
class Prepared:
    """What a backend's ``prepare`` returns: the ``state`` its ``run`` reads (kept in the plan),
    whether ``run`` reads the call's tensor values, and, when ``run`` may hand calls back
    (:class:`Replan`), why: the runtime then keeps a fallback plan ready."""

    state: object = None
    needs_values: bool = False
    hands_back: str | None = None


class Replan(Exception):
    """Raised by a backend's ``run`` for a call it cannot run after all. The runtime runs the
    call on the plan's fallback; with ``lasting`` (the backend can never run this plan, such as
    a compile that failed), it remembers why and plans the signature anew without the
    backend (or raises a :class:`BackendError` when that backend was asked for)."""

    def __init__(self, reason: str, *, lasting: bool = False):
        super().__init__(reason)
        self.reason, self.lasting = reason, lasting


class Backend:
    """One way to run a spec's attention. A backend file defines a subclass and a ``BACKEND``
    instance of it; the registry (:mod:`flexspec.runtime.backends`) finds it, and the order
    table (:mod:`flexspec.runtime.order`) says where ``auto`` tries it."""

    name: str = ""
    # the lowering's dialect its kernels compile (flexspec.kernels.lower.DIALECTS), in its
    # score_mod and in the mask_mod its block masks carry
    dialect: str = "torch"
    # takes float64 inputs (only a dense float64 backend does)
    float64: bool = False
    # computes every (q, kv) pair, whatever the mask (what explain counts as its work)
    dense: bool = False
    # reads paged keys and values in place: it is given paged calls (Request.pages), whose k
    # and v are the pools ([Hkv, pages * page_size, D]) and whose run and launcher get the
    # call's PageTables as ``pages``
    reads_pages: bool = False

    def cannot_run(self, spec: ir.AttentionIR) -> str | None:
        """Why this backend can run no call of ``spec`` (said when the spec is compiled), or
        ``None``."""
        return None

    def why_not(self, request: Request, spec: ir.AttentionIR) -> str | None:
        """Why this backend cannot run ``spec`` for ``request``, or ``None`` when it can."""
        raise NotImplementedError

    def auto_veto(self, request: Request, spec: ir.AttentionIR) -> str | None:
        """Why ``auto`` passes over this backend although it can run ``spec`` for ``request``
        (it would be slower), or ``None``."""
        return None

    def index_dtype(self, device_type: str) -> str:
        """The int dtype this backend's kernels compute positions and integer arithmetic in,
        on ``device_type`` (see :mod:`flexspec.limits`)."""
        return "int64"

    def facts(self, device: torch.device) -> dict:
        """Facts about the environment only this backend knows how to find out, by namespaced
        name (see :attr:`Request.facts`)."""
        return {}

    def prepare(self, plan: Plan, values: dict) -> Prepared:
        """What every call of ``plan`` needs, given the tensor values of the call that made it."""
        return Prepared()

    def warm(self, plan: Plan, values: dict) -> None:
        """Build, outside any CUDA graph capture, what a first call of ``plan`` would build
        (its block mask): called for fallback plans, whose first call may come inside one."""

    def kernel(self, plan: Plan) -> str | None:
        """Which of its kernels the backend runs ``plan``'s calls on, and why, where it has
        several (what ``explain`` reports), or ``None``."""
        return None

    def tune_candidates(self, plan: Plan) -> list:
        """The kernel options worth timing for ``plan``'s calls (``Attention.tune``), each a
        dict; none where the backend takes no tuned options."""
        return []

    def launcher(self, plan: Plan, scale, bindings: dict, values: dict | None, step,
                 pages: PageTables | None = None):
        """A function of ``(q, k, v)`` that runs ``plan``'s call with these bindings (and
        ``values``, when the plan needs them) with everything else resolved now: what the layers
        of one model step call, whose calls differ only in q, k and v (for a paged plan, in q
        and the layer's pools, read through the step's ``pages``). ``None`` where the backend
        has none, or cannot resolve this plan's calls yet (a kernel not compiled, a call it may
        hand back): every call then takes :meth:`run`. The runtime passes ``pages`` only for a
        paged plan."""
        return None

    def run(self, plan: Plan, q, k, v, scale, bindings: dict, values: dict | None, step=None):
        """One call's attention. ``values`` are the call's tensor values when the plan needs
        them (see :class:`Prepared`), else ``None``; ``step`` is the model step the call belongs
        to (:class:`flexspec.runtime.step.Step`, or ``NO_STEP``): what a backend derives from
        the step's inputs it keeps there (``step.shared(key, make)``), for the step's other
        layers. A backend that :attr:`reads_pages` takes a paged plan's calls with ``k`` and
        ``v`` the pools and a keyword ``pages``, the call's :class:`PageTables`."""
        raise NotImplementedError
