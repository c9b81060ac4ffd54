"""Kernel options: those given to ``flexspec.compile(..., kernel_options=...)`` for every call,
and those :meth:`Attention.tune <flexspec.runtime.attention.Attention.tune>` found fastest for
one call signature and pinned.

FlexAttention's kernels take options (tile sizes ``BLOCK_M`` / ``BLOCK_N``, ``num_warps``,
``num_stages``, the decoding kernel's ``SPLIT_KV``...); the backends that call it (``flex``,
``flash``) run with flexspec's own choice, then the options given, then the tuned ones for the
call's signature, each over the last. A tuned table is a plain dict (signature text -> options)
that JSON keeps: ``flexspec.compile(spec, tuned=attn.tuned)`` reuses it without tuning again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from flexspec.errors import BindingError

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
    """The text a tuned table keys a call by: its device, dtype, sizes and mode."""
    dtype = str(request.dtype).replace("torch.", "")
    return (f"{request.device_type}:{dtype}:B{request.batch}:H{request.heads}:"
            f"KV{request.kv_heads}:Q{request.q_len}:K{request.kv_len}:D{request.head_dim}:"
            f"{request.mode}")


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
        found = {**self.given, **self.tuned.get(signature(request), {})}
        return tuple(sorted(found.items()))

    def source(self, request) -> str | None:
        """Where a call's options come from, for ``explain``: ``None`` where none is set."""
        if signature(request) in self.tuned:
            return "tuned for this call's signature" + (" over those given to compile"
                                                        if self.given else "")
        return "given to compile" if self.given else None


def default_candidates(request) -> list:
    """The kernel options :meth:`Attention.tune` tries by default: for a call of fewer than 128
    rows (FlexAttention's decoding kernel) pipeline stages, warps and splits; for longer ones
    tile sizes, stages and warps."""
    if request.q_len < 128:
        return [{"num_stages": stages, "num_warps": warps}
                for stages in (1, 2, 3, 4) for warps in (2, 4)] + [
                    {"num_stages": 3, "SPLIT_KV": splits} for splits in (8, 16, 32)]
    return [{"BLOCK_M": m, "BLOCK_N": n, "num_stages": stages, "num_warps": warps}
            for m, n in ((128, 64), (64, 64), (128, 128), (64, 128))
            for stages, warps in ((2, 4), (3, 4), (3, 8))]


@dataclass
class Tuned:
    """What :meth:`Attention.tune` found: the call's ``signature``, the ``best`` options (``{}``:
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


def median_ms(run, repeats: int, device) -> float:
    """The median time of ``run()`` in ms over ``repeats`` runs (device events on CUDA)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)
