"""Functions of the model's source compiled by ``@torch.jit.script`` (ChatGLM's
``apply_rotary_pos_emb``). TorchScript takes no proxies, so while a module is traced the
source modules' globals hold the Python function each one compiled (torch keeps it as
``_torchdynamo_inline``): the same code, traced like the rest of the forward."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def python_for_scripted(module: nn.Module) -> Iterator[None]:
    """Within: each scripted function of the modules ``module``'s classes come from is its
    Python function."""
    sources = {sys.modules.get(type(m).__module__) for m in module.modules()} - {None}
    patched = [
        (source, name, fn)
        for source in sources
        for name, fn in list(vars(source).items())
        if isinstance(fn, torch.jit.ScriptFunction) and callable(getattr(fn, "_torchdynamo_inline", None))
    ]
    for source, name, fn in patched:
        setattr(source, name, fn._torchdynamo_inline)
    try:
        yield
    finally:
        for source, name, fn in patched:
            setattr(source, name, fn)
