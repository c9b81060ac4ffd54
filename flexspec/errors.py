"""Source text, spans and the errors flexspec raises.

Every error a user can provoke is a :class:`SpecError`. It knows where it happened (source name,
1-based line and column) and renders as ``name:line:col: message`` followed by the source line and
a caret under the offending span, the way compilers do.
"""

from __future__ import annotations

import bisect
import difflib
import functools
import re
from dataclasses import dataclass, field

# A line ends at "\n", "\r\n" or a lone "\r": files saved on Windows or old Macs count their
# lines as an editor shows them.
LINE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Source:
    """A piece of text and the name to show for it (a file path, ``<spec>``, a pattern file...).

    ``line_offset`` and ``column_offset`` place the text inside a larger file (a definition embedded
    in a YAML pattern file starts at that file's line and column, not at 1:1).
    """

    text: str
    name: str = "<spec>"
    line_offset: int = 0
    column_offset: int = 0

    @functools.cached_property
    def _line_starts(self) -> list[int]:
        """The offset where each line starts (computed once: a file may have many errors)."""
        return [0] + [match.end() for match in LINE_BREAK.finditer(self.text)]

    def _line_index(self, offset: int) -> int:
        """The 0-based line of a character offset (the break ending a line belongs to it)."""
        offset = max(0, min(offset, len(self.text)))
        return bisect.bisect_right(self._line_starts, offset) - 1

    def line_start(self, offset: int) -> int:
        """The offset of the first character of the line that holds ``offset``."""
        return self._line_starts[self._line_index(offset)]

    def line_col(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) in the enclosing file of a 0-based character offset."""
        offset = max(0, min(offset, len(self.text)))
        line = self._line_index(offset)
        column = offset - self._line_starts[line] + 1
        if line == 0:
            column += self.column_offset
        return line + 1 + self.line_offset, column

    def line_text(self, offset: int) -> str:
        """The text of the line that holds ``offset`` (without its line break)."""
        start = self.line_start(offset)
        end = LINE_BREAK.search(self.text, start)
        return self.text[start : end.start() if end is not None else len(self.text)]


@dataclass(frozen=True)
class Span:
    """A half-open character range ``[start, end)`` of a :class:`Source`."""

    source: Source = field(repr=False)
    start: int
    end: int


class SpecError(ValueError):
    """Base of every error flexspec raises for bad input.

    A ``ValueError``, as torch's own errors for a wrong shape or dtype are, so that code written
    for torch (``except ValueError``) catches flexspec's too; errors about a value of the wrong
    Python type are also ``TypeError``s (:class:`SpecTypeError`). Attributes: ``message`` (what is wrong and how to fix it), ``source_name``, ``line`` and
    ``column`` (1-based; ``None`` where no position applies) and ``span``.
    """

    kind = "error"

    def __init__(self, message: str, span: Span | None = None, *, source_name: str | None = None,
                 line: int | None = None, column: int | None = None):
        self.message = message
        self.span = span
        if span is not None:
            line, column = span.source.line_col(span.start)
            source_name = source_name or span.source.name
        self.source_name = source_name
        self.line = line
        self.column = column
        super().__init__(self.render())

    def render(self) -> str:
        """``name:line:col: message``, then the source line with a caret under the span."""
        where = self.source_name or ""
        if self.line is not None:
            where += f":{self.line}:{self.column}"
        head = f"{where}: {self.message}" if where else self.message
        if self.span is None:
            return head
        source, start, end = self.span.source, self.span.start, self.span.end
        text = source.line_text(start)
        line_start = source.line_start(start)
        column = start - line_start
        width = max(1, min(end, line_start + len(text)) - start)
        indent = "".join(ch if ch == "\t" else " " for ch in text[:column])
        return f"{head}\n    {text}\n    {indent}{'^' * width}"

    def __str__(self) -> str:
        return self.render()


class SpecTypeError(SpecError, TypeError):
    """A value of the wrong Python type where flexspec expects another (spec text that is not a
    str, a library that is not a :class:`~flexspec.Library`): both a :class:`SpecError` and a
    ``TypeError``, as Python's own errors for a wrong type are."""

    kind = "type error"


class SpecSyntaxError(SpecError):
    """The text does not follow the grammar."""

    kind = "syntax error"


class SpecCheckError(SpecError):
    """The text parses but does not make sense: unknown names, wrong kinds, types or arguments."""

    kind = "check error"


class RegistryError(SpecError):
    """A pattern file of the registry is malformed, or a pattern name is unknown."""

    kind = "registry error"


class BindingError(SpecError):
    """A runtime tensor binding is missing, unexpected, or has the wrong shape, dtype or device."""

    kind = "binding error"


class BindingTypeError(BindingError, SpecTypeError):
    """A call's input of the wrong Python type (``q must be a torch.Tensor, got list``): a
    :class:`BindingError` that is also a ``TypeError``."""

    kind = "binding error"


def did_you_mean(name: str, candidates) -> str:
    """`` Did you mean 'window'?`` for the closest candidates, or an empty string."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=3, cutoff=0.6)
    if not close:
        return ""
    if len(close) == 1:
        return f" Did you mean '{close[0]}'?"
    return " Did you mean " + ", ".join(f"'{c}'" for c in close[:-1]) + f" or '{close[-1]}'?"
