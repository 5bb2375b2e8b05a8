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

A hybrid's mixer whose vLLM layer fuses projections the checkpoint keeps apart stacks them
too, named under the layer's child where the attention's projections share their names
(OLMo-hybrid's ``.linear_attn.q_proj`` into ``in_proj_qkvg``, mapped before the attention's
``.q_proj``); its convolutions that transformers concatenates at load (``q_conv1d``,
``k_conv1d``, ``v_conv1d``) go through ``_concatenated_convs``, which joins them and splits
them again by the q, k and v widths (a checkpoint saved by transformers splits them evenly).
transformers' plain substring renames of the model type (OLMo-hybrid's
``attention_layer_norm`` -> ``input_layernorm``) are the mapper's ``orig_to_new_substr``.

Preconditions: the causal-LM class has ``load_weights`` reading ``self.hf_to_vllm_mapper``.
"""

from __future__ import annotations

from typing import NamedTuple

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.analyze.plan import MlaPlan
from hfrewrite.analyze.qkv_layouts import MP_BLOCKS, QkvLayout
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.expert_weights import experts_need_splitting, experts_one_by_one
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.weight_streams import (
    WrapWeights,
    base_model_names,
    concatenated_convs,
    ignoring_unexpected,
    transposing_linears,
)
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


_MP_BLOCKS = """\
def _qkv_mp_blocks_to_blocks(self, weights):
    # The checkpoint's {attr} holds {blocks} blocks, each [q; v; k] of a {blocks}th of the heads
    # (CodeGen's mp_num); QKVParallelLinear loads [q; k; v]: reorder the rows (analysis
    # proved the layout at two head counts).
    for name, tensor in weights:
        if name.endswith((".{attr}.weight", ".{attr}.bias")):
            q, v, k = tensor.reshape({blocks}, 3, -1, *tensor.shape[1:]).unbind(1)
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
    QkvLayout.KV_BLOCKS: ("([k; v])", "2, kv_heads", "i"),
    QkvLayout.KV_PER_HEAD: ("per kv head ([h0: k v][h1: ...])", "kv_heads, 2", ":, i"),
}
# the reordering helper of each q/k/v layout that needs one (QkvLayout.load_helper)
_QKV_REORDER = {
    QkvLayout.PER_HEAD: _PER_HEAD,
    QkvLayout.GROUPED: _GROUPED,
    QkvLayout.MP_BLOCKS_QVK: _MP_BLOCKS,
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


def _qkv_layout(att) -> QkvLayout | None:
    """The attention's q/k/v checkpoint layout; None for three Linears and for MLA."""
    return getattr(att, "qkv_layout", None)


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
            member = member.visit(WrapWeights(att.qkv_layout.load_helper))
            if att.qkv_layout.holds_q:
                template = _QKV_REORDER[att.qkv_layout]
                source = template.format(
                    attr=att.q.attr, heads=att.heads_field, kv_heads=att.kv_heads_field, blocks=MP_BLOCKS
                )
            else:
                layout, rows, pick = _KV_ROWS[att.qkv_layout]
                source = _KV_SPLIT.format(
                    attr=att.k.attr, layout=layout, rows=rows, pick=pick, kv_heads=att.kv_heads_field
                )
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


class _Shard(NamedTuple):
    """One checkpoint tensor loaded into a shard of a fused parameter."""

    projection: str  # the checkpoint's projection (`q_proj`)
    key: str  # the checkpoint name it is matched by (`.q_proj`, `.mlp.gate_proj`)
    shard_id: str  # the loader's shard id, as code (`"q"`, `0`)


def _stacked_shards(module: cst.Module, plan) -> dict[str, list[_Shard]]:
    """The fused parameters whose projections the checkpoint keeps apart, with their shards."""
    att, mlp, moe = plan.attention, plan.mlp, plan.moe
    stacks = {}  # checkpoint-fused projections load as they are: nothing to stack
    if isinstance(att, MlaPlan):
        if att.q_a is not None:  # passes/mla_attention.py's fused_qkv_a_proj
            stacks["fused_qkv_a_proj"] = [
                _Shard(att.q_a, f".{att.q_a}", "0"),
                _Shard(att.kv_a, f".{att.kv_a}", "1"),
            ]
    elif att is None:  # attention-free: no q/k/v to stack
        pass
    elif att.qkv_layout is not None and not att.qkv_layout.holds_q:  # split by _kv_split
        stacks["qkv_proj"] = [
            _Shard(att.q.attr, f".{att.q.attr}", '"q"'),
            _Shard(att.k.attr, f".{att.k.attr}_k", '"k"'),
            _Shard(att.k.attr, f".{att.k.attr}_v", '"v"'),
        ]
    elif att.qkv_layout is None:
        stacks["qkv_proj"] = [
            _Shard(att.q.attr, f".{att.q.attr}", '"q"'),
            _Shard(att.k.attr, f".{att.k.attr}", '"k"'),
            _Shard(att.v.attr, f".{att.v.attr}", '"v"'),
        ]
    if mlp is not None and mlp.form is MlpForm.AND_MUL and not mlp.fused_gate_up:
        # With stacked experts, per-expert `experts.N.gate_proj` must reach the fused-MoE
        # loader untouched: qualify the dense MLP keys by where the MLP class is built.
        sites = _mlp_sites(module, mlp.module_class) if moe is not None else [""]
        stacks["gate_up_proj"] = [
            _Shard(attr, f"{f'.{site}' if site else ''}.{attr}", shard)
            for site in sites
            for attr, shard in ((mlp.gate.attr, "0"), (mlp.up.attr, "1"))
        ]
    # a hybrid's mixer whose vLLM layer fuses projections the checkpoint keeps apart; named
    # under its layer's child where its names are also the attention's, and mapped first
    # (vLLM's mapper applies every stacked name a tensor's name holds, in order)
    scope = getattr(plan.mixer, "stacked_scope", "")
    mixer = {}
    for fused, projection, shard in getattr(plan.mixer, "stacked_shards", ()):
        key = f".{scope}.{projection}" if scope else f".{projection}"
        mixer.setdefault(fused, []).append(_Shard(projection, key, shard))
    return {**mixer, **stacks} if scope else {**stacks, **mixer}


def _packed_modules(plan, stacks: dict[str, list[_Shard]]) -> str:
    """``packed_modules_mapping``: each fused parameter and the projections it packs."""
    att, mlp = plan.attention, plan.mlp
    packed_of = {
        fused: list(dict.fromkeys(repr(shard.projection) for shard in parts))
        for fused, parts in stacks.items()
    }
    if _qkv_layout(att) is not None and att.qkv_layout.holds_q:
        packed_of[att.q.attr] = [repr(att.q.attr)]
    if mlp is not None and mlp.fused_gate_up:
        packed_of[mlp.gate.attr] = [repr(mlp.gate.attr)]
    packed = ", ".join(f'"{fused}": [{", ".join(names)}]' for fused, names in packed_of.items())
    return f"packed_modules_mapping = {{{packed}}}\n".replace("'", '"')


def _mapper_comment(stacks: dict[str, list[_Shard]], moe) -> str:
    """The comment above ``hf_to_vllm_mapper``: what the checkpoint's names map to."""
    if not stacks:
        return "# The checkpoint's projections are fused as vLLM's are: names map one to one.\n"
    return (
        "# Hugging Face checkpoints keep the fused projections apart: each tensor is\n"
        "# loaded into its shard (weight_name: (param_name, shard_id))"
        + (
            "; per-expert and stacked\n# expert tensors go to the fused-MoE loader as they are.\n"
            if moe
            else ".\n"
        )
    )


def _weights_mapper(plan, stacks: dict[str, list[_Shard]]) -> str:
    """``hf_to_vllm_mapper``: checkpoint prefixes and substrings renamed, shards stacked."""
    stacked = "".join(
        f'        "{key}": (".{fused}", {shard}),\n'
        if "." not in key[1:]
        else f'        "{key}": ("{key.rsplit(".", 1)[0]}.{fused}", {shard}),\n'
        for fused, parts in stacks.items()
        for _, key, shard in parts
    )
    renames = plan.moe.checkpoint_renames if plan.moe is not None else plan.checkpoint_renames
    substr = "".join(f'        "{old}": "{new}",\n' for old, new in renames)
    mapper = "hf_to_vllm_mapper = WeightsMapper(\n"
    renamed = plan.checkpoint_prefix_renames
    if plan.base_model_inner:  # OPT's model.decoder is the file's base model: model.
        base = plan.base_model_attr
        renamed = ((f"{base}.{plan.base_model_inner}.", f"{base}."), *renamed)
    prefixes = "".join(  # None: a tensor of a part the file drops, skipped
        f'        "{old}": {"None" if new is None else chr(34) + new + chr(34)},\n' for old, new in renamed
    )
    if prefixes:
        mapper += f"    orig_to_new_prefix={{\n{prefixes}    }},\n"
    suffixes = plan.mixer.checkpoint_suffix_renames if plan.mixer is not None else ()
    if suffixes:  # a hybrid's mixer parts vLLM names otherwise (Mamba-2's A_log loaded as A)
        pairs = ", ".join(f'"{old}": ' + ("None" if new is None else f'"{new}"') for old, new in suffixes)
        mapper += f"    orig_to_new_suffix={{{pairs}}},\n"
    if substr:
        mapper += f"    orig_to_new_substr={{\n{substr}    }},\n"
    return mapper + f"    orig_to_new_stacked={{\n{stacked}    }}\n)\n"


def _mapping_members(plan, stacks: dict[str, list[_Shard]]) -> list[cst.BaseStatement]:
    """The class attributes vLLM reads: packed modules, the checkpoint-name mapper, embeddings."""
    return t.stmts(
        _packed_modules(plan, stacks)
        + _mapper_comment(stacks, plan.moe)
        + _weights_mapper(plan, stacks)
        + f'embedding_modules = {{"{plan.embed_tokens}": "input_embeddings", "{plan.lm_head}": "output_embeddings"}}\n'
    )


def _on_load_weights(body: list[cst.BaseStatement], rewrite) -> list[cst.BaseStatement]:
    """``body`` with its ``load_weights`` method rewritten by ``rewrite``."""
    return [
        rewrite(m) if isinstance(m, cst.FunctionDef) and m.name.value == "load_weights" else m for m in body
    ]


def _with_checkpoint_helpers(
    body: list[cst.BaseStatement], module: cst.Module, plan
) -> list[cst.BaseStatement]:
    """The class body with load_weights feeding the checkpoint through each helper that
    renames, reshapes or drops tensors the plan proved need it."""
    att, moe = plan.attention, plan.moe
    if plan.base_model_attr in plan.checkpoint_roots and not plan.checkpoint_prefix_renames:
        body = base_model_names(body, plan)
    else:
        body = ignoring_unexpected(body, plan)
    if plan.transposed_linears:
        body = transposing_linears(body, plan)
    if _qkv_layout(att) is not None and att.qkv_layout.load_helper:
        body = _reorder_per_head_qkv(body, att)
    if plan.lm_head_weight in _HEAD_HELPERS:
        body = _reshaping_head(body, plan.lm_head, plan.lm_head_weight)
    if experts_need_splitting(moe):
        body = experts_one_by_one(body, module, moe)
    if getattr(plan.mixer, "conv_sources", ()):
        body = concatenated_convs(body, plan.mixer)
    if plan.mtp_layers_field:
        body = _on_load_weights(body, lambda load: _skipping_mtp_layers(load, plan))
    if isinstance(att, MlaPlan) and att.q_switch is not None:
        body = _on_load_weights(body, lambda load: _single_query_mapper(load, module, att))
    return body


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    if "packed_modules_mapping" in _class_attrs(t.find_class(module, plan.architecture)):
        return PassResult(module=module)  # (its own output)
    att = plan.attention
    stacks = _stacked_shards(module, plan)
    cls = t.find_class(module, plan.architecture)
    load = t.find_method(cls, "load_weights")
    if load is None or "hf_to_vllm_mapper" not in t.self_attrs_used(load):
        raise HfrewriteError(f"{plan.architecture}: {NAME}: no load_weights using self.hf_to_vllm_mapper")
    members = _mapping_members(plan, stacks)
    body = list(cls.body.body)
    body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine()])
    body = _with_checkpoint_helpers(body, module, plan)
    cls = cls.with_changes(body=cls.body.with_changes(body=[*members, *body]))
    sites = Sites()
    module = sites.replace_class(module, plan.architecture, cls)
    return PassResult(
        module=module,
        imports=("WeightsMapper", *(("replace",) if isinstance(att, MlaPlan) and att.q_switch else ())),
        fused=(FusionRow(plan.architecture, "load_weights: HF checkpoint names -> fused shards"),),
        matches=sites.count,
    )
