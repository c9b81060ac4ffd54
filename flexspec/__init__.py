"""flexspec: describe attention variants in a tiny language, get the fastest correct kernel.

>>> import flexspec
>>> spec = flexspec.parse("causal & window(128) + alibi")
>>> str(spec)
'causal & window(128) + alibi'
"""

import warnings as _warnings

# torch warns at import when numpy is missing ("Failed to initialize NumPy"), which flexspec
# never uses: a newcomer's first screen (the demo, `flexspec render`) should not start with it.
_warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from flexspec.errors import (BindingError, BindingTypeError, RegistryError, SpecCheckError,
                             SpecError, SpecSyntaxError, SpecTypeError)
from flexspec.lang.api import parse
from flexspec.lang.library import Library, load, loads
from flexspec.lang.registry import Pattern
from flexspec.lang.registry import registry as _registry
from flexspec.lang.spec import Spec

__version__ = "0.1.0"


def compile(spec, *, library: Library | None = None, backend: str = "auto", block_size=128,
            block_masks: str = "exact", kernel_options: dict | None = None,
            tuned: dict | None = None):
    """Compile a spec (text or :class:`Spec`) into an :class:`~flexspec.runtime.Attention`.

    ``backend`` is ``"auto"`` (per call, the fastest backend that can run it; ``explain`` says
    which) or one of the backends registered in :mod:`flexspec.runtime.backends`
    (:func:`backends` lists every name). ``block_size`` is an int or a
    (q, kv) pair; ``block_masks`` picks how block masks are built: ``"exact"`` (interval
    analysis refined inside partial tiles; the default), ``"intervals"`` (the analysis alone) or
    ``"dense"`` (torch's ``create_block_mask``). ``kernel_options`` go to FlexAttention's
    kernels on every call (``{"num_stages": 3}``), over flexspec's own; ``tuned`` is a table
    ``Attention.tune`` made (``attn.tuned``), reused without tuning again.
    """
    from flexspec.runtime.attention import Attention

    return Attention(parse(spec, library=library), backend=backend, block_size=block_size,
                     block_masks=block_masks, kernel_options=kernel_options, tuned=tuned)


def render(spec, q_len: int, kv_len: int | None = None, **options):
    """A picture of ``spec`` (text, a :class:`Spec` or an ``Attention``) at ``q_len`` x
    ``kv_len`` (default: square) for scripts and notebooks: ``print()`` shows the mask (and the
    score heat), a notebook the PNG where matplotlib is installed, ``.save(path)`` writes it.
    ``options``: ``batch``, ``head``, ``heads``, ``width_limit``, ``color`` (as in
    ``flexspec render``) and the spec's bindings by name; a tensor not given gets a demo value,
    listed under the text picture. Imports torch."""
    from flexspec.tools.render import rendering

    return rendering(spec, q_len, kv_len, **options)


def backends() -> tuple[str, ...]:
    """The names ``compile(..., backend=...)`` takes: ``"auto"`` and every registered backend
    (importing them imports torch)."""
    from flexspec.runtime.backends import BACKENDS

    return BACKENDS


def patterns() -> list[Pattern]:
    """Every pattern of the registry, sorted by name."""
    return sorted(_registry().patterns.values(), key=lambda p: p.name)


def pattern(name: str) -> Pattern:
    """One pattern by name or alias; an unknown name raises :class:`RegistryError`."""
    return _registry().get(name)


# The runtime's public names: importing them imports torch, so on first use, not by
# `import flexspec` (which `flexspec check` and `fmt` keep torch-free).
_RUNTIME_NAMES = ("Attention", "BackendError", "CompileLimitError", "KVCache",
                  "MultiheadAttention", "PagedKVCache", "SpecAttention", "Step")


def __getattr__(name):
    if name in _RUNTIME_NAMES:
        from flexspec import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'flexspec' has no attribute {name!r}")


def __dir__():
    # the runtime's names too, which exist only through __getattr__ until first used (dir()
    # must not import torch to list them)
    return sorted(set(globals()) | set(_RUNTIME_NAMES))


__all__ = ["Attention", "BackendError", "BindingError", "BindingTypeError", "CompileLimitError",
           "KVCache", "Library", "MultiheadAttention", "PagedKVCache", "Pattern",
           "RegistryError", "Spec",
           "SpecAttention", "SpecCheckError", "SpecError", "SpecSyntaxError", "SpecTypeError",
           "Step", "backends", "compile", "load", "loads", "parse", "pattern", "patterns",
           "render"]
