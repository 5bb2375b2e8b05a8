"""Which functions of the model's source led to a traced node: the Python frames of the
tracer's call stack, torch's and hfrewrite's own left out."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.fx import Node

_NOT_SOURCE = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def source_frames_and_lines() -> tuple[tuple, dict]:
    """Code objects of the Python frames (outermost first) that led to a node, torch's and
    hfrewrite's own left out (which function of the model's source computed it), and the
    line each was executing."""
    frames, lines, frame = [], {}, sys._getframe(2)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_NOT_SOURCE):
            frames.append(frame.f_code)
            lines.setdefault(frame.f_code, frame.f_lineno)
        frame = frame.f_back
    return tuple(reversed(frames)), lines


def called_from(node: Node, caller) -> Any:
    """The code object of the function ``caller`` (a code object) called directly on the
    way to ``node``, or None (``node`` computed in ``caller`` itself, or not under it)."""
    frames = node.meta.get("frames", ())
    if caller not in frames:
        return None
    i = frames.index(caller)
    return frames[i + 1] if i + 1 < len(frames) else None
