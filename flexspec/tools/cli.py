"""The ``flexspec`` command line: list, show, check, fmt, explain, render.

Every subcommand is one ``_add_NAME(subparsers)`` function that declares its arguments and one
``cmd_NAME(args) -> int`` that runs it; :data:`COMMANDS` lists them in the order ``--help`` shows.
Exit codes: 0 success, 1 bad input (a spec or file error, a check that fails), 2 bad usage.
Errors go to stderr as ``name:line:col: message`` with the source line and a caret; a
:class:`~flexspec.errors.SpecError` never becomes a traceback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from pathlib import Path

from flexspec import __version__
from flexspec.errors import SpecError, did_you_mean

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
SIGNATURE_WIDTH = 48  # `list` shortens longer signatures
# .attn files are a few kilobytes; a limit keeps `flexspec check /dev/zero` from reading forever
MAX_FILE_CHARS = 16 * 1024 * 1024


def _out(text: str = "") -> None:
    print(text, file=sys.stdout)


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _read(path: str) -> str:
    """A file's text; an unreadable or oversized file is a :class:`SpecError` naming it."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read(MAX_FILE_CHARS + 1)
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise SpecError(f"cannot read {path}: {reason}") from None
    if len(text) > MAX_FILE_CHARS:
        raise SpecError(f"cannot read {path}: it is longer than {MAX_FILE_CHARS} characters, "
                        "which no .attn file needs")
    return text


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _table(rows: list[tuple[str, ...]], width: int | None = None) -> str:
    """Left-aligned columns two spaces apart; the last column is cut to ``width`` if given."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        line = f"{line}  {row[-1]}" if widths else row[-1]
        if width is not None and len(line) > width:
            line = _shorten(line, max(width, 1))
        lines.append(line.rstrip())
    return "\n".join(lines)


# ---- list --------------------------------------------------------------------------------------


def _add_list(subparsers) -> None:
    p = subparsers.add_parser("list", help="list the registry's patterns",
                              description="List the named patterns of the registry.")
    p.add_argument("--kind", choices=("mask", "score"), help="only patterns of this kind")
    p.add_argument("--tag", metavar="T", help="only patterns with this tag")


def cmd_list(args) -> int:
    from flexspec import patterns

    everything = patterns()
    chosen = [p for p in everything if args.kind is None or p.kind == args.kind]
    if args.tag is not None:
        tagged = [p for p in chosen if args.tag in p.tags]
        if not tagged:
            tags = sorted({t for p in chosen for t in p.tags})
            where = f" of kind {args.kind}" if args.kind else ""
            _err(f"no pattern{where} has tag '{args.tag}'.{did_you_mean(args.tag, tags)} "
                 f"Tags: {', '.join(tags) or 'none'}")
            return EXIT_ERROR
        chosen = tagged
    if not chosen:
        _err(f"no pattern of kind '{args.kind}' in the registry")
        return EXIT_ERROR
    rows = [("NAME", "KIND", "SIGNATURE", "SUMMARY")]
    for p in chosen:
        name = p.name + (f" ({', '.join(p.aliases)})" if p.aliases else "")
        # a few signatures are very long (tensor defaults); `show` has them in full
        rows.append((name, p.kind, _shorten(p.signature(), SIGNATURE_WIDTH), p.summary))
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    _out(_table(rows, width))
    return EXIT_OK


# ---- show --------------------------------------------------------------------------------------


def _add_show(subparsers) -> None:
    p = subparsers.add_parser("show", help="show one pattern in full",
                              description="Show a pattern: parameters, definition, documentation, "
                                          "references and an example.")
    p.add_argument("name", metavar="NAME", help="a pattern name or alias")
    p.add_argument("--no-picture", action="store_true",
                   help="leave out the picture of the example (skips loading torch)")


PICTURE_SIZE = 16  # `show` draws the example at Q_LEN = KV_LEN = 16


def _picture(pattern) -> str | None:
    """The example's mask (and score heat) drawn with Unicode blocks at 16x16, with demo values
    for the runtime tensors it reads; a line saying why when it cannot be drawn."""
    from flexspec.tools.render import render_example

    try:
        return "picture of the example:\n" + render_example(pattern.example, PICTURE_SIZE)
    except SpecError as err:
        return f"(no picture of the example: {err.message})"


def _indent(text: str, prefix: str = "  ") -> str:
    return textwrap.indent(text.strip("\n"), prefix)


def cmd_show(args) -> int:
    from flexspec import pattern as get_pattern

    p = get_pattern(args.name)
    out = []
    head = f"{p.name} ({p.kind})"
    if args.name != p.name:
        head += f"  [{args.name} is an alias of {p.name}]"
    out.append(head)
    out.append(f"  {p.summary}")
    out.append("")
    out.append(f"signature:  {p.signature()}")
    out.append(f"aliases:    {', '.join(p.aliases) or '-'}")
    out.append(f"tags:       {', '.join(p.tags) or '-'}")
    out.append(f"definition: {p.definition.strip()}")
    if p.params:
        out.append("")
        out.append("parameters:")
        for param in p.params:
            kind = param.type if param.dims is None else \
                f"{param.type}[{', '.join(str(d) for d in param.dims)}]"
            facts = [f"type {kind}"]
            facts.append(f"default {param.default}" if param.default is not None else "required")
            if param.constraint is not None:
                facts.append(f"constraint {param.constraint}")
            out.append(f"  {param.name}: {', '.join(facts)}")
            if param.doc:
                out.append(_indent(textwrap.fill(param.doc.strip(), 92), "      "))
    if p.description:
        out.append("")
        out.append("description:")
        out.append(_indent(p.description))
    out.append("")
    out.append("references:")
    for ref in p.references:
        out.append(f"  - {ref.title}")
        out.append(f"    {ref.url}")
    out.append("")
    out.append("example:")
    out.append(f"  {p.example}")
    picture = None if args.no_picture else _picture(p)
    if picture is not None:
        out.append("")
        out.append(_indent(picture))
    _out("\n".join(out))
    return EXIT_OK


# ---- check -------------------------------------------------------------------------------------


def _add_check(subparsers) -> None:
    p = subparsers.add_parser("check", help="check .attn files",
                              description="Check .attn files: syntax, names, kinds, types and "
                                          "arguments. Errors go to stderr with file:line:col.")
    p.add_argument("files", nargs="+", metavar="FILE", help="an .attn file")


def cmd_check(args) -> int:
    from flexspec.lang import ast
    from flexspec.lang.library import check_module
    from flexspec.lang.parser import parse_file

    status = EXIT_OK
    for path in args.files:
        try:
            module = parse_file(_read(path), path)
            errors = check_module(module, path)
        except SpecError as err:
            errors = [err]
        if errors:
            for err in errors:
                _err(str(err))
            status = EXIT_ERROR
            continue
        statements = module.statements
        specs = sum(isinstance(s, ast.SpecDef) for s in statements)
        definitions = len(statements) - specs
        _out(f"{path}: ok ({specs} spec{'s' * (specs != 1)}, "
             f"{definitions} definition{'s' * (definitions != 1)})")
    return status


# ---- fmt ---------------------------------------------------------------------------------------


def _add_fmt(subparsers) -> None:
    p = subparsers.add_parser("fmt", help="format .attn files in place",
                              description="Rewrite .attn files in canonical form: one statement "
                                          "per line, comments and single blank lines kept.")
    p.add_argument("files", nargs="+", metavar="FILE", help="an .attn file")
    p.add_argument("--check", action="store_true",
                   help="write nothing; list the files that would change and exit 1 if any")


def cmd_fmt(args) -> int:
    from flexspec.lang.fmt import format_attn

    status = EXIT_OK
    for path in args.files:
        try:
            text = _read(path)
            formatted = format_attn(text, path)
        except SpecError as err:
            _err(str(err))
            status = EXIT_ERROR
            continue
        if formatted == text:
            continue
        if args.check:
            _err(f"would reformat {path}")
            status = EXIT_ERROR
            continue
        try:
            _write(path, formatted)
        except OSError as err:
            _err(f"cannot write {path}: {err.strerror or err}")
            status = EXIT_ERROR
            continue
        _out(f"reformatted {path}")
    return status


def _write(path: str, text: str) -> None:
    """Replace a file's text atomically, keeping its permissions."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.flexspec-fmt")
    with open(temporary, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    try:
        os.chmod(temporary, target.stat().st_mode)
        os.replace(temporary, target)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise


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
    p.add_argument("--batch", type=int, default=1, metavar="B", help="batch size (default 1)")
    p.add_argument("--heads", type=int, default=16, metavar="H",
                   help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, metavar="H",
                   help="key/value heads (default: --heads; fewer means grouped-query)")
    p.add_argument("--head-dim", type=int, default=128, metavar="D",
                   help="head dimension (default 128)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="input dtype (default bfloat16)")
    p.add_argument("--device", default="cpu", help="device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--grad", action="store_true", help="the inputs require gradients")
    p.add_argument("--backend", default="auto", action=_BackendOption,
                   help="the backend asked for (default auto)")
    p.add_argument("--block-size", type=int, default=128, metavar="N",
                   help="block size of the block mask (default 128)")
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


def cmd_explain(args) -> int:
    spec = _spec(args)
    if args.q_len is None:
        runtime_options = ("kv_len", "kv_heads", "grad", "bind")
        given = [f"--{name.replace('_', '-')}" for name in runtime_options if getattr(args, name)]
        given += [option for option, used in (("--device", args.device != "cpu"),
                                              ("--backend", args.backend != "auto")) if used]
        if given:
            verb = "describes" if len(given) == 1 else "describe"
            raise SpecError(f"{', '.join(given)} {verb} a call: give --q-len too")
        _out(spec.explain())
        return EXIT_OK
    _out(str(_explain_call(spec, args)))
    return EXIT_OK


class _BackendOption(argparse.Action):
    """``--backend``, whose help lists the registered backends: read only when help is shown,
    so other commands never import torch."""

    @property
    def help(self):
        from flexspec.runtime.backends import BACKENDS

        return f"{self._help}: {', '.join(BACKENDS)}"

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
    from flexspec.runtime.inputs import as_device
    from flexspec.tools.values import bindings_from_text, parse_binds

    kv_len = args.q_len if args.kv_len is None else args.kv_len
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    for option, value in (("--q-len", args.q_len), ("--kv-len", kv_len),
                          ("--batch", args.batch), ("--heads", args.heads),
                          ("--kv-heads", kv_heads), ("--head-dim", args.head_dim)):
        if value < 1:
            raise SpecError(f"{option} must be at least 1, got {value}")
    attn = compile_spec(spec, backend=args.backend, block_size=args.block_size)
    device = as_device(args.device)
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
    explanation = attn.explain(q, k, v, **bindings)
    if notes:
        text = str(explanation) + "\nnot given with --bind, so explained with demo values:\n"
        return text + "\n".join(f"  {note}" for note in notes)
    return explanation


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
    _out("\n".join(out))
    if args.png is not None:
        render_png(attn, args.png, args.q, kv, batch=args.batch, head=args.head, heads=heads,
                   **bindings)
        _out(f"wrote {args.png}")
    return EXIT_OK


# ---- the parser and main -------------------------------------------------------------------------

# name -> (adds the subparser, runs the command); help lists them in this order.
COMMANDS = {
    "list": (_add_list, cmd_list),
    "show": (_add_show, cmd_show),
    "check": (_add_check, cmd_check),
    "fmt": (_add_fmt, cmd_fmt),
    "explain": (_add_explain, cmd_explain),
    "render": (_add_render, cmd_render),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexspec",
        description="Describe attention variants in a tiny language "
                    "('causal & window(128) + alibi') and compile them to FlexAttention.",
        epilog="Run 'flexspec COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"flexspec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add, _run in COMMANDS.values():
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse's usage errors give 2)."""
    for stream in (sys.stdout, sys.stderr):
        # a terminal or pipe whose encoding lacks the picture's glyphs (cp1252, ascii) gets '?'
        # for them rather than a UnicodeEncodeError
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        code = exit_.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_USAGE)
    try:
        return COMMANDS[args.command][1](args)
    except SpecError as err:
        _err(str(err))
        return EXIT_ERROR
    except BrokenPipeError:  # `flexspec list | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
