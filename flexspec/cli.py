"""The ``flexspec`` command line: list, show, check, fmt, explain.

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

from . import __version__
from .errors import SpecError, did_you_mean

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
SIGNATURE_WIDTH = 48  # `list` shortens longer signatures


def _out(text: str = "") -> None:
    print(text, file=sys.stdout)


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _read(path: str) -> str:
    """A file's text; an unreadable file is a :class:`SpecError` naming it."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise SpecError(f"cannot read {path}: {reason}") from None


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
    from . import patterns

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


def _picture(pattern) -> str | None:
    """HOOK: the example's mask drawn with Unicode blocks, or None when there is no picture.

    Not drawn yet (a later step renders ``pattern.example`` at a small size); ``show`` prints
    whatever this returns when it is not None.
    """
    return None


def _indent(text: str, prefix: str = "  ") -> str:
    return textwrap.indent(text.strip("\n"), prefix)


def cmd_show(args) -> int:
    from . import pattern as get_pattern

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
    picture = _picture(p)
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
    from . import ast
    from .library import check_text
    from .parser import parse_file

    status = EXIT_OK
    for path in args.files:
        try:
            text = _read(path)
            errors = check_text(text, path)
        except SpecError as err:
            errors = [err]
        if errors:
            for err in errors:
                _err(str(err))
            status = EXIT_ERROR
            continue
        statements = parse_file(text, path).statements
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
    from .fmt import format_attn

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
    p = subparsers.add_parser("explain", help="show the IR a spec resolves to",
                              description="Parse and check a spec and print its resolved, "
                                          "simplified mask and score expressions.")
    p.add_argument("spec", metavar="SPEC",
                   help="a spec expression, e.g. 'causal & window(128) + alibi', or the name of "
                        "a spec in --file")
    p.add_argument("--file", "-f", metavar="F.attn",
                   help="an .attn file whose definitions and specs the spec may use")


def cmd_explain(args) -> int:
    from . import load, parse

    library = load(args.file) if args.file is not None else None
    if library is not None and args.spec.strip() in library:
        spec = library[args.spec.strip()]
    else:
        spec = parse(args.spec, library=library)
    _out(spec.explain())
    return EXIT_OK


# ---- the parser and main -------------------------------------------------------------------------

# name -> (adds the subparser, runs the command); help lists them in this order.
COMMANDS = {
    "list": (_add_list, cmd_list),
    "show": (_add_show, cmd_show),
    "check": (_add_check, cmd_check),
    "fmt": (_add_fmt, cmd_fmt),
    "explain": (_add_explain, cmd_explain),
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
