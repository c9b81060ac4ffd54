"""Every example of ``docs/language.md`` does what the page says, and every Python block of
``README.md`` and ``docs/howto.md`` runs as written (see the second half of this file).

Fenced blocks of ``docs/language.md`` by language:

* ``flexspec``: one spec per line (``#`` comments allowed); each must parse and check;
* ``attn``: an ``.attn`` file that must check without errors;
* ``explain``: a spec on the first line, then exactly what ``spec.explain()`` prints;
* ``error``: a spec on the first line, then exactly the error it raises, as printed;
* ``attn-error``: a file, a ``---`` line, then exactly the errors ``check_text(text,
  "model.attn")`` returns, as printed, one after the other;
* anything else (``text``, ``python``) is not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import flexspec
from flexspec.lang.library import check_text, load_text

DOC = Path(__file__).resolve().parent.parent / "docs" / "language.md"
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\s*$", re.S | re.M)


def blocks(kind: str) -> list[tuple[int, str]]:
    text = DOC.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) == kind:
            line = text.count("\n", 0, match.start()) + 2
            found.append((line, match.group(2)))
    return found


def ids(items):
    return [f"language.md:{line}" for line, _ in items]


def registry_or_skip():
    try:
        flexspec.lang.registry.registry()
    except flexspec.SpecError as err:
        pytest.skip(f"the registry does not load: {err.message}")


def test_the_page_has_checked_examples():
    for kind in ("flexspec", "attn", "explain", "error", "attn-error"):
        assert blocks(kind), kind


SPEC_LINES = [(line + i, spec.split("#")[0].strip())
              for line, body in blocks("flexspec")
              for i, spec in enumerate(body.splitlines())
              if spec.split("#")[0].strip()]


@pytest.mark.parametrize("line, text", SPEC_LINES, ids=ids(SPEC_LINES))
def test_spec_examples_check(line, text):
    registry_or_skip()
    spec = flexspec.parse(text)
    assert flexspec.parse(str(spec)) == spec


@pytest.mark.parametrize("line, text", blocks("attn"), ids=ids(blocks("attn")))
def test_attn_examples_check(line, text):
    registry_or_skip()
    errors = check_text(text, f"language.md:{line}")
    assert errors == [], "\n".join(str(e) for e in errors)
    library = load_text(text)
    for name in library:
        assert flexspec.parse(str(library[name]), library=library) == library[name]


@pytest.mark.parametrize("line, body", blocks("explain"), ids=ids(blocks("explain")))
def test_explain_examples(line, body):
    registry_or_skip()
    spec_text, expected = body.split("\n", 1)
    assert flexspec.parse(spec_text).explain() == expected.rstrip("\n")


@pytest.mark.parametrize("line, body", blocks("error"), ids=ids(blocks("error")))
def test_error_examples(line, body):
    registry_or_skip()
    spec_text, expected = body.split("\n", 1)
    with pytest.raises(flexspec.SpecError) as info:
        flexspec.parse(spec_text)
    assert str(info.value) == expected.rstrip("\n")


@pytest.mark.parametrize("line, body", blocks("attn-error"), ids=ids(blocks("attn-error")))
def test_attn_error_examples(line, body):
    registry_or_skip()
    text, expected = body.split("\n---\n", 1)
    errors = check_text(text + "\n", "model.attn")
    assert errors, "the example is meant to fail"
    assert "\n".join(str(e) for e in errors) == expected.rstrip("\n")


def test_the_packed_training_example_learns(capsys):
    """examples/packed_training.py, shortened: the loss printed at step 20 is below the first."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "examples" / "packed_training.py"
    spec = importlib.util.spec_from_file_location("packed_training", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.STEPS = 20
    example.main()
    losses = [float(line.split("loss")[1].split()[0])
              for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[1] < losses[0] - 1.0


@pytest.mark.parametrize("arguments", [[], ["--spec", "causal & (window(24) | sink(4)) + alibi",
                                             "--requests", "16", "--seed", "3"]])
def test_the_serving_example_gives_every_request_its_tokens_alone(arguments, capsys):
    """examples/serving.py (issue 27): continuous batching over a paged cache, requests
    arriving and finishing at random in slots of any order, equal token for token to each
    request run alone over contiguous keys and values."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "examples" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(arguments) == 0
    out = capsys.readouterr().out
    assert "DIFFERENT" not in out
    count = int(arguments[arguments.index("--requests") + 1]) if arguments else 12
    assert f"{count} of {count} requests gave the tokens they give alone" in out


def test_the_serving_example_tells_a_wrong_cache_from_a_right_one(monkeypatch, capsys):
    """The example's check can fail: with the paged call reading a neighbour's slot, it says
    so and exits 1."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "examples" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_wrong", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    import flexspec
    from flexspec.runtime import Attention
    real = Attention.paged

    def neighbours(self, q, cache, slots=None, *, step, **kw):  # the example's steps
        wrong = flexspec.Step(slots=(step.slots + 1) % cache.slots, new_tokens=step.new_tokens)
        return real(self, q, cache, step=wrong, **kw)
    monkeypatch.setattr(Attention, "paged", neighbours)
    assert example.main([]) == 1
    assert "DIFFERENT" in capsys.readouterr().out


# ---- the Python of README.md and docs/howto.md, run as written ----------------------------------
#
# Every ```python block of these pages runs on the CPU in a fresh namespace, in a temporary
# folder that holds the files the page shows: a block whose first line is `# NAME.attn` is that
# file. A block that cannot run here says so in an HTML comment on the line before it,
# `<!-- not run: REASON -->` (rendered pages do not show it); there are few, each with a reason.

ROOT = Path(__file__).resolve().parent.parent
RUN_PAGES = [ROOT / "README.md", ROOT / "docs" / "howto.md"]
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")
MOST_NOT_RUN = 3


def page_blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """``(line, language, text, reason not run)`` of every fenced block of a page."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        line = text.count("\n", 0, match.start()) + 2
        found.append((line, match.group(1), match.group(2), skip.group(1) if skip else None))
    return found


PYTHON_BLOCKS = [(path, line, body, reason) for path in RUN_PAGES
                 for line, kind, body, reason in page_blocks(path) if kind == "python"]


def attn_files(path: Path) -> dict[str, str]:
    """The .attn files a page shows: blocks whose first line is `# NAME.attn`."""
    files = {}
    for _, _, body, _ in page_blocks(path):
        first = body.split("\n", 1)[0]
        if re.fullmatch(r"# [\w.-]+\.attn", first.strip()):
            files[first.strip()[2:]] = body
    return files


def test_the_pages_have_python_to_run_and_few_blocks_that_are_not():
    assert len(PYTHON_BLOCKS) >= 10
    not_run = [(path.name, line, reason) for path, line, _, reason in PYTHON_BLOCKS if reason]
    assert len(not_run) <= MOST_NOT_RUN, not_run
    assert all(len(reason) > 20 for _, _, reason in not_run), "say why it cannot run"


@pytest.mark.parametrize("path, line, body, reason", PYTHON_BLOCKS,
                         ids=[f"{p.name}:{line}" for p, line, _, _ in PYTHON_BLOCKS])
def test_python_blocks_run_as_written(path, line, body, reason, tmp_path, monkeypatch):
    if reason is not None:
        pytest.skip(f"{path.name}:{line} is marked not run: {reason}")
    if re.search(r"^\s*import transformers", body, re.M):
        pytest.importorskip("transformers")
    for name, text in attn_files(path).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code = compile(body, f"{path.relative_to(ROOT)}:{line}", "exec")
    exec(code, {"__name__": "__docs__"})
