"""runtime.capture: whether a call runs inside a CUDA graph capture."""

from __future__ import annotations

import torch

from flexspec.runtime import capture


# --- identity and signatures ---------------------------------------------------------------


def test_only_a_cuda_device_is_captured_while_its_stream_captures(monkeypatch):
    assert not capture.capturing(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert capture.capturing(torch.device("cuda")) and capture.capturing(torch.device("cuda", 1))
    assert not capture.capturing(torch.device("cpu")) and not capture.capturing(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not capture.capturing(torch.device("cuda"))
