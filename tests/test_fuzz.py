"""No text may make the front end raise anything but :class:`flexspec.SpecError`.

Hypothesis feeds random text (from an alphabet rich in the language's own characters), random
token sequences (which get past the parser far more often and so reach the checker), and
mutations of valid specs and ``.attn`` files (characters inserted, deleted, replaced; tokens
duplicated, dropped, swapped) to ``flexspec.parse``, ``flexspec.lang.library.check_text`` and
``flexspec.lang.library.load_text``. Whatever they raise must be a ``SpecError`` with a message and a
rendering; in particular never a lark exception, a ``RecursionError``, a ``ZeroDivisionError``
from constant folding, or a ``KeyError``/``AssertionError`` from a half-handled case.

The example counts keep the file under ~40 s on a 2-core CPU; raise ``FUZZ_SCALE`` in the
environment to fuzz harder (e.g. ``FUZZ_SCALE=20``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexspec
from flexspec.errors import Source
from flexspec.lang.library import check_text, load_text
from flexspec.lang.parser import parse_expr, parse_file

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))


def fuzz_settings(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def only_spec_errors(fn, text):
    """Call ``fn(text)``; a SpecError is fine (and must render), anything else fails the test."""
    try:
        result = fn(text)
    except flexspec.SpecError as err:
        rendered = str(err)
        assert err.message and err.message in rendered
        if err.line is not None:
            assert err.line >= 1 and err.column >= 1
        return None
    return result


def all_front_ends(text: str) -> None:
    only_spec_errors(flexspec.parse, text)
    errors = only_spec_errors(check_text, text)
    for err in errors or ():
        assert isinstance(err, flexspec.SpecError)
        str(err)
    library = only_spec_errors(load_text, text)
    if library is not None:
        # a clean file loads, and its specs print and parse back
        assert errors == []
        for name in library:
            spec = library[name]
            assert flexspec.parse(str(spec), library=library) == spec
    elif errors is not None:
        assert errors, "load_text failed but check_text found nothing"


# ---------------------------------------------------------------------------------------------
# Strategies

LANGUAGE_CHARS = "abcdefghijklmnopqrstuvwxyzABCHKLNQVEOS_0123456789()[],=+-*/%<>!&|~.:#\"\\' \t\n"
UNICODE = "\u00e9\u4e2d\u2028\u00a0\u200b\ufeff\U0001F600\r\x00\x0b"

random_text = st.text(
    st.one_of(st.sampled_from(LANGUAGE_CHARS), st.sampled_from(UNICODE),
              st.characters(blacklist_categories=("Cs",))),
    max_size=60)

VOCABULARY = [
    # statements and punctuation
    "mask", "score", "spec", "=", "(", ")", "[", "]", ",", ":", "+", "-", "*", "/", "//", "%",
    "<", "<=", ">", ">=", "==", "!=", "&", "|", "~", "#c\n", "\n", '"s"', '"a\\"b"', "'s'",
    # literals
    "0", "1", "-1", "3", "128", "2.5", "-0.5", "1e3", "inf", "-inf", "true", "false",
    "99999999999999999999999", "1e400",
    # names of the language and of the registry
    "q", "kv", "b", "h", "B", "H", "Q_LEN", "KV_LEN", "score", "abs", "min", "max", "clamp",
    "where", "tanh", "exp", "log", "sqrt", "floor", "sign", "alibi_slopes", "learnable",
    "int", "float", "bool", "tensor", "int[B, KV_LEN]", "float[H]",
    "causal", "window", "sliding_window", "doc", "document", "full", "prefix", "chunked",
    "alibi", "softcap", "scale", "t5_bias", "rel_bias", "head_bias", "windw", "x", "n", "c",
    "ids", "init", '"zeros"', '"normal"',
]

token_text = st.lists(st.sampled_from(VOCABULARY), max_size=16).map(" ".join)

SEED_SPECS = [
    "causal",
    "causal & window(128) + alibi",
    "causal & doc",
    "causal & doc(ids) + softcap(30.0)",
    "~causal | window(n=4) & prefix(3)",
    "sliding_window(1024) + alibi + softcap",
    "full + scale(0.5)",
    "(causal | window(2)) & ~chunked(4)",
    "softcap(20.0)",
    "causal_bottom_right & sink(4)",
]

SEED_FILES = [
    "mask local(n: int = 1024) = causal & window(n)\n"
    "score cap(c: float = 50.0) = c * tanh(score / c)\n"
    "spec even_layers = local(4096) + cap\n"
    "spec odd_layers = causal + cap\n",
    "# packed documents\n"
    "mask same(ids: int[B, KV_LEN]) = ids[b, q] == ids[b, kv]  # per batch\n"
    "spec packed = causal & same(doc_ids)\n",
    "score bias(w: float[H] = learnable(H, init=\"normal\")) = score + w[h] * abs(q - kv)\n"
    "score slope(s: float[H] = alibi_slopes(H)) = score - s[h] * abs(q - kv)\n"
    "mask lower = q >= kv & (q - kv) % 2 == 0 | kv < 4\n"
    "spec s = lower + bias + slope\n",
    "mask m(n: int = 3, f: float = -1.5, on: bool = true) = where(on, q // n, kv) > f\n"
    "spec s = m(n=4)\nspec t = s\n",
]

_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*|[0-9.]+(?:[eE][+-]?[0-9]+)?'
                    r"|//|<=|>=|==|!=|#[^\n]*|\s+|.", re.S)


@st.composite
def mutated(draw, seeds):
    text = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["insert", "delete", "replace", "dup", "drop", "swap", "cut"]))
        if how in ("insert", "delete", "replace", "cut"):
            pos = draw(st.integers(0, len(text)))
            if how == "insert":
                text = text[:pos] + draw(st.sampled_from(LANGUAGE_CHARS + UNICODE)) + text[pos:]
            elif how == "delete":
                text = text[:pos] + text[pos + draw(st.integers(1, 5)):]
            elif how == "replace":
                text = text[:pos] + draw(st.sampled_from(LANGUAGE_CHARS)) + text[pos + 1:]
            else:
                text = text[:pos]
            continue
        tokens = _TOKEN.findall(text)
        if not tokens:
            continue
        i = draw(st.integers(0, len(tokens) - 1))
        if how == "dup":
            tokens.insert(i, tokens[i])
        elif how == "drop":
            del tokens[i]
        else:
            j = draw(st.integers(0, len(tokens) - 1))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        text = "".join(tokens)
    return text


# ---------------------------------------------------------------------------------------------
# Properties


@fuzz_settings(350)
@given(random_text)
def test_random_text(text):
    all_front_ends(text)


@fuzz_settings(450)
@given(token_text)
def test_random_token_sequences(text):
    all_front_ends(text)


@fuzz_settings(350)
@given(mutated(SEED_SPECS))
def test_mutated_specs(text):
    all_front_ends(text)


@fuzz_settings(300)
@given(mutated(SEED_FILES))
def test_mutated_files(text):
    all_front_ends(text)


@fuzz_settings(150)
@given(st.one_of(random_text, token_text, mutated(SEED_FILES)))
def test_definition_expressions(text):
    only_spec_errors(lambda t: parse_expr(Source(t)), text)
    only_spec_errors(parse_file, text)


def test_seeds_are_valid():
    for text in SEED_SPECS:
        try:
            flexspec.parse(text)
        except flexspec.SpecError as err:  # the registry is filled concurrently
            if "unknown pattern" not in err.message:
                raise
    for text in SEED_FILES:
        errors = check_text(text)
        assert all("unknown" in e.message for e in errors), [str(e) for e in errors]


# ---------------------------------------------------------------------------------------------
# Deep nesting: a SpecError, never a RecursionError (or lark's wrapping of one)


DEEP_SPECS = [
    "(" * 5000,
    ")" * 5000,
    "(" * 5000 + "causal" + ")" * 5000,
    "~" * 5000 + "causal",
    " & ".join(["causal"] * 3000),
    " | ".join(["causal"] * 3000),
    "causal" + " + softcap(3.0)" * 1000,
    "(" * 3000 + "causal",
    "window(" * 3000,
]

DEEP_FILES = [
    "mask m = " + "(" * 2500 + "q > kv" + ")" * 2500 + "\n",
    "mask m = q > " + "-" * 2500 + "kv\n",
    "mask m = " + "~" * 2500 + "(q > kv)\n",
    "mask m = q > " + " + ".join(["kv"] * 1500) + "\n",
    "mask m = q > " + "abs(" * 1500 + "kv" + ")" * 1500 + "\n",
    "mask m(t: int[KV_LEN]) = q > " + "t[" * 1500 + "kv" + "]" * 1500 + "\n",
    "mask m = " + " & ".join(["q > kv"] * 1500) + "\n",
    "spec s = " + "~" * 2500 + "causal\n",
]

# Long chains of definitions that inline one another. Checking every definition of such a chain
# takes time quadratic in its length, so these run under a lowered recursion limit, which they
# cross at a short length.
CHAINS = [
    "\n".join(f"mask m{i} = m{i + 1}" for i in range(60)) + "\nmask m60 = q > kv\n",
    "\n".join(f"score s{i} = s{i + 1} * 2" for i in range(60)) + "\nscore s60 = score\n",
    "\n".join(f"spec s{i} = s{i + 1}" for i in range(60)) + "\nspec s60 = causal\n",
    "\n".join(f"mask m{i} = m{i + 1} & kv < {i}" for i in range(60)) + "\nmask m60 = q > kv\n",
]


@contextlib.contextmanager
def recursion_limit_above_here(frames: int):
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.parametrize("text", DEEP_SPECS, ids=lambda t: f"{t[:12]!r}x{len(t)}")
def test_deep_specs(text):
    only_spec_errors(flexspec.parse, text)


@pytest.mark.parametrize("text", DEEP_FILES, ids=lambda t: f"{t[:14]!r}x{len(t)}")
def test_deep_files(text):
    errors = only_spec_errors(check_text, text)
    assert errors is not None
    only_spec_errors(load_text, text)


@pytest.mark.parametrize("text", CHAINS, ids=lambda t: t[:8])
@pytest.mark.parametrize("frames", [100, 200])
def test_deep_definition_chains(text, frames):
    with recursion_limit_above_here(frames):
        errors = only_spec_errors(check_text, text)
        only_spec_errors(load_text, text)
    assert errors is not None


@pytest.mark.parametrize("text", [
    "window(" + "9" * 5000 + ")",
    "mask m = q < " + "9" * 5000 + "\n",
    "mask m = q < " + "9" * 2200 + " * " + "9" * 2200 + "\nspec s = m\n",
    "mask m = q < " + " * ".join(["99999"] * 1000) + "\nspec s = m\n",
    "score s = score * " + "9" * 400 + ".5e300\nspec t = s\n",
    "spec s = window(99999999999999999999999999) + softcap(1e999)\n",
], ids=lambda t: f"{t[:10]!r}x{len(t)}")
def test_huge_numbers(text):
    only_spec_errors(flexspec.parse, text)
    only_spec_errors(check_text, text)
    library = only_spec_errors(load_text, text)
    for name in library or ():
        # printing must not hit Python's 4300-digit limit on int -> str
        library[name].explain()


def test_unbalanced_parentheses_are_a_syntax_error():
    with pytest.raises(flexspec.SpecSyntaxError):
        flexspec.parse("(" * 5000)


def test_the_whole_pipeline_fuzzer_finds_nothing(capsys):
    """A bounded run of ``python -m flexspec.testing.fuzz`` (CI's profile; the note of issue 14
    reports the long run): random and mutated specs and files through parse, the round trip,
    dense_mask, reference, block masks (checked sound), render and the CLI. Only flexspec errors
    may escape; a spec that compiles and fails later would be counted as a failure."""
    from flexspec.testing.fuzz import fuzz

    report = fuzz(max(20, int(150 * SCALE)), seed=2026, budget=5.0)
    assert report.failures == [], report.failures[0][2]
    assert report.accepted > 0 and report.refused > 0, report.summary()


def test_the_fuzzer_reports_a_planted_bug(monkeypatch):
    """The fuzzer can fail: a stage raising a raw exception for some inputs is reported."""
    from flexspec.testing import fuzz as fuzzer
    from flexspec.tools import render

    def broken(*args, **kwargs):
        raise ValueError("planted")

    monkeypatch.setattr(render, "render_text", broken)
    report = fuzzer.fuzz(40, seed=1, budget=5.0, echo=lambda *a: None)
    assert report.failures and "planted" in report.failures[0][2]


def test_the_fuzzer_takes_every_spec_of_a_clean_file_through_the_stages(monkeypatch):
    """A file's specs read its own definitions (model.attn's `local(128) + cap`): each is
    re-parsed with the file's library, so the file is accepted and every spec staged."""
    import random

    from flexspec.resources import data_path
    from flexspec.testing import fuzz as fuzzer

    staged = []
    original = fuzzer._spec_stages
    monkeypatch.setattr(fuzzer, "_spec_stages",
                        lambda spec, rng, library=None: staged.append(str(spec))
                        or original(spec, rng, library))
    text = (data_path("examples") / "model.attn").read_text(encoding="utf-8")
    assert fuzzer.run_one("file", text, random.Random(0), cli=False) == ("accepted", 6)
    library = fuzzer.load_text(text)
    assert staged == [str(library[name]) for name in library.specs]


def test_the_serving_fuzzer_finds_nothing():
    """A bounded run of ``python -m flexspec.testing.serving`` (random sequences of paged-cache
    operations and reads against a model of the pool and the reference of each request alone;
    its note has the run of 10^4 sequences)."""
    from flexspec.testing.serving import fuzz_serving
    report = fuzz_serving(max(40, int(200 * SCALE)), seed=2026, echo=lambda *a: None)
    assert report.failures == [], report.failures[0][1]
    assert report.reads > report.sequences // 2 and report.refused > 0, report.summary()


def test_the_serving_fuzzer_reports_a_planted_bug(monkeypatch):
    """The serving fuzzer can fail: an append that writes each token one position late (its
    last into the next page) is caught by a read or by the model's books."""
    from flexspec.runtime.serving.cache import PagedKVCache
    from flexspec.testing.serving import fuzz_serving
    physical = PagedKVCache.physical
    monkeypatch.setattr(PagedKVCache, "physical",
                        lambda self, slots, positions: physical(self, slots, positions + 1))
    report = fuzz_serving(30, seed=3, echo=lambda *a: None)
    assert report.failures, report.summary()
