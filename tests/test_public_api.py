"""The package's public face (``flexspec/__init__.py``, the error classes of ``flexspec/errors.py``):
what ``dir(flexspec)`` lists, and that flexspec's errors are caught where torch users catch
theirs (``except ValueError``, ``except TypeError``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flexspec
from flexspec import errors


def test_dir_lists_the_public_names_and_hides_the_stray_ones():
    names = dir(flexspec)
    for name in flexspec.__all__:
        assert name in names, name
    for stray in ("annotations", "warnings"):
        assert stray not in names, stray
    assert names == sorted(names)


def test_every_name_dir_lists_can_be_read():
    for name in dir(flexspec):
        getattr(flexspec, name)


def test_dir_imports_no_torch():
    code = ("import sys, flexspec\n"
            "names = dir(flexspec)\n"
            "assert 'SpecAttention' in names and 'Attention' in names, names\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_flexspec_error_is_a_value_error():
    classes = [getattr(errors, name) for name in dir(errors)
               if isinstance(getattr(errors, name), type)
               and issubclass(getattr(errors, name), errors.SpecError)]
    assert len(classes) >= 7
    for cls in classes + [flexspec.BackendError, flexspec.CompileLimitError]:
        assert issubclass(cls, ValueError), cls
    with pytest.raises(ValueError, match="unknown pattern 'windw'"):
        flexspec.parse("causal & windw(3)")


def test_the_type_flavoured_errors_are_type_errors_too():
    assert issubclass(flexspec.SpecTypeError, TypeError)
    assert issubclass(flexspec.BindingTypeError, TypeError)
    assert issubclass(flexspec.BindingTypeError, flexspec.BindingError)
    error = flexspec.BindingTypeError("q must be a torch.Tensor, got list")
    assert str(error) == "q must be a torch.Tensor, got list"


@pytest.mark.parametrize("call, message", [
    (lambda: flexspec.parse(3.0), "expected spec text \\(a str\\), got float"),
    (lambda: flexspec.loads(None), "loads\\(\\) takes the text of an .attn file"),
    (lambda: flexspec.load(None), "load\\(\\) takes the path of an .attn file"),
    (lambda: flexspec.parse("causal", library="x"), "library must be a flexspec.Library"),
])
def test_arguments_of_the_wrong_type_raise_type_errors(call, message):
    with pytest.raises(TypeError, match=message) as info:
        call()
    assert isinstance(info.value, flexspec.SpecTypeError)
