"""Kernel options: those given to ``flexspec.compile(..., kernel_options=...)`` for every call,
and those :func:`tune` (``Attention.tune``, ``PagedRead.tune``) found fastest for one call
signature and pinned.

FlexAttention's kernels take options (tile sizes ``BLOCK_M`` / ``BLOCK_N``, ``num_warps``,
``num_stages``, the decoding kernel's ``SPLIT_KV``...); the backends that call it (``flex``,
``flash``) run with flexspec's own choice, then the options given, then the tuned ones for the
call's signature, each over the last. A tuned table is a plain dict (signature text -> options)
that JSON keeps: ``flexspec.compile(spec, tuned=attn.tuned)`` reuses it without tuning again.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from flexspec.errors import BindingError, SpecError

# Options flexspec sets itself, which a user's options may not replace.
RESERVED = {"BACKEND": "pick the kernel with compile(..., backend='flash') or 'flex' instead",
            "OUTPUT_LOGSUMEXP": "ask for it with return_lse=True",
            "OUTPUT_MAX": "flexspec does not return the row maxima"}


def checked_options(options, where: str = "kernel_options") -> dict:
    """``options`` as a dict of option name -> int, bool or str, or a :class:`BindingError`
    that says what is wrong."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise BindingError(f"{where} must be a dict of FlexAttention kernel options "
                           f"(name -> value), got {type(options).__name__}")
    for name, value in options.items():
        if not isinstance(name, str):
            raise BindingError(f"{where}: option names are strings, got {name!r}")
        if name in RESERVED:
            raise BindingError(f"{where}: '{name}' is flexspec's to set: {RESERVED[name]}")
        if not isinstance(value, (bool, int, str)):
            raise BindingError(f"{where}: option '{name}' must be an int, a bool or a str, got "
                               f"{value!r}")
    return dict(options)


def signature(request) -> str:
    """The text a tuned table keys a call by: its device, dtype, sizes and mode, and for a
    paged call its pool (``:pages64x512``: 512 pages of 64 positions)."""
    dtype = str(request.dtype).replace("torch.", "")
    pages = request.pages
    return (f"{request.device_type}:{dtype}:B{request.batch}:H{request.heads}:"
            f"KV{request.kv_heads}:Q{request.q_len}:K{request.kv_len}:D{request.head_dim}:"
            f"{request.mode}" + (f":pages{pages.page_size}x{pages.pages}" if pages else ""))


class KernelOptions:
    """One Attention's kernel options (see the module docstring)."""

    def __init__(self, given=None, tuned=None):
        self.given = checked_options(given)
        if tuned is not None and not isinstance(tuned, dict):
            raise BindingError(f"tuned must be a dict (signature -> kernel options), as "
                               f"Attention.tuned gives, got {type(tuned).__name__}")
        self.tuned = {key: checked_options(value, f"tuned[{key!r}]")
                      for key, value in (tuned or {}).items()}

    def for_request(self, request) -> tuple:
        """The options of a call, as sorted ``(name, value)`` pairs (for the Request)."""
        if not self.tuned:  # the signature is text made anew: plans of a growing cache ask
            return tuple(sorted(self.given.items()))
        found = {**self.given, **self.tuned.get(signature(request), {})}
        return tuple(sorted(found.items()))

    def pin(self, request, options: dict) -> None:
        """Pin ``options`` for the calls of ``request``'s signature."""
        self.tuned[signature(request)] = options

    def source(self, request) -> str | None:
        """Where a call's options come from, for ``explain``: ``None`` where none is set."""
        if signature(request) in self.tuned:
            return "tuned for this call's signature" + (" over those given to compile"
                                                        if self.given else "")
        return "given to compile" if self.given else None


def default_candidates(request) -> list:
    """The kernel options :meth:`Attention.tune` tries by default: for a call of fewer than 128
    rows (FlexAttention's decoding kernel) pipeline stages, warps and splits; for longer ones
    tile sizes, stages and warps of the forward kernel, or, for a call that needs gradients,
    of the backward kernels (``bwd_``-prefixed: the forward keeps flexspec's own)."""
    if request.q_len < 128:
        return [{"num_stages": stages, "num_warps": warps}
                for stages in (1, 2, 3, 4) for warps in (2, 4)] + [
                    {"num_stages": 3, "SPLIT_KV": splits} for splits in (8, 16, 32)]
    if request.grads:
        # the backward's two loops: BLOCK_M1 x BLOCK_N1 tiles for dk and dv, BLOCK_M2 x BLOCK_N2
        # for dq (the transposed tile, as torch's own configurations pair them)
        return [{"bwd_BLOCK_M1": m, "bwd_BLOCK_N1": n, "bwd_BLOCK_M2": n, "bwd_BLOCK_N2": m,
                 "bwd_num_stages": stages, "bwd_num_warps": warps}
                for m, n in ((32, 128), (64, 64), (64, 128))
                for stages, warps in ((2, 4), (3, 4), (3, 8))]
    return [{"BLOCK_M": m, "BLOCK_N": n, "num_stages": stages, "num_warps": warps}
            for m, n in ((128, 64), (64, 64), (128, 128), (64, 128))
            for stages, warps in ((2, 4), (3, 4), (3, 8))]


def answer_of(call, q, k, v, backward: bool):
    """A function of no arguments that runs ``call(q, k, v)`` once and returns its answer as a
    tuple: the output, and with ``backward`` the gradients of q, k and v as well (the
    output's gradient is the same random tensor on every run), so that what is timed is the
    forward and the backward together."""
    if not backward:
        def forward() -> tuple:
            with torch.no_grad():
                return (call(q, k, v),)
        return forward
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    seeded = torch.Generator(device=q.device).manual_seed(0)
    grad = []

    def forward_and_backward() -> tuple:
        for leaf in leaves:
            leaf.grad = None
        out = call(*leaves)
        if not grad:
            grad.append(torch.randn(out.shape, generator=seeded, device=out.device,
                                    dtype=out.dtype))
        out.backward(grad[0])
        return (out.detach(), *(leaf.grad for leaf in leaves))
    return forward_and_backward


def same_answer(answer: tuple, expected: tuple) -> bool:
    """Whether a candidate's answer is the default options' (as close as its dtype's rounding
    lets two kernels be, relative to the largest value: gradients may be large)."""
    for got, want in zip(answer, expected):
        tolerance = 1e-4 if want.dtype == torch.float32 else 2e-2
        scale = max(1.0, float(want.abs().max()))
        if got.shape != want.shape or not torch.allclose(
                got.float(), want.float(), rtol=tolerance, atol=tolerance * scale):
            return False
    return len(answer) == len(expected)


def time_candidates(run, candidates: list, pin, result: "Tuned", repeats: int, device) -> None:
    """Run and time ``run`` with each of ``candidates`` pinned (``pin(options)``), the first
    one's answer the expected one, into ``result``'s times and failures."""
    expected = None
    for options in candidates:
        try:
            pin(options)  # a read made anew may refuse the options (a paged read's tile)
            answer = run()
        except Exception as error:  # noqa: BLE001 - a candidate that fails is a row
            result.times.append((options, None))
            # flexspec's own refusals say why; another error by its type
            result.failed[str(options)] = (str(error) if isinstance(error, SpecError)
                                           else f"failed: {type(error).__name__}")
            continue
        if expected is None:
            expected = answer
        elif not same_answer(answer, expected):
            result.times.append((options, None))
            result.failed[str(options)] = "a different answer"
            continue
        result.times.append((options, median_ms(run, repeats, device)))
    # the first options timed ran on a GPU not yet warm (clocks, caches): they run again last
    # and keep the faster of their two times
    own, first_ms = result.times[0] if result.times else ({}, None)
    if first_ms is not None and len(result.times) > 1:
        pin(own)
        result.times[0] = (own, min(first_ms, median_ms(run, repeats, device)))


def tune(plan, run, pin, candidates: list | None, repeats: int, device) -> "Tuned":
    """Time ``run`` (a function of no arguments that runs a call of ``plan``'s signature and
    returns its answer, see :func:`answer_of`) with each of ``candidates`` (by default those
    ``plan``'s backend offers, ``Backend.tune_candidates``) and with flexspec's own options,
    each pinned for the signature by ``pin(options)`` before it runs (which then makes the
    call's plan anew); check each answer against the own options' answer, and pin the fastest
    (flexspec's own unless one is faster by more than :data:`MARGIN`)."""
    started = time.perf_counter()
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise BindingError(f"repeats must be a positive int (the timed rounds of each "
                           f"candidate), got {repeats!r}")
    key = signature(plan.request)
    offered = plan.backend.tune_candidates(plan)
    if not offered:
        return Tuned(key, {}, failed={"all": f"this call runs on backend "
                                             f"'{plan.choice.backend}', which takes no tuned "
                                             "kernel options"},
                     seconds=time.perf_counter() - started)
    candidates = offered if candidates is None else [
        checked_options(options, "candidates") for options in candidates]
    result = Tuned(key, {})
    # each candidate compiles in an entry of its own (flexattention.kernel_parts)
    time_candidates(run, [{}] + candidates, pin, result, repeats, device)
    result.best = fastest(result.times)
    pin(result.best)
    result.seconds = time.perf_counter() - started
    return result


@dataclass
class Tuned:
    """What :func:`tune` found: the call's ``signature``, the ``best`` options (``{}``:
    flexspec's own), each candidate's median ``times`` in ms (``None`` for one that failed or
    gave another answer, with the reason in ``failed``), and the ``seconds`` tuning took."""

    signature: str
    best: dict
    times: list = field(default_factory=list)    # (options, ms or None)
    failed: dict = field(default_factory=dict)   # str(options) -> why
    seconds: float = 0.0

    def __str__(self) -> str:
        lines = [f"tuned {self.signature} in {self.seconds:.1f} s: best {self.best or 'default'}"]
        for options, ms in self.times:
            shown = f"{ms:.4f} ms" if ms is not None else self.failed.get(str(options), "failed")
            lines.append(f"  {options or 'default'}: {shown}")
        return "\n".join(lines)


# A candidate replaces flexspec's own options only where it is faster by more than this
# fraction: one call's time moves by a few percent between runs, and a pinned option that only
# won by noise costs a compile and may lose later.
MARGIN = 0.03


def fastest(times: list) -> dict:
    """The options to pin from ``(options, ms or None)`` rows, the first of which is
    flexspec's own (``{}``): the fastest candidate where it beats the own options by more
    than :data:`MARGIN`, else ``{}``."""
    timed = [(options, ms) for options, ms in times if ms is not None]
    if not timed:
        return {}
    best, best_ms = min(timed, key=lambda entry: entry[1])
    own = dict((str(options), ms) for options, ms in timed).get("{}")
    return best if own is None or best_ms < own * (1 - MARGIN) else {}


# On CUDA each timed round runs the call back to back for about this many milliseconds: a
# call of a few microseconds timed alone measures its launch more than its kernel.
ROUND_MS = 2.0


def median_ms(run, repeats: int, device) -> float:
    """The median time of one ``run()`` in ms over ``repeats`` rounds: on CUDA, device events
    around rounds of back-to-back runs of about :data:`ROUND_MS` (the GPU queue kept full, as
    in a model), elsewhere the host's clock around single runs."""
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    def round_ms(count: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / count
    count = max(1, min(100, math.ceil(ROUND_MS / max(round_ms(1), 1e-3))))
    return statistics.median(round_ms(count) for _ in range(repeats))
