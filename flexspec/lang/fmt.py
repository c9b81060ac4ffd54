"""The ``.attn`` formatter: text -> canonical text, comments kept.

Each statement is printed by the canonical printer on one line. Comments stay where they were
relative to the statements: a full-line comment stays before the statement that follows it (or at
the end of the file), a comment at the end of a statement's last line stays there (two spaces, then
``# ...``), and a comment inside a statement written over several lines moves just before that
statement. Runs of blank lines become one blank line; blank lines at the start and end go.

Formatting is idempotent and never changes the meaning: the output parses to the same module.

>>> print(format_attn("mask local(n:int=1024)=causal&window(n)  # local\\n\\n\\n\\nspec s=local+alibi"), end="")
mask local(n: int = 1024) = causal & window(n)  # local
<BLANKLINE>
spec s = local + alibi
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexspec.errors import SpecError
from flexspec.lang.parser import parse_file, parse_file_with_comments
from flexspec.lang.ast import format_node


@dataclass
class _Item:
    """One output block: a statement (with its comments) or a free-standing comment."""

    first: int  # first and last source line (1-based), for the blank lines between blocks
    last: int
    text: str = ""
    statement: object = None
    leading: list = field(default_factory=list)
    trailing: str | None = None

    def render(self) -> list[str]:
        if self.statement is None:
            return [self.text]
        line = format_node(self.statement)
        if self.trailing is not None:
            line += "  " + self.trailing
        return self.leading + [line]


def format_attn(text: str, name: str = "<file>") -> str:
    """The canonical text of an ``.attn`` file; a syntax error raises :class:`SpecSyntaxError`."""
    module, comments = parse_file_with_comments(text, name)
    items: list[_Item] = []
    for statement in module.statements:
        source, span = statement.span.source, statement.span
        first = source.line_col(span.start)[0]
        last = source.line_col(max(span.start, span.end - 1))[0]
        items.append(_Item(first, last, statement=statement))
    statements = list(items)
    for line, comment in comments:
        comment = comment.rstrip()
        # Nothing can follow a comment on its line, so a statement ending on that line ends before
        # the comment: the comment trails it. One that merely spans the line holds the comment.
        ending = [item for item in statements if item.last == line]
        if ending:
            ending[-1].trailing = comment
            continue
        holding = [item for item in statements if item.first <= line < item.last]
        if holding:
            holding[0].leading.append(comment)
            continue
        items.append(_Item(line, line, text=comment))
    items.sort(key=lambda item: (item.first, item.statement is not None))
    lines: list[str] = []
    previous = None
    for item in items:
        if previous is not None and item.first - previous.last > 1:
            lines.append("")
        lines.extend(item.render())
        previous = item
    result = "".join(line + "\n" for line in lines)
    if parse_file(result, name) != module:  # a printer bug must never corrupt a user's file
        raise SpecError(f"{name}: formatting would change the file's meaning (a flexspec bug; "
                        "please report it); the file is left as it is")
    return result
