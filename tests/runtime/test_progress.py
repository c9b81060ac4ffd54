"""runtime.progress: the ``flexspec`` logger says when a first call compiles and how long it
took, which backend a plan took, and FLEXSPEC_LOG switches it on (first-hour review: a first
compile of 3.5-14 s on the CPU gave no feedback at all)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import flexspec
from flexspec.testing import Shape


def test_a_first_call_logs_its_compile_and_its_time_and_later_calls_nothing(eager_kernels,
                                                                             caplog):
    attn = flexspec.compile("causal & window(9) + alibi")
    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=0)
    with caplog.at_level(logging.DEBUG, logger="flexspec"):
        attn(q, k, v)
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("planned 'causal & window(9) + alibi' at") and ": flex (" in m
               for m in messages), messages
    assert any("first call of 'causal & window(9) + alibi' on backend 'flex' at B=1 H=2 "
               "Q_LEN=200 KV_LEN=200" in m and m.endswith("(may take seconds)...")
               for m in messages), messages
    assert any(m.endswith(" s") and ": done in " in m for m in messages), messages
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="flexspec"):
        attn(q, k, v)
    assert caplog.records == []


def _with_switch(value: str) -> subprocess.CompletedProcess:
    code = ("import logging, flexspec.runtime.progress as p\n"
            "print(logging.getLevelName(p.log.level), len(p.log.handlers))\n"
            "p.log.info('hello')\n")
    env = {**os.environ, "FLEXSPEC_LOG": value}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_the_switch_prints_the_log_on_standard_error():
    shown = _with_switch("info")
    assert shown.stdout.split() == ["INFO", "1"]
    assert "flexspec: hello" in shown.stderr
    quiet = _with_switch("")
    assert quiet.stdout.split() == ["NOTSET", "0"] and "hello" not in quiet.stderr
    wrong = _with_switch("loud")
    assert "FLEXSPEC_LOG='loud' is not a logging level" in wrong.stderr
