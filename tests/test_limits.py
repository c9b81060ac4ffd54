"""flexspec.limits: every limit in one module, torch-free, and the checks that apply them (each a
flexspec error with the number, the limit and the fix). Where each check is applied is tested
with its caller (tests/lang/test_checker.py, tests/kernels/test_reference.py, ...)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from flexspec import limits
from flexspec.errors import BindingError, SpecCheckError, SpecError

ROOT = Path(__file__).resolve().parents[1]


def test_the_module_imports_only_the_errors_and_no_torch():
    tree = ast.parse((ROOT / "flexspec" / "limits.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {name for name in imported if name.startswith("flexspec")} == {"flexspec.errors"}
    code = "import sys, flexspec.limits; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_no_other_module_defines_a_limit_of_its_own():
    """The limits that moved here are not defined again elsewhere (a copy would drift)."""
    names = ["MAX_TABLE_ENTRIES", "MAX_BIND_VALUES", "MAX_FILE_CHARS", "EXACT_INDEX_CHECK_LIMIT",
             "MAX_FUSED_TILES", "MAX_BLOCK_MASK_BYTES", "MAX_INLINED_NODES", "MAX_IR_DEPTH",
             "FLOAT32_MAX", "MAX_INDEX_CHECK_POINTS"]
    for path in (ROOT / "flexspec").rglob("*.py"):
        if path.name == "limits.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                defined = {t.id for t in node.targets if isinstance(t, ast.Name)}
                assert not defined & set(names), f"{path} defines {defined & set(names)}"


def test_every_memory_limit_fits_the_budget():
    assert limits.DENSE_PEAK_ARRAYS * limits.MAX_DENSE_ARRAY_BYTES <= limits.MEMORY_BUDGET
    assert limits.MAX_BLOCK_MASK_BYTES <= limits.MEMORY_BUDGET
    assert limits.MAX_TABLE_ENTRIES * 8 <= limits.MAX_DENSE_ARRAY_BYTES  # read in float64
    assert limits.EXACT_INDEX_CHECK_LIMIT * 8 <= limits.MAX_DENSE_ARRAY_BYTES


@pytest.mark.parametrize("value, dtype, fits", [
    (2**63 - 1, "int64", True), (2**63, "int64", False), (-2**63, "int64", True),
    (-2**63 - 1, "int64", False), (2**31 - 1, "int32", True), (2**31, "int32", False),
    (float(2**63), "int64", False), (-float(2**31), "int32", True)])
def test_int_ranges(value, dtype, fits):
    assert limits.fits_int(value, dtype) == fits


@pytest.mark.parametrize("value, fits", [(0.0, True), (1e38, True), (3.5e38, False),
                                         (1.5e-45, True), (1e-46, False), (-1e39, False)])
def test_float32_range(value, fits):
    assert limits.fits_float32(value) == fits


def test_checks_raise_the_error_their_caller_names():
    with pytest.raises(SpecCheckError, match="does not fit in a 64-bit int"):
        limits.check_int_constant(2**63, error=SpecCheckError)
    with pytest.raises(SpecError, match="--bind x: 1e-46 is not a finite float32 value"):
        limits.check_float_constant(1e-46, "--bind x: ", finite=True)
    with pytest.raises(BindingError, match=r"q_offset = 4611686018427387904 is out of range"):
        limits.check_position(2**62, "q_offset", error=BindingError)
    limits.check_position(2**62 - 1, "q_offset")
    with pytest.raises(BindingError, match="8 GiB flexspec builds; use a larger block_size"):
        limits.check_block_mask(1, 1, 10**5, 10**5, "these lengths", error=BindingError)
    with pytest.raises(SpecError, match="would hold 268,435,457 entries"):
        limits.check_table("t", (2**28 + 1,))
    limits.check_table("t", (2**14, 2**14))


def test_int_range_message_names_the_expression_and_the_fix():
    with pytest.raises(SpecError) as caught:
        limits.check_int_range("q * 4611686018427387904", 0.0, 4.6e21, "int64", "for Q_LEN=1000")
    message = str(caught.value)
    assert "'q * 4611686018427387904' reaches 0..4.6e+21 for Q_LEN=1000, beyond the 64-bit" in message
    assert "float arithmetic" in message
    limits.check_int_range("q * 2", 0, 2**31 - 1, "int32", "")


@pytest.mark.parametrize("text, refused", [("1e400", True), ("1e-400", True), ("0.0e-400", False),
                                           ("00.000", False), ("1e38", False), ("1e39", False),
                                           (".5e-9999", True)])
def test_a_float_literal_must_be_read_as_itself(text, refused):
    """check_float_literal refuses only what float64 cannot read (1e39 is left to
    check_float_constant, which refuses it wherever the constant reaches a kernel)."""
    if refused:
        with pytest.raises(SpecError, match=f"^{text} is beyond float32"):
            limits.check_float_literal(text, float(text))
    else:
        limits.check_float_literal(text, float(text))
