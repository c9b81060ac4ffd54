"""The backends and the rule that chooses one per call.

A backend is one object (one file here) with ``why_not``, ``rank``, ``prepare`` and ``run``
(:class:`~flexspec.runtime.backends.base.Backend`); :data:`REGISTRY` holds them by name:

* ``fa4`` (:mod:`.native`): FlashAttention-4's own kernels, for causal, windows and documents;
* ``flash`` (:mod:`.flash`): FlexAttention with FlashAttention-4 kernels;
* ``sdpa`` (:mod:`.sdpa`): ``scaled_dot_product_attention`` for plain full or causal specs;
* ``flex`` (:mod:`.flex`): compiled FlexAttention with its default kernel;
* ``reference`` (:mod:`.reference`): the dense float64 semantics.

Adding a backend is one new file and one :func:`register` line below. :func:`choose` takes the
facts of one call (:class:`Request`) and the backend asked for, and returns a :class:`Choice`:
the backend, the reason, and why each other backend was not taken. ``"auto"`` tries the
backends in the order of their ``rank`` on the call's device; the measurements behind the ranks
are in docs/performance.md#why-the-backend-rules-are-what-they-are.

This package decides and runs one call; planning and caching belong to the runtime around it.
"""

from __future__ import annotations

from flexspec import ir
from flexspec.errors import did_you_mean
from flexspec.runtime.backends.base import (REGISTRY, Backend, BackendError, BackendName, Choice,
                                            Rank, Request, auto_order, register)
from flexspec.runtime.backends.flash import (FLASH_MIN_FLOPS, FLASH_OPTIONS, FlashBackend,
                                             flash_installed)
from flexspec.runtime.backends.flex import SHORT_CPU_LENGTH, FlexBackend
from flexspec.runtime.backends.native import NativeBackend
from flexspec.runtime.backends.reference import ReferenceBackend
from flexspec.runtime.backends.sdpa import SdpaBackend, not_sdpa

register(NativeBackend())
register(FlashBackend())
register(SdpaBackend())
register(FlexBackend())
register(ReferenceBackend())

# The names a user may ask for: "auto" and every registered backend.
BACKENDS: tuple[str, ...] = ("auto", *REGISTRY)


def check_backend_name(backend: str) -> None:
    """A :class:`BackendError` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend '{backend}'.{did_you_mean(backend, BACKENDS)} "
                           f"Backends: {', '.join(BACKENDS)}")


def why_not(backend: str, request: Request, spec: ir.AttentionIR) -> str | None:
    """Why ``backend`` cannot run ``spec`` for ``request``, or ``None`` when it can."""
    check_backend_name(backend)
    if backend == "auto":
        raise BackendError("'auto' is not one backend but a choice among them: use choose()")
    return REGISTRY[backend].why_not(request, spec)


def choose(backend: str, request: Request, spec: ir.AttentionIR) -> Choice:
    """The backend for one call: ``backend`` itself when it can run (else a
    :class:`BackendError` saying why), or for ``"auto"`` the first of :func:`auto_order` that
    can run it and is not vetoed as slower."""
    if backend != "auto":
        reason = why_not(backend, request, spec)
        if reason is not None:
            raise BackendError(f"backend '{backend}' cannot run this call: {reason}. "
                               "backend='auto' chooses one that can")
        return Choice(backend, f"backend='{backend}' was asked for")
    rejected = []
    for name, because in auto_order(request):
        candidate = REGISTRY[name]
        reason = candidate.why_not(request, spec)
        if reason is None:
            reason = candidate.auto_veto(request, spec)
        if reason is None:
            taken = {name} | {n for n, _ in rejected}
            rejected += [(n, other.why_not(request, spec) or "ranked lower for this call")
                         for n, other in REGISTRY.items() if n not in taken]
            return Choice(name, because, tuple(rejected))
        rejected.append((name, reason))
    reasons = "; ".join(f"{name}: {reason}" for name, reason in rejected)
    raise BackendError(f"no backend can run this call ({reasons})")


__all__ = ["BACKENDS", "FLASH_MIN_FLOPS", "FLASH_OPTIONS", "REGISTRY", "SHORT_CPU_LENGTH",
           "Backend", "BackendError", "BackendName", "Choice", "NativeBackend", "Rank", "Request",
           "auto_order", "check_backend_name", "choose", "flash_installed", "not_sdpa", "register",
           "why_not"]
