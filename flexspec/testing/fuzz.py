"""A seeded whole-pipeline fuzzer: random and mutated spec texts and ``.attn`` files driven
through every stage a user reaches, where only flexspec's own errors may escape.

Inputs (reproducible from ``--seed``): registry patterns composed with ``& | ~ +`` and random
arguments (often outside their constraints), the registry's examples and the example ``.attn``
files, each possibly mutated (characters inserted, deleted or replaced, tokens duplicated,
dropped or swapped). Each input goes through

* ``parse`` (or ``load_text`` for files), the canonical text and its round trip
  (``parse(str(spec)) == spec``);
* ``compile``, then at a small random shape with example bindings: ``dense_mask``,
  ``reference`` (float64), ``block_mask`` (checked sound against the dense mask: no visible pair
  in a skipped tile), ``render_text``;
* one input in ten: the command line (``check``/``fmt`` on a file, ``render`` and ``explain``
  on a spec).

An input fails when something other than :class:`flexspec.SpecError` (or the CLI's exit code) is
raised, when the round trip changes the spec, or when a block mask hides a visible pair. An input
is slow when its stages take longer than ``--budget`` seconds for each spec it holds (after a
few untimed warm-up inputs, which pay for imports and first compiles); a hard limit of ten
budgets stops one that would hang. The summary counts each outcome; failures are printed with their input and
traceback, and the exit code is 1 when any input failed.

    python -m flexspec.testing.fuzz --n 1000 --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import flexspec
from flexspec.errors import SpecError
from flexspec.lang.library import load_text
from flexspec.resources import data_path

TOKENS = ("&", "|", "~", "+", "(", ")", ",", "=", "q", "kv", "b", "h", "Q_LEN", "KV_LEN", "0",
          "-1", "2", "128", "1e39", "9223372036854775808", "0.5", "true", "where", "//", "%",
          "mask", "score", "spec", "int[KV_LEN]", "learnable(H, 3)", "\n", " ", "#")
CHARACTERS = "()&|~+-*/%<>=!,.:[]_ \n\t0123456789abcdeqkvhBHQLENKV#\"'\\\u00e9\ufeff"


@dataclass
class Report:
    """Counts of each outcome, the failures (input, error) and the slowest input."""

    inputs: int = 0
    accepted: int = 0        # went through every stage
    refused: int = 0         # a flexspec error, as it should be for bad input
    slow: int = 0
    failures: list = field(default_factory=list)
    slowest: tuple = (0.0, "")

    def summary(self) -> str:
        return (f"{self.inputs} inputs: {self.accepted} accepted, {self.refused} refused with a "
                f"flexspec error, {len(self.failures)} failures, {self.slow} over the budget "
                f"(slowest {self.slowest[0]:.2f} s: {self.slowest[1][:60]!r})")


class _HardLimit(BaseException):
    """Raised by the alarm when an input runs past the hard limit (BaseException: no stage may
    swallow it)."""


def generate(rng: random.Random, seeds: list[str], files: list[str]) -> tuple[str, str]:
    """``(kind, text)``: a spec (``"spec"``) or an ``.attn`` file (``"file"``)."""
    roll = rng.random()
    if roll < 0.15 and files:
        return "file", _mutate(rng, rng.choice(files), rng.randint(0, 3))
    text = _composed(rng) if roll < 0.6 else rng.choice(seeds)
    return "spec", _mutate(rng, text, rng.choice((0, 0, 1, 2)))


def _composed(rng: random.Random) -> str:
    patterns = flexspec.patterns()
    masks = [p for p in patterns if p.kind == "mask"]
    scores = [p for p in patterns if p.kind == "score"]
    text = _call(rng, rng.choice(masks))
    for _ in range(rng.randint(0, 2)):
        term = _call(rng, rng.choice(masks))
        text = f"{text} {rng.choice('&|')} {'~' if rng.random() < 0.2 else ''}{term}"
        if rng.random() < 0.3:
            text = f"({text})"
    for _ in range(rng.randint(0, 2)):
        text += " + " + _call(rng, rng.choice(scores))
    return text


def _call(rng: random.Random, pattern) -> str:
    args = []
    for param in pattern.params:
        if param.type not in ("int", "float", "bool") or param.dims is not None:
            continue
        if param.default is not None and rng.random() < 0.5:
            continue
        value = {"int": lambda: rng.choice((rng.randint(-3, 300), 0, 1, 2**40)),
                 "float": lambda: rng.choice((rng.uniform(-5, 100), 0.0, 1e-3, 1e30)),
                 "bool": lambda: rng.choice(("true", "false"))}[param.type]()
        args.append(f"{param.name}={value}")
        if param.default is None and len(args) < len(pattern.params) and rng.random() < 0.1:
            break  # a required argument left out now and then
    return f"{pattern.name}({', '.join(args)})" if args else pattern.name


def _mutate(rng: random.Random, text: str, times: int) -> str:
    for _ in range(times):
        position = rng.randint(0, len(text))
        choice = rng.random()
        if choice < 0.25:
            text = text[:position] + rng.choice(CHARACTERS) + text[position:]
        elif choice < 0.45 and text:
            text = text[:position] + text[position + 1:]
        elif choice < 0.6 and text:
            text = text[:position] + rng.choice(CHARACTERS) + text[position + 1:]
        elif choice < 0.8:
            text = text[:position] + f" {rng.choice(TOKENS)} " + text[position:]
        else:
            words = text.split(" ")
            i, j = rng.randrange(len(words)), rng.randrange(len(words))
            words[i], words[j] = words[j], words[i]
            text = " ".join(words)
    return text


def run_one(kind: str, text: str, rng: random.Random, *, cli: bool) -> tuple:
    """Drive one input through the stages: ``("accepted" or "refused", specs)``, where
    "refused" means a flexspec error and ``specs`` counts the specs that went through the
    stages (a file has several). Anything else escapes (the caller records it)."""
    refused = False
    try:
        if kind == "file":
            library = load_text(text, "fuzz.attn")
            specs = [library[name] for name in library.specs]
        else:
            library, specs = None, [flexspec.parse(text)]
    except SpecError:
        library, specs, refused = None, [], True
    for spec in specs:  # each spec of a file on its own: one refused does not skip the others
        try:
            _spec_stages(spec, rng, library)
        except SpecError:
            refused = True
    result = "refused" if refused else "accepted"
    if cli:
        _command_line(kind, text)
    return result, len(specs)


def _spec_stages(spec, rng: random.Random, library=None) -> None:
    import torch

    from flexspec.kernels.block_tables import EMPTY, tile_classes
    from flexspec.tools.render import render_text
    from flexspec.tools.values import demo_bindings

    again = flexspec.parse(str(spec), library=library)  # a file's spec reads its definitions
    if again != spec:
        raise AssertionError(f"the canonical text does not parse back: {str(spec)!r}")
    attn = flexspec.compile(spec)
    batch, heads = rng.randint(1, 2), rng.choice((1, 2, 4))
    q_len, kv_len = rng.randint(1, 70), rng.randint(1, 70)
    bindings, _ = demo_bindings(attn, q_len, kv_len, batch=batch - 1, heads=heads)
    dense = attn.dense_mask(q_len, kv_len, batch=batch, heads=heads, **bindings)
    q = torch.randn(batch, heads, q_len, 8, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, kv_len, 8, dtype=torch.float64) for _ in range(2))
    attn.reference(q, k, v, **bindings)
    block = (16, 16)
    classes = tile_classes(flexspec.compile(spec, block_size=block).block_mask(
        q_len, kv_len, batch=batch, heads=heads, **bindings))
    padded = torch.zeros(dense.shape[:2] + (-(-q_len // 16) * 16, -(-kv_len // 16) * 16),
                         dtype=torch.bool)
    padded[..., :q_len, :kv_len] = dense
    tiles = padded.unflatten(-1, (-1, 16)).unflatten(-3, (-1, 16)).any(-1).any(-2)
    if ((classes == EMPTY) & tiles.expand(classes.shape[:2] + tiles.shape[2:])).any():
        raise AssertionError("the block mask skips a tile that has a visible pair")
    render_text(attn, q_len, kv_len, **bindings)


def _command_line(kind: str, text: str) -> None:
    from flexspec.tools import cli

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        if kind == "file":
            path = os.path.join(folder, "fuzz.attn")
            with open(path, "w", encoding="utf-8", errors="surrogatepass") as handle:
                handle.write(text)
            calls = (["check", path], ["fmt", path])
        else:
            calls = (["render", text, "--q", "12", "--kv", "9"],
                     ["explain", text, "--q-len", "40", "--kv-len", "33"])
        for argv in calls:
            try:
                cli.main(argv)
            except SystemExit as exit_:  # argparse: a spec text that looks like an option
                if not text.lstrip().startswith("-"):
                    raise AssertionError(f"the command line exited with {exit_.code}: "
                                         f"{argv}") from None


def fuzz(n: int, seed: int = 0, budget: float = 1.0, cli_every: int = 10,
         echo=print) -> Report:
    """Run ``n`` inputs from ``seed``; see the module docstring."""
    import torch

    torch.set_num_threads(1)  # small shapes: threads cost more than they give
    rng = random.Random(seed)
    seeds = [p.example for p in flexspec.patterns()]
    examples = data_path("examples")
    files = [path.read_text(encoding="utf-8") for path in sorted(examples.glob("*.attn"))] \
        if examples is not None else []
    report = Report()
    # the first input through each stage pays for imports and first compiles (over a second):
    # paid here, untimed, so that the budget measures the inputs
    for text in seeds[:3]:
        with contextlib.suppress(Exception):  # a fault here shows again among the inputs
            run_one("spec", text, random.Random(0), cli=True)
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for index in range(n):
            kind, text = generate(rng, seeds, files)
            stage_rng = random.Random(rng.random())
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, 10 * budget)
            staged = 1
            try:
                outcome, staged = run_one(kind, text, stage_rng, cli=index % cli_every == 0)
            except _HardLimit:
                outcome = "hang"
            except Exception:  # noqa: BLE001 - anything but a flexspec error is the finding
                outcome = "failure"
                report.failures.append((kind, text, traceback.format_exc()))
                echo(f"FAILURE ({kind}) {text!r}\n{traceback.format_exc()}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            elapsed = time.perf_counter() - start
            report.inputs += 1
            if outcome in ("accepted", "refused"):
                setattr(report, outcome, getattr(report, outcome) + 1)
            # a file of several specs has the budget once for each
            if elapsed > budget * max(1, staged) or outcome == "hang":
                report.slow += 1
                echo(f"SLOW ({elapsed:.2f} s, {kind}) {text!r}")
            if elapsed > report.slowest[0]:
                report.slowest = (elapsed, text)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return report


def _alarm(signum, frame):
    raise _HardLimit()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="how many inputs (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds one input may take before it counts as slow")
    args = parser.parse_args(argv)
    report = fuzz(args.n, args.seed, args.budget)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
