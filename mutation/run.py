"""Mutation testing of one core module of flexspec against that module's fast tests (mutmut).

Not part of the package and not run in CI (a module takes minutes to an hour on two cores).
docs/testing.md explains when to run it and reports the scores. Usage, from the checkout's top:

    python mutation/run.py ir/simplify            # mutate flexspec/ir/simplify.py, run its tests
    python mutation/run.py ir/simplify --jobs 2   # two workers (the default is 1)
    python mutation/run.py ir/simplify --report   # the score and every survivor's diff, no run
    python mutation/run.py ir/simplify --again NAME...   # rerun some mutants (after a new test)
    python mutation/run.py ir/simplify --resume   # go on with an interrupted run
    python mutation/run.py --list                 # the modules and the tests each one runs

Each module gets its own work folder ``mutants/<module>/`` (gitignored): a pyproject.toml with
the mutmut settings for that module, and links to ``flexspec/``, ``tests/`` and the data folders.
mutmut copies the whole package into ``mutants/<module>/mutants/`` and mutates only the one file,
so every other module is the real one (mutating all of flexspec at once breaks the parser, whose
transformer class calls its helpers while the class is created, before mutmut's trampolines
exist). Results persist in that folder: ``--report`` and ``--again`` read them.

The score counts killed (a test failed, or the mutant timed out) over all mutants less the
equivalent ones listed, each with its reason, in ``mutation/equivalent.txt``. "No tests" (no
selected test calls the mutated function) counts as a survivor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = Path(__file__).resolve().parent / "equivalent.txt"

# module (under flexspec/) -> the tests that check it: its mirror test file, plus the property
# tests that cover it where the mirror alone is not enough. Slow and GPU tests never run here.
MODULES: dict[str, list[str]] = {
    "ir/simplify": ["tests/ir/test_simplify.py"],
    "ir/intervals": ["tests/ir/test_intervals.py"],
    "ir/forms": ["tests/ir/test_forms.py", "tests/runtime/test_native.py"],
    "ir/rewrites": ["tests/ir/test_rewrites.py", "tests/lang/test_api.py"],
    "kernels/lower": ["tests/kernels/test_lower.py"],
    "kernels/evaluate": ["tests/kernels/test_evaluate.py", "tests/kernels/test_reference.py",
                         "tests/lang/test_patterns.py"],
    "kernels/reference": ["tests/kernels/test_reference.py", "tests/lang/test_patterns.py"],
    "kernels/blocks": ["tests/kernels/test_blocks.py"],
    "kernels/block_tables": ["tests/kernels/test_blocks.py"],
    "runtime/masks": ["tests/runtime/test_masks.py"],
    "runtime/plan": ["tests/runtime/test_plan.py", "tests/runtime/test_native.py"],
    "runtime/checks": ["tests/runtime/test_checks.py"],
    "runtime/bindings": ["tests/runtime/test_bindings.py"],
    "runtime/lookups": ["tests/runtime/test_lookups.py", "tests/runtime/test_plan.py"],
    "runtime/order": ["tests/runtime/test_order.py"],
    "runtime/attention": ["tests/runtime/test_runtime.py", "tests/runtime/serving/test_reads.py",
                          "tests/runtime/serving/test_jagged.py"],
    "runtime/positions": ["tests/runtime/test_positions.py"],
    "runtime/multihead": ["tests/runtime/test_multihead.py"],
    "runtime/capture": ["tests/runtime/test_capture.py"],
    "runtime/module": ["tests/runtime/test_module.py"],
    "runtime/backends/__init__": ["tests/runtime/test_backends.py", "tests/runtime/test_order.py"],
    "runtime/backends/sdpa": ["tests/runtime/test_backends.py"],
    "runtime/backends/flex": ["tests/runtime/test_backends.py"],
    "runtime/backends/native": ["tests/runtime/test_native.py", "tests/runtime/test_backends.py"],
    "integrations/transformers": ["tests/integrations/test_transformers.py"],
    "lang/checker": ["tests/lang/test_checker.py"],
    "parallel/balance": ["tests/parallel/test_balance.py"],
    "runtime/tuning": ["tests/runtime/test_tuning.py"],
    "runtime/serving/mixed": ["tests/runtime/serving/test_mixed.py"],
    "runtime/serving/cache": ["tests/runtime/serving/test_cache.py",
                              "tests/runtime/serving/test_mixed.py",
                              "tests/runtime/test_flexpages.py"],
    "runtime/serving/reads": ["tests/runtime/serving/test_reads.py",
                              "tests/runtime/serving/test_mixed.py"],
    "runtime/flexpages": ["tests/runtime/test_flexpages.py", "tests/runtime/serving/test_reads.py"],
    "runtime/calls": ["tests/runtime/test_runtime.py", "tests/runtime/test_positions.py",
                      "tests/runtime/serving/test_reads.py"],
}

# Linked into each work folder: the package, its tests and the data files flexspec reads from the
# checkout (resources.data_path looks beside the package).
LINKED = ["flexspec", "tests", "grammar", "patterns", "examples"]

KILLED = {1, 3, 36, -24, 24, 152, 255}  # mutmut's exit codes for "killed" and "timeout"


def _config(module: str, tests: list[str]) -> str:
    """The work folder's pyproject.toml: mutmut's settings for ``module`` and pytest's own."""
    pytest_section = (ROOT / "pyproject.toml").read_text().split("[tool.pytest.ini_options]")[1]
    pytest_section = pytest_section.split("\n[", 1)[0]
    # --doctest-modules is dropped: only the selected test files run.
    pytest_section = pytest_section.replace(" --doctest-modules", "")
    return "\n".join([
        "[tool.mutmut]",
        'source_paths = ["flexspec"]',
        # the data files flexspec reads from beside the package (tests/ is copied by default)
        'also_copy = ["grammar", "patterns", "examples"]',
        f'only_mutate = ["flexspec/{module}.py"]',
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        # no slow/gpu tests; the checkout's cache and hypothesis database stay out of it
        'pytest_add_cli_args = ["-m", "not slow and not gpu", "-p", "no:cacheprovider"]',
        "use_git_change_detection = false",
        # a mutant that makes its tests run 4x longer (a loop that no longer ends) is killed
        # as a timeout; mutmut's default (15x) spends minutes of CPU on each such mutant
        "timeout_multiplier = 4.0",
        "",
        "[tool.pytest.ini_options]" + pytest_section,
    ])


def _work(module: str) -> Path:
    return ROOT / "mutants" / module.replace("/", ".")


def _prepare(module: str, fresh: bool) -> Path:
    work = _work(module)
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = work / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    (work / "pyproject.toml").write_text(_config(module, MODULES[module]))
    return work


def _equivalent() -> dict[str, str]:
    """Mutant name -> why it cannot change any result (mutation/equivalent.txt)."""
    reasons = {}
    for line in EQUIVALENT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, why = line.partition(" ")
            reasons[name] = why.strip()
    return reasons


def _mutmut(work: Path, *args: str) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    # one torch thread per worker: this machine has two cores, and forked workers must not
    # inherit a busy OpenMP pool
    mutmut = Path(sys.executable).with_name("mutmut")
    if not mutmut.exists():
        raise SystemExit(f"mutmut is not installed beside {sys.executable}: "
                         "pip install -r mutation/requirements.txt")
    return subprocess.call([str(mutmut), *args], cwd=work, env=env)


def report(module: str) -> tuple[int, int, list[str]]:
    """Print the score of ``module`` and the diff of every survivor; return (killed, counted,
    survivors)."""
    work = _work(module)
    meta = work / "mutants" / "flexspec" / f"{module}.py.meta"
    if not meta.exists():
        sys.exit(f"no results for {module}: run python mutation/run.py {module} first")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    equivalent = _equivalent()
    killed = [name for name, code in codes.items() if code in KILLED]
    skipped = [name for name in codes if name in equivalent and name not in killed]
    survivors = sorted(set(codes) - set(killed) - set(skipped))
    counted = len(codes) - len(skipped)
    not_checked = [name for name in survivors if codes[name] is None]
    # the diffs of mutants that ran and survived; during a run the unchecked ones are only
    # counted (a `mutmut show` each would take minutes for a large module)
    for name in survivors:
        if codes[name] is not None:
            subprocess.call([str(Path(sys.executable).with_name("mutmut")), "show", name],
                            cwd=work)
    for name in skipped:
        print(f"equivalent: {name}: {equivalent[name]}")
    score = 100.0 * len(killed) / counted if counted else 100.0
    print(f"\n{module}: {len(killed)} killed / {counted} "
          f"({len(codes)} mutants, {len(skipped)} equivalent) = {score:.1f}%"
          + (f"; {len(not_checked)} not checked yet" if not_checked else ""))
    print("survivors:", " ".join(survivors) if survivors else "none")
    return len(killed), counted, survivors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", nargs="?", choices=sorted(MODULES), metavar="MODULE",
                        help="a core module under flexspec/, e.g. ir/simplify")
    parser.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1)")
    parser.add_argument("--report", action="store_true", help="print the last results only")
    parser.add_argument("--again", nargs="+", metavar="NAME",
                        help="rerun these mutants (names from --report; * globs allowed)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the results so far and run the mutants that have none")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests")
    args = parser.parse_args(argv)
    if args.list:
        for module, tests in MODULES.items():
            print(f"{module:28} {' '.join(tests)}")
        return 0
    if args.module is None:
        parser.error("name a module (--list shows them)")
    if not args.report:
        work = _prepare(args.module, fresh=not (args.again or args.resume))
        code = _mutmut(work, "run", "--max-children", str(args.jobs), *(args.again or []))
        if code:
            return code
    report(args.module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
