"""The ``flexspec`` command line: list, show, check, fmt here; explain and render (the commands
that compute on tensors) in :mod:`flexspec.tools.cli_run`.

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
from flexspec.tools.cli_run import _add_explain, _add_render, cmd_explain, cmd_render
from flexspec.tools.console import (EXIT_ERROR, EXIT_OK, EXIT_USAGE, STDIN_NAME, attn_files, emit,
                                    emit_error, read_file, shorten, table)

# `list` gives a signature the terminal's width beyond the other columns and SUMMARY_ROOM
# characters of summary, and never less than SIGNATURE_WIDTH (a few signatures with tensor
# defaults are long; `show` has them in full)
SIGNATURE_WIDTH = 48
SUMMARY_ROOM = 40


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
            emit_error(f"no pattern{where} has tag '{args.tag}'.{did_you_mean(args.tag, tags)} "
                 f"Tags: {', '.join(tags) or 'none'}")
            return EXIT_ERROR
        chosen = tagged
    if not chosen:
        emit_error(f"no pattern of kind '{args.kind}' in the registry")
        return EXIT_ERROR
    names = [p.name + (f" ({', '.join(p.aliases)})" if p.aliases else "") for p in chosen]
    columns = shutil.get_terminal_size().columns  # $COLUMNS, the terminal, or 80
    others = max(len(n) for n in names + ["NAME"]) + len("KIND ") + 3 * len("  ")
    signature_width = max(SIGNATURE_WIDTH, columns - others - SUMMARY_ROOM)
    rows = [("NAME", "KIND", "SIGNATURE", "SUMMARY")]
    for name, p in zip(names, chosen):
        rows.append((name, p.kind, shorten(p.signature(), signature_width), p.summary))
    emit(table(rows, columns if sys.stdout.isatty() else None))
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
    if p.align == "end":
        out.append("align:      end (query positions counted from the end: without q_offset, row i stands at KV_LEN - Q_LEN + i)")
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
    emit("\n".join(out))
    return EXIT_OK


# ---- check -------------------------------------------------------------------------------------


def _add_check(subparsers) -> None:
    p = subparsers.add_parser("check", help="check .attn files",
                              description="Check .attn files: syntax, names, kinds, types and "
                                          "arguments. Every error of a file is reported, to "
                                          "stderr with file:line:col.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="an .attn file, a folder (every .attn file under it, hidden folders "
                        "left out) or - (the standard input)")


def cmd_check(args) -> int:
    from flexspec.lang import ast
    from flexspec.lang.library import check_text
    from flexspec.lang.parser import parse_file

    status = EXIT_OK
    for path in attn_files(args.files):
        name = STDIN_NAME if path == "-" else path
        try:
            if Path(path).is_dir():  # attn_files keeps a folder that holds none
                raise SpecError(f"{path}: no .attn file in this folder or below it")
            text = read_file(path)
            errors = check_text(text, name)
        except SpecError as err:
            errors = [err]
        if errors:
            for err in errors:
                emit_error(str(err))
            status = EXIT_ERROR
            continue
        statements = parse_file(text, name).statements
        specs = sum(isinstance(s, ast.SpecDef) for s in statements)
        definitions = len(statements) - specs
        emit(f"{name}: ok ({specs} spec{'s' * (specs != 1)}, "
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
            text = read_file(path)
            formatted = format_attn(text, path)
        except SpecError as err:
            emit_error(str(err))
            status = EXIT_ERROR
            continue
        if formatted == text:
            continue
        if args.check:
            emit_error(f"would reformat {path}")
            status = EXIT_ERROR
            continue
        try:
            _write(path, formatted)
        except OSError as err:
            emit_error(f"cannot write {path}: {err.strerror or err}")
            status = EXIT_ERROR
            continue
        emit(f"reformatted {path}")
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
        emit_error(str(err))
        return EXIT_ERROR
    except BrokenPipeError:  # `flexspec list | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
