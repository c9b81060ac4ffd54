"""The wheel carries the grammar, the pattern files and the example: build it, install it in a
fresh virtual environment outside the checkout, and run the CLI there."""

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    work = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools reuses a build/ folder left in the checkout, whose stale
    # modules would ship in the wheel and hide a package missing from pyproject
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".fa4",
        ".whl", ".pytest_cache", "mutants"))
    built = _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w",
                  str(work / "dist")], cwd=work)
    assert built.returncode == 0, built.stderr
    wheels = list((work / "dist").glob("flexspec-*.whl"))
    assert len(wheels) == 1
    env = work / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    # The CLI's list/check/explain need only lark and pyyaml (torch is imported lazily).
    done = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheels[0]), "lark",
                 "pyyaml"], cwd=work)
    assert done.returncode == 0, done.stderr
    return env, work


def test_flexspec_list_runs_from_the_wheel(installed):
    env, work = installed
    result = _run([str(env / "bin" / "flexspec"), "list"], cwd=work)
    assert result.returncode == 0, result.stderr
    for name in ("causal", "sliding_window", "document", "alibi", "t5_bias"):
        assert name in result.stdout


def test_wheel_contains_grammar_patterns_and_example(installed):
    env, work = installed
    code = ("import flexspec, flexspec.lang.parser as p, flexspec.lang.registry as r, pathlib;"
            "print(p.grammar_path()); print(r.patterns_dir());"
            "print(pathlib.Path(flexspec.__file__).parent.joinpath('examples','model.attn').is_file())")
    result = _run([str(env / "bin" / "python"), "-c", code], cwd=work)
    assert result.returncode == 0, result.stderr
    grammar, patterns, example = result.stdout.split()
    assert str(env) in grammar and str(env) in patterns  # the installed copies, not the checkout
    assert example == "True"


def test_wheel_ships_every_module_of_the_source_tree(installed):
    """pyproject lists the packages by hand: a new subpackage missing there would be absent from
    the wheel (only an installed user would notice)."""
    import zipfile

    _, work = installed
    wheel = next((work / "dist").glob("flexspec-*.whl"))
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flexspec").rglob("*.py")
              if "__pycache__" not in p.parts}
    assert source - shipped == set()


def test_no_numpy_warning_on_the_first_screen():
    """Red-team finding: on a fresh install without numpy, every torch-using command printed
    torch's "Failed to initialize NumPy" warning. flexspec filters that one message."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['numpy'] = None\n"  # numpy absent, as on a fresh install
            "import flexspec, torch\n"
            "flexspec.compile('causal').dense_mask(4, 4)\n")
    result = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "NumPy" not in result.stderr


def test_the_license_is_an_spdx_string_not_a_table():
    """Red-team item 13: setuptools warns (and from 2027-02-18 fails) on the ``project.license``
    table; an SPDX expression (PEP 639) installs without the warning."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert isinstance(project["license"], str) and project["license"] == "Apache-2.0"
    assert not any("License ::" in c for c in project.get("classifiers", []))


def test_the_wheel_carries_the_license_and_its_metadata(installed):
    """The wheel had no LICENSE file and no classifiers, and published the developers' `mutation`
    extra."""
    import email
    import zipfile

    _, work = installed
    wheel = zipfile.ZipFile(next((work / "dist").glob("flexspec-*.whl")))
    [license_file] = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(license_file) == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in wheel.read(license_file)
    [metadata] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    fields = email.message_from_bytes(wheel.read(metadata))
    assert fields["License-Expression"] == "Apache-2.0"
    assert fields["License-File"] == "LICENSE"
    assert "Programming Language :: Python :: 3" in fields.get_all("Classifier")
    assert sorted(fields.get_all("Provides-Extra")) == ["plot", "test", "transformers"]


def test_the_source_distribution_carries_the_docs_the_readme_links_to(tmp_path):
    import re
    import tarfile

    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".fa4",
        ".whl", ".pytest_cache", "mutants"))
    code = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    built = _run([sys.executable, "-c", code], cwd=source)
    assert built.returncode == 0, built.stderr
    names = tarfile.open(source / "dist" / built.stdout.split()[-1]).getnames()
    top = names[0].split("/")[0]
    links = re.findall(r"\]\(((?:docs|examples)/[^)#]+)", (ROOT / "README.md").read_text())
    assert links and all(f"{top}/{link}" in names for link in links), links
    assert f"{top}/LICENSE" in names
