"""Whether a call runs inside a CUDA graph capture, where it may not read the device from the
host and its results are replayed later with new inputs."""

from __future__ import annotations

import torch


def capturing(device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now (a captured call may
    not read the device from the host, and its results are replayed with new inputs)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
