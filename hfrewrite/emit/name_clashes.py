"""Source definitions named like the vLLM symbols the passes emit (custom code's class
``Attention``, ``RMSNorm``): renamed before the passes run, with the plan's class names, so
that ``Attention(...)`` in the emitted file means vLLM's layer."""

from __future__ import annotations

import dataclasses
import re

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.target import VLLM


def avoid_vllm_names(module: cst.Module, plan):
    """(module, plan) with each clashing top-level class or function renamed
    ``<model prefix><name>`` (``StableLMEpochAttention``) everywhere it is named."""
    defined = {n.name.value for n in module.body if isinstance(n, cst.ClassDef | cst.FunctionDef)}
    clashes = sorted(defined & set(VLLM))
    if not clashes:
        return module, plan
    prefix = re.sub(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration)$", "", plan.architecture) or "Source"
    renames = {}
    for name in clashes:
        new = f"{prefix}{name}"
        while new in defined or new in VLLM:
            new = f"Source{new}"
        renames[name] = new
    return t.replace_names(module, renames), _renamed(plan, renames)


def _renamed(value, renames: dict[str, str]):
    """``value`` (a plan, or any part of one) with each string naming a renamed class replaced."""
    if isinstance(value, str):
        return renames.get(value, value)
    if isinstance(value, tuple):
        return tuple(_renamed(v, renames) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _renamed(getattr(value, f.name), renames)
            for f in dataclasses.fields(value)
            if f.name != "sibling_configs"
        }
        return dataclasses.replace(value, **changes)
    return value
