"""What every backend is: the facts of a call it decides on (:class:`Request`), the decision
(:class:`Choice`), and the :class:`Backend` interface each backend file implements.

A backend answers four questions: can it run this call (``why_not``), where does ``auto`` rank it
on this device (``rank``), what does a plan keep for it (``prepare``) and how does a call run
(``run``). Nothing here knows a particular backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from flexspec import ir
from flexspec.errors import SpecError

if TYPE_CHECKING:  # the plan imports the backends, not the other way round
    from flexspec.runtime.masks import BlockMasks
    from flexspec.runtime.plan import Plan

BackendName = Literal["auto", "fa4", "flash", "sdpa", "flex", "reference"]


class BackendError(SpecError):
    """The backend asked for cannot run this spec on these inputs."""


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
    flash_installed: bool = False
    flash_failed: str | None = None  # FLASH failed to compile this spec before (the error)
    constant_lookup: str | None = None  # a lookup at a constant index (flash.constant_lookup)
    nested_lookup: str | None = None    # a lookup indexed by another (flash.nested_lookup)
    lse: bool = False                # the call asks for the log-sum-exp too (return_lse)
    scale: float | None = None       # the call's scale (None: 1 / sqrt(D))

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
    """The backend a call runs on, why, and why each other backend was not taken."""

    backend: str
    reason: str
    rejected: tuple = field(default=())   # (backend, reason) pairs


class Rank(NamedTuple):
    """A backend's place in ``auto``'s order on one device (lower runs first) and the reason it
    is chosen when it is the first that can run."""

    place: int
    reason: str


class Backend:
    """One way to run a spec's attention. Subclasses set :attr:`name` and override what differs;
    the registry (:mod:`flexspec.runtime.backends`) holds one instance of each."""

    name: str = ""
    # the lowering's form this backend's kernels compile, in its score_mod and in the mask_mod
    # its block masks carry (see flexspec.kernels.lower.lower): FLASH's CuTeDSL takes its own
    cute: bool = False

    def cannot_run(self, spec: ir.AttentionIR) -> str | None:
        """Why this backend can run no call of ``spec`` (said when the spec is compiled), or
        ``None``."""
        return None

    def why_not(self, request: Request, spec: ir.AttentionIR) -> str | None:
        """Why this backend cannot run ``spec`` for ``request``, or ``None`` when it can."""
        raise NotImplementedError

    def rank(self, request: Request) -> Rank | None:
        """Where ``auto`` tries this backend on ``request``'s device; ``None``: not at all."""
        return None

    def auto_veto(self, request: Request, spec: ir.AttentionIR) -> str | None:
        """Why ``auto`` passes over this backend although it can run ``spec`` for ``request``
        (it would be slower), or ``None``."""
        return None

    def index_dtype(self, device_type: str) -> str:
        """The int dtype this backend's kernels compute positions and integer arithmetic in,
        on ``device_type`` (see :mod:`flexspec.limits`)."""
        return "int64"

    def facts(self, device: torch.device, lowered) -> dict:
        """:class:`Request` fields only this backend knows how to find out."""
        return {}

    def prepare(self, plan: Plan, values: dict, masks: BlockMasks) -> None:
        """Keep in ``plan`` what every call of it needs (``plan.prepared``), given the tensor
        values of the call that made the plan and the Attention's block-mask cache; set
        ``plan.needs_values`` when :meth:`run` reads the call's tensor values."""

    def run(self, plan: Plan, q, k, v, scale, bindings: dict, values: dict | None):
        """One call's attention. ``values`` are the call's tensor values when the plan needs
        them (see :meth:`prepare`), else ``None``."""
        raise NotImplementedError


# Every backend by name, in the order ``auto`` lists those it did not try (filled by
# flexspec.runtime.backends, one register() per backend file).
REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`REGISTRY` under its name."""
    REGISTRY[backend.name] = backend
    return backend


def auto_order(request: Request) -> list[tuple[str, str]]:
    """The backends ``auto`` tries for ``request``, best first, each with the reason it would be
    chosen."""
    ranked = [(rank, name) for name, backend in REGISTRY.items()
              if (rank := backend.rank(request)) is not None]
    return [(name, rank.reason) for rank, name in sorted(ranked, key=lambda r: r[0].place)]
