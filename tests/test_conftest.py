"""The suite's own options (tests/conftest.py): ``--shard I/N`` splits a run into N parts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _collected(*options) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "tests/test_limits.py", *options],
                          cwd=ROOT, capture_output=True, text=True)


def _ids(result) -> list:
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_split_the_tests_without_losing_or_repeating_one():
    everything = _ids(_collected())
    shards = [_ids(_collected("--shard", f"{i}/3")) for i in (1, 2, 3)]
    assert len(everything) >= 3 and all(shards)
    assert sorted(sum(shards, [])) == sorted(everything)
    assert shards[0] == everything[0::3]


@pytest.mark.parametrize("shard", ["3/2", "a/b"])
def test_a_bad_shard_is_a_usage_error(shard):
    result = _collected("--shard", shard)
    assert result.returncode == 4 and "--shard" in result.stderr
