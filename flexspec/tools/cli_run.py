"""The commands that compute on tensors: ``flexspec explain`` (with ``--q-len``: a call's backend,
density and work) and ``flexspec render`` (a picture of the mask and score). Declared and run as
every command is (see :mod:`flexspec.tools.cli`)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from flexspec.errors import SpecError
from flexspec.tools.console import EXIT_OK, emit

# ---- explain -----------------------------------------------------------------------------------


def _add_explain(subparsers) -> None:
    p = subparsers.add_parser(
        "explain", help="show the IR a spec resolves to, and the backend a call would take",
        description="Parse and check a spec and print its resolved, simplified mask and score "
                    "expressions. With --q-len, also say what a call of those sizes would do: "
                    "the visible fraction of the score matrix, the work in FLOPs, and the "
                    "backend chosen with its reason. Runtime tensors the spec reads get demo "
                    "values unless given with --bind (see 'flexspec render --help').")
    p.add_argument("spec", metavar="SPEC",
                   help="a spec expression, e.g. 'causal & window(128) + alibi', or the name of "
                        "a spec in --file")
    p.add_argument("--file", "-f", metavar="F.attn",
                   help="an .attn file whose definitions and specs the spec may use")
    p.add_argument("--q-len", type=int, metavar="N", help="query length of the call explained")
    p.add_argument("--kv-len", type=int, metavar="N", help="key/value length (default: --q-len)")
    p.add_argument("--batch", type=int, metavar="B", help="batch size (default 1)")
    p.add_argument("--heads", type=int, metavar="H", help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, metavar="H",
                   help="key/value heads (default: --heads; fewer means grouped-query)")
    p.add_argument("--head-dim", type=int, metavar="D", help="head dimension (default 128)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="input dtype (default bfloat16)")
    p.add_argument("--device", help="device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--grad", action="store_true", help="the inputs require gradients")
    p.add_argument("--capability", metavar="X.Y",
                   help="with --device cuda on a machine without CUDA: the compute capability "
                        "of the GPU planned for (default 9.0, Hopper)")
    p.add_argument("--fa4", action="store_true",
                   help="with --device cuda on a machine without CUDA: plan as if "
                        "FlashAttention-4 were installed there")
    p.add_argument("--backend", action=_BackendOption, help="the backend asked for (default auto)")
    p.add_argument("--block-size", type=int, metavar="N",
                   help="block size of the block mask, a multiple of 16 (default 128)")
    p.add_argument("--bind", action="append", default=[], metavar="NAME=VALUES",
                   help="a runtime tensor's values (repeatable), as in 'flexspec render'")


def _spec(args):
    """The SPEC argument of ``explain`` and ``render``: the name of a spec in ``--file``, or
    an expression whose names resolve in that file first, then in the registry."""
    from flexspec import load, parse

    library = load(args.file) if args.file is not None else None
    if library is not None and args.spec.strip() in library:
        return library[args.spec.strip()]
    return parse(args.spec, library=library)


# The options of `explain` that describe a call, with what a call takes where one is left out.
# Their argparse default is None (False or [] for --grad and --bind), so that an option given
# with its default value (`--heads 16`) still counts as given.
CALL_OPTIONS = {"kv_len": None, "batch": 1, "heads": 16, "kv_heads": None, "head_dim": 128,
                "dtype": "bfloat16", "device": "cpu", "grad": False, "backend": "auto",
                "block_size": 128, "bind": [], "capability": None, "fa4": False}


def cmd_explain(args) -> int:
    _check_call_numbers(args)
    spec = _spec(args)
    if args.q_len is None:
        given = [f"--{name.replace('_', '-')}" for name in CALL_OPTIONS
                 if getattr(args, name) not in (None, False, [])]
        if given:
            verb = "describes" if len(given) == 1 else "describe"
            raise SpecError(f"{', '.join(given)} {verb} a call: give --q-len too")
        emit(spec.explain())
        return EXIT_OK
    for name, default in CALL_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    emit(str(_explain_call(spec, args)))
    return EXIT_OK


def _check_call_numbers(args) -> None:
    """Every size given must be at least 1, and a block size a multiple of 16, whether or not
    --q-len is there to make a call of them."""
    for name in ("q_len", "kv_len", "batch", "heads", "kv_heads", "head_dim"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SpecError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.block_size is not None and (args.block_size < 16 or args.block_size % 16):
        raise SpecError(f"--block-size must be a positive multiple of 16, got {args.block_size}")


class _BackendOption(argparse.Action):
    """``--backend``, whose help lists the registered backends: read only when help is shown,
    so other commands never import torch."""

    @property
    def help(self):
        from flexspec import backends

        return f"{self._help}: {', '.join(backends())}"

    @help.setter
    def help(self, text):
        self._help = text

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def _explain_call(spec, args):
    """The runtime explanation of a call of the sizes the options give, without allocating q,
    k and v (only their shapes, dtype and device matter)."""
    import torch

    from flexspec import compile as compile_spec
    from flexspec.runtime.checks import as_device
    from flexspec.tools.values import bindings_from_text, parse_binds

    kv_len = args.q_len if args.kv_len is None else args.kv_len
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    attn = compile_spec(spec, backend=args.backend, block_size=args.block_size)
    target = _target(args)
    device = as_device("cpu" if target else args.device)
    dtype = getattr(torch, args.dtype)

    def placeholder(heads, length):
        # one element expanded: the shape a call would have, without its memory
        one = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)
        return one.expand(args.batch, heads, length, args.head_dim).requires_grad_(args.grad)

    q, k, v = placeholder(args.heads, args.q_len), placeholder(kv_heads, kv_len), \
        placeholder(kv_heads, kv_len)
    sizes = {"B": args.batch, "H": args.heads, "Q_LEN": args.q_len, "KV_LEN": kv_len}
    bindings, notes = bindings_from_text(attn, parse_binds(attn, args.bind), sizes)
    bindings = {name: value.to(device) for name, value in bindings.items()}
    if target:
        explanation = attn.explain(q, k, v, target=target["type"],
                                   capability=target["capability"], facts=target["facts"],
                                   **bindings)
        explanation = str(explanation) + "\n" + target["note"]
    else:
        explanation = attn.explain(q, k, v, **bindings)
    if notes:
        text = str(explanation) + "\nnot given with --bind, so explained with demo values:\n"
        return text + "\n".join(f"  {note}" for note in notes)
    return explanation


def _target(args) -> dict | None:
    """Where ``--device`` names a CUDA device this machine has not: the device to plan for from
    the CPU (what explain needs of a GPU is its compute capability and what is installed)."""
    import torch

    from flexspec.runtime import fa4

    if not args.device.startswith("cuda") or torch.cuda.is_available():
        if args.capability is not None or args.fa4:
            raise SpecError("--capability and --fa4 describe a GPU this machine does not have: "
                            "give them with --device cuda on a machine without CUDA")
        return None
    text = args.capability or "9.0"
    try:
        capability = tuple(int(part) for part in text.split("."))
    except ValueError:
        raise SpecError(f"--capability takes a compute capability such as 9.0 or 10.0, got "
                        f"{text!r}") from None
    return {"type": "cuda", "capability": capability, "facts": {fa4.INSTALLED: args.fa4},
            "note": f"planned without a GPU: a CUDA device of compute capability {text}, "
                    f"FlashAttention-4 {'installed' if args.fa4 else 'not installed'} "
                    "(--capability, --fa4)"}


# ---- render ------------------------------------------------------------------------------------


def _add_render(subparsers) -> None:
    p = subparsers.add_parser(
        "render", help="draw a spec's mask (and score bias) in the terminal",
        description="Draw the mask of a spec for one batch and head with Unicode blocks (queries "
                    "downwards, keys rightwards), the score its modifiers add to a zero logit, "
                    "and the density. Runtime tensors the spec reads get demo values unless "
                    "given with --bind.",
        epilog="--bind values are comma-separated ints, floats or booleans (true/false); V*N "
               "repeats V N times, e.g. --bind doc_ids=0*6,1*6,2*4. Give one value per "
               "position of the tensor's last dimension (doc_ids: KV_LEN values), all its "
               "values in order, or a single value to fill it.")
    p.add_argument("spec", metavar="SPEC",
                   help="a spec expression, e.g. 'causal & window(3)', or the name of a spec in "
                        "--file")
    p.add_argument("--q", type=int, default=16, metavar="N", help="query length (default 16)")
    p.add_argument("--kv", type=int, metavar="N", help="key/value length (default: --q)")
    p.add_argument("--batch", type=int, default=0, metavar="I",
                   help="batch index drawn (default 0)")
    p.add_argument("--head", type=int, default=0, metavar="J", help="head index drawn (default 0)")
    p.add_argument("--heads", type=int, metavar="H",
                   help="number of heads H the spec sees (default: from a --bind with an H "
                        "dimension, else 8 when the spec depends on heads, else --head + 1)")
    p.add_argument("--bind", action="append", default=[], metavar="NAME=VALUES",
                   help="a runtime tensor's values (repeatable)")
    p.add_argument("--file", "-f", metavar="F.attn",
                   help="an .attn file whose definitions and specs the spec may use")
    p.add_argument("--png", metavar="FILE", help="also write the picture to a PNG (needs "
                                                 "matplotlib: pip install 'flexspec[plot]')")
    p.add_argument("--width", type=int, metavar="N",
                   help="widest mask in characters before blocks are downsampled (default 128, "
                        "or the terminal's width)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the score heat (auto: when writing to a terminal)")


def cmd_render(args) -> int:
    from flexspec import compile as compile_spec
    from flexspec.tools.render import DEFAULT_WIDTH, render_png, render_text, resolve_heads
    from flexspec.tools.values import bindings_from_text, parse_binds

    kv = args.q if args.kv is None else args.kv
    for option, value in (("--q", args.q), ("--kv", kv)):
        if value < 1:
            raise SpecError(f"{option} must be at least 1, got {value}")
    for option, value in (("--batch", args.batch), ("--head", args.head)):
        if value < 0:
            raise SpecError(f"{option} must be 0 or more, got {value}")
    if args.heads is not None and args.heads < 1:
        raise SpecError(f"--heads must be at least 1, got {args.heads}")
    if args.heads is not None and args.head >= args.heads:
        raise SpecError(f"--head {args.head} does not exist with --heads {args.heads}")
    if args.width is not None and args.width < 2:
        raise SpecError(f"--width must be at least 2, got {args.width}")

    spec = _spec(args)
    attn = compile_spec(spec)

    flat = parse_binds(attn, args.bind)
    heads = resolve_heads(attn, args.head, args.heads, flat)
    sizes = {"B": args.batch + 1, "H": heads, "Q_LEN": args.q, "KV_LEN": kv}
    bindings, notes = bindings_from_text(attn, flat, sizes)

    tty = sys.stdout.isatty()
    width = args.width
    if width is None:
        width = DEFAULT_WIDTH
        if tty:
            width = max(16, min(width, shutil.get_terminal_size().columns - 10))
    color = args.color == "always" or (args.color == "auto" and tty
                                       and not os.environ.get("NO_COLOR"))
    text = render_text(attn, args.q, kv, batch=args.batch, head=args.head, heads=heads,
                       width_limit=width, color=color, **bindings)
    out = [text.rstrip("\n")]
    if notes:
        out += ["", "not given with --bind, so drawn with demo values:"]
        out += [f"  {note}" for note in notes]
    emit("\n".join(out))
    if args.png is not None:
        render_png(attn, args.png, args.q, kv, batch=args.batch, head=args.head, heads=heads,
                   **bindings)
        emit(f"wrote {args.png}")
    return EXIT_OK
