"""What ``passes/load_weights.py`` emits for experts in a layout the fused-MoE runner's
loader does not read: ``_experts_one_by_one``, which hands it one expert's gate, up and down
at a time, for flat ``[E * I, H]`` tensors (dbrx) and for stacked, transposed, interleaved,
biased ones (gpt_oss, whose w13 is interleaved back after loading for ``swigluoai``)."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.weight_streams import WrapWeights
from hfrewrite.errors import HfrewriteError

NAME = "load_weights"


_FLAT_EXPERTS = """\
def _experts_one_by_one(self, weights):
    # The checkpoint holds each expert projection as one flat [experts * I, H] tensor
    # (the down projection transposed); the fused-MoE loader takes one tensor per expert,
    # named as it expects (analysis proved which tensor is gate, up and down).
    flat = {flat}
    for name, tensor in weights:
        suffix = next((s for s in flat if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        projection = flat[suffix]
        per_expert = tensor.view({num_experts}, -1, tensor.shape[-1])
        for expert, weight in enumerate(per_expert):
            weight = weight.T if projection == "down_proj" else weight
            yield f"{{name[: -len(suffix)]}}.{experts}.{{expert}}.{{projection}}.weight", weight
"""


_STACKED_EXPERTS = """\
def _experts_one_by_one(self, weights):
    # The checkpoint stacks each layer's experts: {layout}.
    # The fused-MoE loader takes one expert's gate, up and down at a time (analysis
    # proved the layout by replay).
    for name, tensor in weights:{renames}
        prefix, _, param = name.rpartition(".{experts}.")
        if param not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            yield name, tensor
            continue
        kind = "bias" if param.endswith("_bias") else "weight"
        for expert, stacked in enumerate(tensor):
            if param == "down_proj":
                yield f"{{prefix}}.{experts}.{{expert}}.down_proj.weight", stacked{down}
            elif param == "down_proj_bias":
                yield f"{{prefix}}.{experts}.{{expert}}.down_proj.bias", stacked
            else:
                rows = stacked{rows}
                gate, up = {split}
                yield f"{{prefix}}.{experts}.{{expert}}.gate_proj.{{kind}}", gate
                yield f"{{prefix}}.{experts}.{{expert}}.up_proj.{{kind}}", up
"""

_INTERLEAVE_AFTER_LOAD = """\
# vLLM's swigluoai kernels read gate and up interleaved ([g0, u0, g1, u1, ...]), as the
# checkpoint holds them; the fused-MoE loader stacked this rank's gate and up as halves.
# Each expert's output bias is added once: on the experts' tensor-parallel rank 0, before
# the all-reduce (under expert parallelism each expert lives on one rank, whose rank is 0).
for module in self.modules():
    if isinstance(module, {block}):
        for name, param in module.{experts}.named_parameters():
            if name.endswith(("w13_weight", "w13_bias")):
                gate, up = param.data.chunk(2, dim=1)
                param.data.copy_(torch.stack((gate, up), dim=2).flatten(1, 2))
            elif name.endswith("w2_bias") and module.{experts}.moe_config.tp_rank != 0:
                param.data.zero_()
"""


def experts_need_splitting(moe) -> bool:
    """The checkpoint's experts are flat, or stacked in a layout the runner's own loader
    does not read (transposed, interleaved, biased)."""
    if moe is None:
        return False
    return bool(moe.flat_experts or moe.experts_layout.needs_split or moe.experts_bias)


def experts_one_by_one(body: list[cst.BaseStatement], module: cst.Module, moe) -> list[cst.BaseStatement]:
    """load_weights feeds the checkpoint through ``_experts_one_by_one`` (and, for
    swigluoai, interleaves w13 back after loading)."""
    load_at = next(
        i for i, m in enumerate(body) if isinstance(m, cst.FunctionDef) and m.name.value == "load_weights"
    )
    helper = _flat_experts_helper(module, moe) if moe.flat_experts else _stacked_experts_helper(moe)
    load = body[load_at].visit(WrapWeights("_experts_one_by_one"))
    if moe.activation == "swigluoai":
        load = _interleaving_after_load(load, moe)
    helper = helper.with_changes(leading_lines=body[load_at].leading_lines)
    return [*body[:load_at], helper, load, *body[load_at + 1 :]]


def _stacked_experts_helper(moe) -> cst.FunctionDef:
    """``_experts_one_by_one`` for stacked experts in a layout the runner's own loader
    does not read (transposed, gate and up interleaved, biases: gpt_oss)."""
    stacked = moe.experts_layout
    layout = (
        stacked.shapes
        + (", gate and up interleaved along 2I" if stacked.interleaved else "")
        + (", with biases" if moe.experts_bias else "")
    )
    return t.stmt(
        _STACKED_EXPERTS.format(
            layout=layout,
            experts=moe.experts,
            down=".T" if stacked.transposed else "",
            rows='.T if kind == "weight" else stacked' if stacked.transposed else "",
            split=stacked.split,
            renames=_renamed_first(moe.checkpoint_renames),
        )
    )


def _renamed_first(renames: tuple[tuple[str, str], ...]) -> str:
    """The lines giving the checkpoint's expert tensors the module's names (transformers'
    load-time renames, Aria's ``experts.fc1.weight`` -> ``experts.gate_up_proj``) before
    they are split: the mapper renames only after this helper ran."""
    if not renames:
        return ""
    pairs = ", ".join(f"({old!r}, {new!r})" for old, new in renames).replace("'", '"')
    return (
        "\n        # transformers' load-time renames first: the split reads the module's names"
        f"\n        for old, new in ({pairs},):\n            name = name.replace(old, new)"
    )


def _interleaving_after_load(load: cst.FunctionDef, moe) -> cst.FunctionDef:
    """``return loader.load_weights(...)`` -> load, interleave w13 back, return."""
    body = list(load.body.body)
    last = body[-1]
    if not (isinstance(last, cst.SimpleStatementLine) and isinstance(last.body[0], cst.Return)):
        raise HfrewriteError(f"{NAME}: load_weights does not end by returning the loader's result")
    loaded = t.stmt(f"loaded = {t.code(last.body[0].value)}\n")
    after = t.stmts(_INTERLEAVE_AFTER_LOAD.format(block=moe.module_class, experts=moe.experts))
    return t.with_body(load, [*body[:-1], loaded, *after, t.stmt("return loaded\n")])


def _flat_experts_helper(module: cst.Module, moe) -> cst.FunctionDef:
    """``_experts_one_by_one``, the expert count as the MoE block computes it (its
    ``config`` parameter is the model's config)."""
    block = t.find_class(module, moe.module_class)
    params = [p.name.value for p in t.find_method(block, "__init__").params.params]
    count = t.init_exprs(block).get("n_routed_experts", "")
    if len(params) < 2 or params[1] != "config" or not count.startswith("config."):
        raise HfrewriteError(
            f"{moe.module_class}: {NAME}: the expert count is not an expression of the config"
        )
    flat = {
        f".{moe.experts}.{param}": projection
        for param, projection in zip(moe.flat_experts, ("gate_proj", "up_proj", "down_proj"))
    }
    flat = "{" + ", ".join(f'"{k}": "{v}"' for k, v in flat.items()) + "}"
    return t.stmt(_FLAT_EXPERTS.format(flat=flat, num_experts=f"self.{count}", experts=moe.experts))
