"""What every command of the command line shares: exit codes, output to stdout and stderr, reading
a file (or the standard input, ``-``) with a size limit, the ``.attn`` files a folder holds, and
plain-text tables."""

from __future__ import annotations

import sys
from pathlib import Path

from flexspec.errors import SpecError
from flexspec.limits import MAX_FILE_CHARS, check_file_length

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def emit(text: str = "") -> None:
    print(text, file=sys.stdout)


def emit_error(text: str) -> None:
    print(text, file=sys.stderr)


STDIN_NAME = "<stdin>"  # what messages call the standard input, read for the path "-"


def read_file(path: str) -> str:
    """A file's text (``-``: the standard input's); an unreadable or oversized file is a
    :class:`SpecError` naming it."""
    name = STDIN_NAME if path == "-" else path
    try:
        if path == "-":
            text = sys.stdin.read(MAX_FILE_CHARS + 1)
        else:
            with open(path, encoding="utf-8", newline="") as f:
                # .attn files are a few kilobytes; the limit keeps `check /dev/zero` from
                # reading on
                text = f.read(MAX_FILE_CHARS + 1)
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise SpecError(f"cannot read {name}: {reason}") from None
    check_file_length(len(text), name)
    return text


def attn_files(paths: list[str]) -> list[str]:
    """The paths given, with each folder replaced by the ``.attn`` files under it, sorted
    (folders whose name starts with a dot, such as ``.git`` and ``.venv``, are left out). A
    folder without any is kept as it is, so that reading it fails with its name."""
    found = []
    for path in paths:
        folder = Path(path)
        if path == "-" or not folder.is_dir():
            found.append(path)
            continue
        files = sorted(str(p) for p in folder.rglob("*.attn") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(folder).parts[:-1]))
        found.extend(files or [path])
    return found


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def table(rows: list[tuple[str, ...]], width: int | None = None) -> str:
    """Left-aligned columns two spaces apart; the last column is cut to ``width`` if given."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        line = f"{line}  {row[-1]}" if widths else row[-1]
        if width is not None and len(line) > width:
            line = shorten(line, max(width, 1))
        lines.append(line.rstrip())
    return "\n".join(lines)
