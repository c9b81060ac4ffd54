"""The registry loader: malformed pattern files give a RegistryError naming the file and line."""

import shutil
from pathlib import Path

import pytest

from flexspec.lang.checker import check_spec
from flexspec.errors import RegistryError
from flexspec.lang.parser import parse_spec
from flexspec.lang.registry import Registry, patterns_dir

GOOD = """name: band
kind: mask
summary: Keys between lo and hi positions before the query.
params:
  - name: lo
    type: int
    constraint: lo <= hi
  - name: hi
    type: int
definition: q - kv >= lo & q - kv <= hi
references:
  - title: A test pattern
    url: https://example.org/band
example: band(0, 3)
"""


def registry_with(tmp_path: Path, text: str, name: str = "band.yaml") -> Registry:
    folder = tmp_path / "patterns"
    shutil.copytree(patterns_dir(), folder)
    (folder / name).write_text(text)
    return Registry(folder)


def error_of(tmp_path: Path, text: str, name: str = "band.yaml") -> RegistryError:
    with pytest.raises(RegistryError) as caught:
        registry_with(tmp_path, text, name)
    return caught.value


def test_a_good_pattern_loads_and_its_constraint_may_name_a_later_parameter(tmp_path):
    registry = registry_with(tmp_path, GOOD)
    assert str(check_spec(parse_spec("band(0, 3)"), registry.scope).mask) == \
        "q - kv >= 0 & q - kv <= 3"
    with pytest.raises(Exception, match="'band' requires lo <= hi, but lo = 5"):
        check_spec(parse_spec("band(5, 3)"), registry.scope)


def test_invalid_yaml_names_file_line_and_column(tmp_path):
    err = error_of(tmp_path, GOOD.replace("kind: mask", "kind: [mask"))
    assert err.source_name.endswith("band.yaml") and err.line is not None
    assert "not valid YAML" in err.message


def test_unknown_key_suggests_the_right_one(tmp_path):
    err = error_of(tmp_path, GOOD.replace("summary:", "sumary:"))
    assert err.line == 3 and err.source_name.endswith("band.yaml")
    assert "unknown key 'sumary'" in err.message and "Did you mean 'summary'?" in err.message


def test_missing_required_key(tmp_path):
    err = error_of(tmp_path, GOOD.replace("example: band(0, 3)\n", ""))
    assert "lacks the required key 'example'" in err.message


def test_name_must_match_the_file(tmp_path):
    err = error_of(tmp_path, GOOD, name="other.yaml")
    assert err.line == 1 and "named 'band' but its file is 'other.yaml'" in err.message


def test_bad_kind_and_bad_parameter_type(tmp_path):
    assert "kind must be 'mask' or 'score'" in error_of(
        tmp_path, GOOD.replace("kind: mask", "kind: bias")).message
    err = error_of(tmp_path / "b", GOOD.replace("    type: int\n    constraint",
                                               "    type: integer\n    constraint"))
    assert err.line == 6 and "parameter type 'integer' is unknown" in err.message


def test_definition_errors_point_into_the_yaml_line(tmp_path):
    err = error_of(tmp_path, GOOD.replace("q - kv >= lo & q - kv <= hi",
                                          "q - kv >= lo & q - kv <= hii"))
    assert err.source_name.endswith("band.yaml")
    assert err.line == 10 and err.column == len("definition: q - kv >= lo & q - kv <= ") + 1
    assert "unknown name 'hii'" in err.message and "Did you mean 'hi'?" in err.message
    assert "^^^" in str(err)


def test_reference_urls_and_aliases_are_validated(tmp_path):
    err = error_of(tmp_path, GOOD.replace("https://example.org/band", "example.org/band"))
    assert "must start with http:// or https://" in err.message
    err = error_of(tmp_path / "b", GOOD + "aliases: [doc]\n")
    assert "alias 'doc' is already taken" in err.message


def test_an_example_that_does_not_check_is_an_error(tmp_path):
    err = error_of(tmp_path, GOOD.replace("example: band(0, 3)", "example: band(0)"))
    assert "needs a value for 'hi'" in err.message


SOFTCAP_LIKE = """name: cap
kind: score
summary: A cap.
params:
  - name: c
    type: float
    default: 50.0
    constraint: c > 0 & c < inf
definition: c * tanh(score / c)
references:
  - title: A test pattern
    url: https://example.org/cap
example: causal + cap
"""


@pytest.mark.parametrize("text, message", [
    (GOOD.replace("summary: Keys", "summary: \xffKeys"), "not UTF-8 text"),
    (GOOD.replace("definition: q - kv >= lo & q - kv <= hi", "definition: [q >= kv]"),
     "definition must be text"),
    (GOOD.replace("definition: q - kv >= lo & q - kv <= hi", "definition: {a: 1}"),
     "definition must be text"),
    (GOOD.replace("    type: int\n    constraint", "    type: [int]\n    constraint"),
     "a parameter's type must be text"),
    (SOFTCAP_LIKE.replace("default: 50.0", "default: .nan"), "a default cannot be NaN"),
    (SOFTCAP_LIKE.replace("default: 50.0", "default: !!python/name:os.system"),
     "a default is not a plain value"),
    (SOFTCAP_LIKE.replace("default: 50.0", "default: [1, 2]"), "a default must be a single value"),
    (SOFTCAP_LIKE.replace("default: 50.0", "default: .inf"),
     "the default of 'c' (inf) breaks its constraint c > 0 & c < inf"),
    (SOFTCAP_LIKE.replace("default: 50.0", "default: -1"),
     "the default of 'c' (-1) breaks its constraint"),
    (GOOD.replace("references:", "tags: " + "[" * 2000 + "]" * 2000 + "\nreferences:"),
     "nested too deeply"),
])
def test_malformed_files_raise_registry_errors_only(tmp_path, text, message):
    """Red-team findings: each of these escaped as UnicodeDecodeError, AttributeError,
    ValueError, yaml's ConstructorError or RecursionError, or (out-of-range defaults) loaded."""
    name = "cap.yaml" if text.startswith("name: cap") else "band.yaml"
    folder = tmp_path / "patterns"
    shutil.copytree(patterns_dir(), folder)
    (folder / name).write_bytes(text.encode("utf-8").replace("\xff".encode("utf-8"), b"\xff"))
    with pytest.raises(RegistryError) as caught:
        Registry(folder)
    assert message in caught.value.message
    assert caught.value.source_name.endswith(name)


def test_a_default_that_meets_its_constraint_loads(tmp_path):
    registry = registry_with(tmp_path, SOFTCAP_LIKE, "cap.yaml")
    assert "tanh" in str(check_spec(parse_spec("cap"), registry.scope).score)
