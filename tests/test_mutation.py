"""mutation/run.py (mutation testing by hand, docs/testing.md): its table of core modules and
their tests names real files, its per-module mutmut settings are valid TOML that mutate only
that module, and every equivalent mutant it leaves out of a score names a core module and says
why. (The mutation runs themselves take minutes to an hour and are not part of the suite.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutation_run", ROOT / "mutation" / "run.py")
mutation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation)


def test_every_core_module_and_its_tests_exist():
    for module, tests in mutation.MODULES.items():
        assert (ROOT / "flexspec" / f"{module}.py").is_file(), module
        assert tests and all((ROOT / path).is_file() for path in tests), module


def test_the_settings_mutate_one_module_against_its_tests():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads(mutation._config("ir/intervals", mutation.MODULES["ir/intervals"]))
    mutmut = config["tool"]["mutmut"]
    assert mutmut["only_mutate"] == ["flexspec/ir/intervals.py"]
    assert mutmut["pytest_add_cli_args_test_selection"] == ["tests/ir/test_intervals.py"]
    assert "not slow and not gpu" in mutmut["pytest_add_cli_args"]
    assert "slow" in "".join(config["tool"]["pytest"]["ini_options"]["markers"])


def test_equivalent_mutants_name_a_core_module_and_a_reason():
    # mutmut names a function's mutants module.x_name__mutmut_N, a method's
    # module.xǁClassǁname__mutmut_N
    prefixes = tuple("flexspec." + module.replace("/", ".").removesuffix(".__init__") + mark
                     for module in mutation.MODULES for mark in (".x_", ".xǁ"))
    reasons = mutation._equivalent()
    assert reasons
    for name, why in reasons.items():
        assert name.startswith(prefixes) and "__mutmut_" in name, name
        assert len(why.split()) >= 3, name
