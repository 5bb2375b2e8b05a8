"""A base model whose parts sit deeper than its children (ChatGLM3: ``embedding.
word_embeddings``, ``encoder.layers``, ``encoder.final_layernorm``; its lm_head
``output_layer`` inside it), flattened for the file: the plan names each part by its last
attribute, the holders' ``__init__`` bodies are built in the base model's
(passes/flatten_base_model.py), the lm_head moves to the causal LM, and the checkpoint's names
are mapped onto the flat ones. Children the file drops that hold state but no parameters
(ChatGLM3's ``rotary_pos_emb.inv_freq``) are skipped when loaded."""

from __future__ import annotations

import dataclasses

from torch import nn

from hfrewrite.analyze.branches import init_assignments, init_switches, with_config_attrs
from hfrewrite.analyze.model_layout import ModelLayout
from hfrewrite.analyze.plan import ModelPlan, refuse


def flat_plan(plan: ModelPlan, layout: ModelLayout, small) -> ModelPlan:
    """``plan`` with the nested parts of ``layout`` named as the flat file builds them."""
    if not layout.nested:
        return plan
    base, attr = layout.base, layout.base_attr
    parts = {p: p for p in (plan.embed_tokens, plan.layers, plan.final_norm) if p}
    holders: dict[str, str] = {}
    for path in parts:
        if path.count(".") > 1:
            refuse(
                "model_layout", f"{path}: deeper than a child's child of the base model", type(base).__name__
            )
        if "." in path:
            holder = path.split(".")[0]
            holders[holder] = type(base.get_submodule(holder)).__name__
    flat = {path: path.rsplit(".", 1)[-1] for path in parts}
    if len(set(flat.values())) != len(flat):
        refuse("model_layout", f"parts {sorted(parts)} share a name once flattened", type(base).__name__)
    head = plan.lm_head.removeprefix(f"{attr}.")
    renames = [(f"{attr}.{path}.", f"{attr}.{flat[path]}.") for path in parts if path != flat[path]]
    if head != plan.lm_head:  # the lm_head inside the base model: the causal LM's own in the file
        renames.append((f"{attr}.{head}.", f"{head}."))
    kept = set(holders) | set(flat.values()) | {head}
    dropped = [
        (f"{attr}.{name}.", None)
        for name, child in base.named_children()
        if name not in kept and next(child.parameters(), None) is None and _persistent(child)
    ]
    return dataclasses.replace(
        plan,
        embed_tokens=flat[plan.embed_tokens],
        layers=flat[plan.layers],
        final_norm=flat.get(plan.final_norm, plan.final_norm),
        lm_head=head,
        checkpoint_prefix_renames=(*plan.checkpoint_prefix_renames, *renames, *dropped),
        base_init_switches=plan.base_init_switches
        + tuple(s for holder in holders for s in _holder_switches(base.get_submodule(holder), small)),
        flat_holders=tuple(holders.items()),
        flat_head=type(base.get_submodule(head)).__name__ if head != plan.lm_head else "",
        head_tied_to=_flat_path(plan.head_tied_to, attr, flat),
    )


def _flat_path(path: str | None, attr: str, flat: dict[str, str]) -> str | None:
    for nested, name in flat.items():
        if path == f"{attr}.{nested}":
            return f"{attr}.{name}"
    return path


def _persistent(module: nn.Module) -> bool:
    """``module`` holds buffers a checkpoint saved from it would name."""
    return bool(module.state_dict())


def _holder_switches(holder: nn.Module, small) -> tuple[tuple[str, bool], ...]:
    """(test, value on ``small``) of each ``if`` in the holder's ``__init__`` on its own
    attributes set from the config (``if self.post_layer_norm:``), the attributes written as
    their config expressions (``config.post_layer_norm``): the form the hoisted test takes."""
    assigned = init_assignments(type(holder))
    return init_switches(holder, small, lambda test: with_config_attrs(test, assigned))
