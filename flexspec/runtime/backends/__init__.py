"""The backends and the rule that chooses one per call.

A backend is one file here that defines a :class:`~flexspec.runtime.contract.Backend` subclass
and a ``BACKEND`` instance of it; :data:`REGISTRY` holds every one this package has, by name:

* ``fa4`` (:mod:`.native`): FlashAttention-4's own kernels, for causal, windows and documents;
* ``flash`` (:mod:`.flash`): FlexAttention with FlashAttention-4 kernels;
* ``sdpa`` (:mod:`.sdpa`): ``scaled_dot_product_attention`` for plain full or causal specs;
* ``flex`` (:mod:`.flex`): compiled FlexAttention with its default kernel;
* ``reference`` (:mod:`.reference`): the dense float64 semantics.

Adding a backend is one new file and a row in ``auto``'s order (:mod:`flexspec.runtime.order`).
:func:`choose` takes the facts of one call (:class:`Request`) and the backend asked for, and
returns a :class:`Choice`: the backend, the reason, why each other backend was not taken, and
the others that could run it (where a call it hands back goes).
"""

from __future__ import annotations

import importlib
import pkgutil

from flexspec import ir
from flexspec.errors import did_you_mean
from flexspec.runtime import order
from flexspec.runtime.contract import Backend, BackendError, Choice, Request


def discover() -> dict[str, Backend]:
    """Every backend of this package's modules: the ``BACKEND`` each module defines, by name, in
    the order ``auto``'s order table first names them (the rest after, by name)."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        backend = getattr(importlib.import_module(f"{__name__}.{module.name}"), "BACKEND", None)
        if isinstance(backend, Backend):
            found[backend.name] = backend
    ranked = [name for name in order.backend_names() if name in found]
    return {name: found[name] for name in ranked + sorted(set(found) - set(ranked))}


# Every backend by name, in the order ``auto`` lists those it did not try.
REGISTRY: dict[str, Backend] = discover()
# The names a user may ask for: "auto" and every registered backend.
BACKENDS: tuple[str, ...] = ("auto", *REGISTRY)


def check_backend_name(backend: str) -> None:
    """A :class:`BackendError` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend '{backend}'.{did_you_mean(str(backend), BACKENDS)} "
                           f"Backends: {', '.join(BACKENDS)}")


def why_not(backend: str, request: Request, spec: ir.AttentionIR) -> str | None:
    """Why ``backend`` cannot run ``spec`` for ``request`` (its own rules, or a failed compile of
    this spec before), or ``None`` when it can."""
    check_backend_name(backend)
    if backend == "auto":
        raise BackendError("'auto' is not one backend but a choice among them: use choose()")
    failure = request.failure(backend)
    if failure is not None:
        return f"it failed to compile this spec before: {failure}"
    if request.pages is not None and not REGISTRY[backend].reads_pages:
        return "it does not read a paged pool in place"
    return REGISTRY[backend].why_not(request, spec)


def _auto_refusal(name: str, request: Request, spec: ir.AttentionIR,
                  vetoes: bool = True) -> str | None:
    refusal = why_not(name, request, spec)
    return refusal or (REGISTRY[name].auto_veto(request, spec) if vetoes else None)


def auto_order(request: Request) -> list[tuple[str, str]]:
    """The backends ``auto`` tries for ``request``, best first, each with the reason it would be
    chosen."""
    # the same for every call of a device and mode, while the order table is the same object
    # (kept here, so that its id is not reused) and the same backends are registered
    key = (id(order.ORDER), tuple(REGISTRY), request.device_type, request.mode,
           request.layout)
    found = _AUTO_ORDERS.get(key)
    if found is None or found[0] is not order.ORDER:
        found = _AUTO_ORDERS[key] = (order.ORDER, tuple(
            (row.backend, order.reason(row, request)) for row in order.rows_for(request)
            if row.backend in REGISTRY))
    return list(found[1])


# (id of the order table, backends, device type, mode, layout) -> (the table, the order)
_AUTO_ORDERS: dict = {}


def choose(backend: str, request: Request, spec: ir.AttentionIR, *,
           vetoes: bool = True) -> Choice:
    """The backend for one call: ``backend`` itself when it can run (else a
    :class:`BackendError` saying why), or for ``"auto"`` the first of :func:`auto_order` that
    can run it and is not vetoed as slower (``vetoes=False``: the first that can run it, where
    the caller asked for a way of running it that auto would pass over, such as a paged pool
    read in place on the CPU). Either way the choice lists the other backends of ``auto``'s
    order that could run it, best first."""
    tried = auto_order(request)
    if backend != "auto":
        reason = why_not(backend, request, spec)
        if reason is not None:
            raise BackendError(f"backend '{backend}' cannot run this call: {reason}. "
                               "backend='auto' chooses one that can")
        viable = tuple((name, because) for name, because in tried
                       if name != backend and _auto_refusal(name, request, spec, vetoes) is None)
        return Choice(backend, f"backend='{backend}' was asked for", viable=viable)
    refusals = {name: _auto_refusal(name, request, spec, vetoes) for name, _ in tried}
    viable = [(name, because) for name, because in tried if refusals[name] is None]
    if not viable:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in refusals.items())
        what = "reads this paged pool in place" if request.pages else "can run this call"
        raise BackendError(f"no backend {what} ({reasons})")
    (chosen, because), viable = viable[0], viable[1:]
    # those tried before the chosen one in order, then every other backend by name
    before = list(refusals)[:list(refusals).index(chosen)]
    rejected = [(name, refusals[name]) for name in before]
    for name in REGISTRY:
        if name != chosen and name not in before:
            reason = refusals.get(name) or why_not(name, request, spec)
            rejected.append((name, reason or "ranked lower for this call"))
    return Choice(chosen, because, tuple(rejected), tuple(viable))


__all__ = ["BACKENDS", "REGISTRY", "Backend", "BackendError", "Choice", "Request", "auto_order",
           "check_backend_name", "choose", "discover", "why_not"]
