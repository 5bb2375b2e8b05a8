"""Load the original Hugging Face checkpoint into the fused layers.

Matches the causal-LM class produced by ``vllm_model_interface`` and the fusions the plan
allows (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``).

Emits the class attributes vLLM's ``llama.py`` declares::

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={".q_proj": (".qkv_proj", "q"), ...})
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}

``load_weights`` (from the template) hands the checkpoint to ``AutoWeightsLoader`` with that
mapper, so each HF tensor lands in its shard of the fused parameter, under tensor parallel
too; a tied ``lm_head`` is skipped by the loader.

Experts in a layout the fused-MoE runner's loader does not read go through
``_experts_one_by_one``, which hands it one expert's gate, up and down at a time: flat
``[E * I, H]`` tensors (dbrx) and stacked, transposed, interleaved, biased ones (gpt_oss,
whose w13 is interleaved back after loading for vLLM's ``swigluoai`` kernels).

Preconditions: the causal-LM class has ``load_weights`` reading ``self.hf_to_vllm_mapper``.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.plan import MlaPlan
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.weight_streams import WrapWeights, base_model_names, transposing_linears
from hfrewrite.errors import HfrewriteError

NAME = "load_weights"


def _mlp_sites(module: cst.Module, mlp_class: str) -> list[str]:
    """Attributes under which the MLP class is built (`self.mlp = MLP(...)`), sorted."""
    sites = set()
    for node in module.body:
        if isinstance(node, cst.ClassDef) and (init := t.find_method(node, "__init__")):
            for s in _all_statements(init):
                attr = t.self_attr_assigned(s)
                value = t.assigned_value(s) if attr else None
                if isinstance(value, cst.IfExp):  # `MoE(config) if ... else MLP(config)`
                    built = {t.call_name(value.body), t.call_name(value.orelse)}
                else:
                    built = {t.call_name(value)} if value is not None else set()
                if mlp_class in built:
                    sites.add(attr)
    return sorted(sites)


def _all_statements(node: cst.CSTNode) -> list[cst.BaseStatement]:
    found: list[cst.BaseStatement] = []

    class _Collect(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, s: cst.SimpleStatementLine) -> None:
            found.append(s)

    node.visit(_Collect())
    return found


_PER_HEAD = """\
def _qkv_per_head_to_blocks(self, weights):
    # The checkpoint's {attr} interleaves q, k and v per head ([h0: q k v][h1: ...]);
    # QKVParallelLinear loads [q; k; v]: reorder the rows (analysis proved the layout).
    heads = self.config.{heads}
    for name, tensor in weights:
        if name.endswith((".{attr}.weight", ".{attr}.bias")):
            tensor = tensor.reshape(heads, 3, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)
        yield name, tensor
"""


_GROUPED = """\
def _qkv_per_head_to_blocks(self, weights):
    # The checkpoint's {attr} groups the rows per kv head ([g0: its query heads, k, v][g1: ...]);
    # QKVParallelLinear loads [q; k; v]: reorder the rows (analysis proved the layout).
    kv_heads = self.config.{kv_heads}
    groups = self.config.{heads} // kv_heads
    for name, tensor in weights:
        if name.endswith((".{attr}.weight", ".{attr}.bias")):
            rows = tensor.reshape(kv_heads, groups + 2, -1, *tensor.shape[1:])
            q, k, v = rows[:, :groups], rows[:, groups], rows[:, groups + 1]
            tensor = torch.cat([x.reshape(-1, *tensor.shape[1:]) for x in (q, k, v)])
        yield name, tensor
"""


_KV_SPLIT = """\
def _kv_split(self, weights):
    # The checkpoint's {attr} holds k and v {layout}; QKVParallelLinear loads them as
    # two shards: split the rows into {attr}_k and {attr}_v (analysis proved the layout).
    kv_heads = self.config.{kv_heads}
    for name, tensor in weights:
        if name.endswith((".{attr}.weight", ".{attr}.bias")):
            stem, kind = name.rsplit(".", 1)
            rows = tensor.reshape({rows}, -1, *tensor.shape[1:])
            for i, role in enumerate(("k", "v")):
                yield f"{{stem}}_{{role}}.{{kind}}", rows[{pick}].reshape(-1, *tensor.shape[1:])
        else:
            yield name, tensor
"""

# how _kv_split takes the rows apart, per layout of the checkpoint's k/v projection
_KV_ROWS = {
    "blocks": ("([k; v])", "2, kv_heads", "i"),
    "per_head": ("per kv head ([h0: k v][h1: ...])", "kv_heads, 2", ":, i"),
}


_NORMALIZED_HEAD = """\
def _lm_head_normalized(self, weights):
    # The source's {head} multiplies by its weight with each row L2-normalised (Baichuan2's
    # NormHead): the rows are normalised once, here (analysis proved the logits).
    for name, tensor in weights:
        if name == "{head}.weight":
            tensor = torch.nn.functional.normalize(tensor.float(), dim=-1).to(tensor.dtype)
        yield name, tensor
"""


_TRANSPOSED_HEAD = """\
def _lm_head_transposed(self, weights):
    # The source's {head} keeps its weight as [hidden, vocab] when it is not tied, and
    # multiplies by it untransposed (ERNIE-4.5's LMHead; analysis proved both layouts).
    for name, tensor in weights:
        if name == "{head}.weight" and not self.config.tie_word_embeddings:
            tensor = tensor.t()
        yield name, tensor
"""


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
    for name, tensor in weights:
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


def _stacked_experts_helper(moe) -> cst.FunctionDef:
    """``_experts_one_by_one`` for stacked experts in a layout the runner's own loader
    does not read (transposed, gate and up interleaved, biases: gpt_oss)."""
    layout = (
        (
            "gate_up_proj [E, H, 2I], down_proj [E, I, H]"
            if moe.experts_transposed
            else "gate_up_proj [E, 2I, H]"
        )
        + (", gate and up interleaved along 2I" if moe.experts_interleaved else "")
        + (", with biases" if moe.experts_bias else "")
    )
    split = "rows[0::2], rows[1::2]" if moe.experts_interleaved else "rows.chunk(2, dim=0)"
    return t.stmt(
        _STACKED_EXPERTS.format(
            layout=layout,
            experts=moe.experts,
            down=".T" if moe.experts_transposed else "",
            rows='.T if kind == "weight" else stacked' if moe.experts_transposed else "",
            split=split,
        )
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


def _class_attrs(cls: cst.ClassDef) -> set[str]:
    """The names a class body assigns."""
    return {
        target.target.value
        for s in cls.body.body
        if m.matches(s, m.SimpleStatementLine(body=[m.Assign()]))
        for target in s.body[0].targets
        if isinstance(target.target, cst.Name)
    }


def _reorder_per_head_qkv(body: list[cst.BaseStatement], att) -> list[cst.BaseStatement]:
    """load_weights feeds the checkpoint through the row reordering (or the k/v split)."""
    out = []
    for member in body:
        if isinstance(member, cst.FunctionDef) and member.name.value == "load_weights":
            if att.kv_fused:
                layout, rows, pick = _KV_ROWS[att.kv_fused]
                member = member.visit(WrapWeights("_kv_split"))
                source = _KV_SPLIT.format(
                    attr=att.k.attr, layout=layout, rows=rows, pick=pick, kv_heads=att.kv_heads_field
                )
            else:
                member = member.visit(WrapWeights())
                template = _GROUPED if att.qkv_grouped else _PER_HEAD
                source = template.format(attr=att.q.attr, heads=att.heads_field, kv_heads=att.kv_heads_field)
            helper = t.stmt(source)
            out.append(helper.with_changes(leading_lines=member.leading_lines))
        out.append(member)
    return out


# the lm_head kinds (analyze/lm_head.py) whose weight is reshaped while it loads
_HEAD_HELPERS = {
    "l2_normalized": ("_lm_head_normalized", _NORMALIZED_HEAD),
    "transposed_when_untied": ("_lm_head_transposed", _TRANSPOSED_HEAD),
}


def _reshaping_head(body: list[cst.BaseStatement], head: str, kind: str) -> list[cst.BaseStatement]:
    """load_weights feeds the checkpoint through the head's row normalisation or transpose."""
    name, template = _HEAD_HELPERS[kind]
    out = []
    for member in body:
        if isinstance(member, cst.FunctionDef) and member.name.value == "load_weights":
            member = member.visit(WrapWeights(name))
            helper = t.stmt(template.format(head=head))
            out.append(helper.with_changes(leading_lines=member.leading_lines))
        out.append(member)
    return out


def _skipping_mtp_layers(load: cst.FunctionDef, plan) -> cst.FunctionDef:
    """load_weights drops the layers past the last decoder layer first."""
    prefix = f"{plan.base_model_attr}.{plan.layers}."
    skip = t.stmts(
        f"# Hub checkpoints store config.{plan.mtp_layers_field} multi-token-prediction layers after\n"
        "# the last decoder layer; they serve speculative decoding, not this model.\n"
        "weights = (\n"
        "    (name, tensor)\n"
        "    for name, tensor in weights\n"
        f'    if not (name.startswith("{prefix}")\n'
        f'            and int(name.split(".")[{prefix.count(".")}]) >= self.config.num_hidden_layers)\n'
        ")\n"
    )
    return t.with_body(load, [*skip, *load.body.body])


def _single_query_mapper(load: cst.FunctionDef, module: cst.Module, att: MlaPlan) -> cst.FunctionDef:
    """With both MLA queries proven, a config without the low-rank one has no
    ``fused_qkv_a_proj``: its latent kv projection loads under its own name."""
    test, low_rank_when = att.q_switch
    init = t.init_exprs(t.find_class(module, att.module_class))
    condition = t.config_test(test, init)
    condition = condition if not low_rank_when else f"not ({condition})"
    condition = t.code(t.expr(condition).visit(_ConfigOfSelf()))
    mapper = t.stmts(
        "mapper = self.hf_to_vllm_mapper\n"
        f"if {condition}:\n"
        f"    # no low-rank query: {att.kv_a} is not fused into fused_qkv_a_proj, it loads as it is\n"
        "    stacked = mapper.orig_to_new_stacked\n"
        '    mapper = replace(mapper, orig_to_new_stacked={k: v for k, v in stacked.items() if v[0] != ".fused_qkv_a_proj"})\n'
    )
    body = list(load.body.body)
    body[-1:-1] = mapper
    return t.with_body(load, body).visit(_MapperArgument())


class _ConfigOfSelf(cst.CSTTransformer):
    """``config`` -> ``self.config`` (a test from a module's ``__init__`` read in a method)."""

    def leave_Name(self, original, updated):
        return t.expr("self.config") if updated.value == "config" else updated

    def visit_Attribute(self, node):
        node.value.visit(self)  # only the leftmost name of a dotted access is renamed
        return False

    def leave_Attribute(self, original, updated):
        return (
            updated.with_changes(value=updated.value.visit(self))
            if isinstance(updated.value, cst.Name)
            else updated
        )


class _MapperArgument(cst.CSTTransformer):
    """``mapper=self.hf_to_vllm_mapper`` -> ``mapper=mapper``."""

    def leave_Arg(self, original, updated):
        if updated.keyword is not None and updated.keyword.value == "mapper":
            return updated.with_changes(value=cst.Name("mapper"))
        return updated


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    if "packed_modules_mapping" in _class_attrs(t.find_class(module, plan.architecture)):
        return PassResult(module=module)  # (its own output)
    att, mlp, moe = plan.attention, plan.mlp, plan.moe
    stacks = {}  # checkpoint-fused projections load as they are: nothing to stack
    if isinstance(att, MlaPlan):
        if att.q_a is not None:  # passes/mla_attention.py's fused_qkv_a_proj
            stacks["fused_qkv_a_proj"] = [
                (att.q_a, f".{att.q_a}", "0"),
                (att.kv_a, f".{att.kv_a}", "1"),
            ]
    elif att.kv_fused:  # split into {kv}_k and {kv}_v by _kv_split
        stacks["qkv_proj"] = [
            (att.q.attr, f".{att.q.attr}", '"q"'),
            (att.k.attr, f".{att.k.attr}_k", '"k"'),
            (att.k.attr, f".{att.k.attr}_v", '"v"'),
        ]
    elif not att.fused_qkv:
        stacks["qkv_proj"] = [
            (att.q.attr, f".{att.q.attr}", '"q"'),
            (att.k.attr, f".{att.k.attr}", '"k"'),
            (att.v.attr, f".{att.v.attr}", '"v"'),
        ]
    if mlp is not None and mlp.gate is not None and not mlp.fused_gate_up:
        # With stacked experts, per-expert `experts.N.gate_proj` must reach the fused-MoE
        # loader untouched: qualify the dense MLP keys by where the MLP class is built.
        sites = _mlp_sites(module, mlp.module_class) if moe is not None else [""]
        stacks["gate_up_proj"] = [
            (attr, f"{f'.{site}' if site else ''}.{attr}", shard)
            for site in sites
            for attr, shard in ((mlp.gate.attr, "0"), (mlp.up.attr, "1"))
        ]
    cls = t.find_class(module, plan.architecture)
    load = t.find_method(cls, "load_weights")
    if load is None or "hf_to_vllm_mapper" not in t.self_attrs_used(load):
        raise HfrewriteError(f"{plan.architecture}: {NAME}: no load_weights using self.hf_to_vllm_mapper")
    packed_of = {
        fused: list(dict.fromkeys(repr(name) for name, _, _ in parts)) for fused, parts in stacks.items()
    }
    if getattr(att, "fused_qkv", False):
        packed_of[att.q.attr] = [repr(att.q.attr)]
    if mlp is not None and mlp.fused_gate_up:
        packed_of[mlp.gate.attr] = [repr(mlp.gate.attr)]
    packed = ", ".join(f'"{fused}": [{", ".join(names)}]' for fused, names in packed_of.items())
    stacked = "".join(
        f'        "{key}": (".{fused}", {shard}),\n'
        if "." not in key[1:]
        else f'        "{key}": ("{key.rsplit(".", 1)[0]}.{fused}", {shard}),\n'
        for fused, parts in stacks.items()
        for _, key, shard in parts
    )
    renames = moe.checkpoint_renames if moe is not None else ()
    substr = "".join(f'        "{old}": "{new}",\n' for old, new in renames)
    mapper = "hf_to_vllm_mapper = WeightsMapper(\n"
    prefixes = "".join(f'        "{old}": "{new}",\n' for old, new in plan.checkpoint_prefix_renames)
    if prefixes:
        mapper += f"    orig_to_new_prefix={{\n{prefixes}    }},\n"
    if substr:
        mapper += f"    orig_to_new_substr={{\n{substr}    }},\n"
    mapper += f"    orig_to_new_stacked={{\n{stacked}    }}\n)\n"
    comment = (
        (
            "# Hugging Face checkpoints keep the fused projections apart: each tensor is\n"
            "# loaded into its shard (weight_name: (param_name, shard_id))"
            + (
                "; per-expert and stacked\n# expert tensors go to the fused-MoE loader as they are.\n"
                if moe
                else ".\n"
            )
        )
        if stacks
        else "# The checkpoint's projections are fused as vLLM's are: names map one to one.\n"
    )
    members = t.stmts(
        f"packed_modules_mapping = {{{packed}}}\n".replace("'", '"')
        + comment
        + mapper
        + f'embedding_modules = {{"{plan.embed_tokens}": "input_embeddings", "{plan.lm_head}": "output_embeddings"}}\n'
    )
    body = list(cls.body.body)
    body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine()])
    if plan.base_model_attr in plan.checkpoint_roots and not plan.checkpoint_prefix_renames:
        body = base_model_names(body, plan)
    if plan.transposed_linears:
        body = transposing_linears(body, plan)
    if getattr(att, "qkv_per_head", False) or getattr(att, "kv_fused", None):
        body = _reorder_per_head_qkv(body, att)
    if plan.lm_head_weight in _HEAD_HELPERS:
        body = _reshaping_head(body, plan.lm_head, plan.lm_head_weight)
    regrouped = moe is not None and (moe.experts_transposed or moe.experts_interleaved or moe.experts_bias)
    if moe is not None and (moe.flat_experts or regrouped):
        load_at = next(
            i for i, m in enumerate(body) if isinstance(m, cst.FunctionDef) and m.name.value == "load_weights"
        )
        helper = _flat_experts_helper(module, moe) if moe.flat_experts else _stacked_experts_helper(moe)
        load = body[load_at].visit(WrapWeights("_experts_one_by_one"))
        if moe.activation == "swigluoai":
            load = _interleaving_after_load(load, moe)
        body[load_at : load_at + 1] = [helper.with_changes(leading_lines=body[load_at].leading_lines), load]
    if plan.mtp_layers_field:
        body = [
            _skipping_mtp_layers(m, plan)
            if isinstance(m, cst.FunctionDef) and m.name.value == "load_weights"
            else m
            for m in body
        ]
    if isinstance(att, MlaPlan) and att.q_switch is not None:
        body = [
            _single_query_mapper(m, module, att)
            if isinstance(m, cst.FunctionDef) and m.name.value == "load_weights"
            else m
            for m in body
        ]
    cls = cls.with_changes(body=cls.body.with_changes(body=[*members, *body]))
    sites = Sites()
    module = sites.replace_class(module, plan.architecture, cls)
    return PassResult(
        module=module,
        imports=("WeightsMapper", *(("replace",) if isinstance(att, MlaPlan) and att.q_switch else ())),
        fused=(FusionRow(plan.architecture, "load_weights: HF checkpoint names -> fused shards"),),
        matches=sites.count,
    )
