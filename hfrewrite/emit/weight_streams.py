"""Generator methods load_weights feeds the checkpoint through, and the wrapper that threads
them into its ``loader.load_weights(...)`` call: base-model checkpoints (names without the
base model's prefix, tensors transformers declares unexpected) and ``[in, out]`` projection
weights transposed (GPT-2's Conv1D)."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t


def _tuple_items(items: Iterable[str]) -> str:
    """The inside of a tuple literal of strings, one item with its trailing comma."""
    quoted = [f'"{item}"' for item in items]
    return ", ".join(quoted) + ("," if len(quoted) == 1 else "")


class WrapWeights(cst.CSTTransformer):
    """``loader.load_weights(weights, ...)`` -> ``loader.load_weights(self.<helper>(weights), ...)``."""

    def __init__(self, helper: str = "_qkv_per_head_to_blocks") -> None:
        self.helper = helper

    def leave_Call(self, original, updated):
        if (
            m.matches(updated.func, m.Attribute(value=m.Name("loader"), attr=m.Name("load_weights")))
            and updated.args
        ):
            first = updated.args[0].with_changes(
                value=t.expr(f"self.{self.helper}({t.code(updated.args[0].value)})")
            )
            return updated.with_changes(args=[first, *updated.args[1:]])
        return updated


_BASE_MODEL_NAMES = """\
def _base_model_names(self, weights):
    # A checkpoint saved from the base model alone names its tensors without "{base}.";
    # transformers adds that prefix when it loads one into the causal LM, and so does this.
    for name, tensor in weights:
        if not name.startswith(({roots})):
            name = "{base}." + name
        yield name, tensor
"""


def base_model_names(body: list[cst.BaseStatement], plan) -> list[cst.BaseStatement]:
    """load_weights reads checkpoints of the base model alone (GPT-2's, BLOOM's) too,
    first of all, and ignores the tensors transformers declares unexpected (names ending so,
    or under a prefix: layers the causal LM does not build, left out of the renaming)."""
    skipped = getattr(plan, "checkpoint_skipped", ())
    roots = _tuple_items([*(f"{r}." for r in plan.checkpoint_roots), *skipped])
    out = []
    for member in body:
        if isinstance(member, cst.FunctionDef) and member.name.value == "load_weights":
            member = member.visit(WrapWeights("_base_model_names"))
            helper = t.stmt(_BASE_MODEL_NAMES.format(base=plan.base_model_attr, roots=roots))
            out.append(helper.with_changes(leading_lines=member.leading_lines))
        out.append(member)
    return ignoring_unexpected(out, plan)


def ignoring_unexpected(body: list[cst.BaseStatement], plan) -> list[cst.BaseStatement]:
    """load_weights ignoring the tensors transformers declares unexpected (names ending so, or
    under a prefix: NemotronH's ``mtp.*``)."""
    skipped = getattr(plan, "checkpoint_skipped", ())
    if not (plan.checkpoint_unexpected or skipped):
        return body
    visitor = _IgnoringUnexpected(plan.checkpoint_unexpected, skipped)
    return [
        m.visit(visitor) if isinstance(m, cst.FunctionDef) and m.name.value == "load_weights" else m
        for m in body
    ]


class _IgnoringUnexpected(cst.CSTTransformer):
    """``AutoWeightsLoader(self)`` -> ``AutoWeightsLoader(self, ignore_unexpected_prefixes=[...],
    ignore_unexpected_suffixes=[...])``."""

    def __init__(self, suffixes: tuple[str, ...], prefixes: tuple[str, ...] = ()) -> None:
        self.suffixes, self.prefixes = suffixes, prefixes

    def leave_Call(self, original, updated):
        if m.matches(updated.func, m.Name("AutoWeightsLoader")) and len(updated.args) == 1:
            options = [
                (name, items)
                for name, items in (
                    ("ignore_unexpected_prefixes", self.prefixes),
                    ("ignore_unexpected_suffixes", self.suffixes),
                )
                if items
            ]
            listed = "".join(f", {name}=[{', '.join(repr(s) for s in items)}]" for name, items in options)
            return t.expr(f"AutoWeightsLoader({t.code(updated.args[0].value)}{listed})".replace("'", '"'))
        return updated


_TRANSPOSED_LINEARS = """\
def _linears_transposed(self, weights):
    # The checkpoint keeps these projections' weights as [in, out]: the source's {classes}
    # multiplies by them untransposed (analysis proved it); nn.Linear's are [out, in].
    for name, tensor in weights:
        if name.endswith(({suffixes})):
            tensor = tensor.t()
        yield name, tensor
"""


def transposing_linears(body: list[cst.BaseStatement], plan) -> list[cst.BaseStatement]:
    """load_weights feeds the checkpoint through the transposition of the proven
    ``[in, out]`` projections (GPT-2's Conv1D), before any other reshaping helper."""
    suffixes = _tuple_items(f".{path}.weight" for path in plan.transposed_linears)
    classes = ", ".join(plan.transposed_linear_classes)
    out = []
    for member in body:
        if isinstance(member, cst.FunctionDef) and member.name.value == "load_weights":
            member = member.visit(WrapWeights("_linears_transposed"))
            helper = t.stmt(_TRANSPOSED_LINEARS.format(classes=classes, suffixes=suffixes))
            out.append(helper.with_changes(leading_lines=member.leading_lines))
        out.append(member)
    return out


_CONCATENATED = """\
def _concatenated_convs(self, weights):
    # transformers concatenates the checkpoint's {names} into one
    # {attr}.conv1d at load, however the checkpoint splits them (one saved by transformers
    # splits evenly): this concatenates them too and gives each shard its q, k, v channels.
    config = self.config
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    sizes = [key_dim, key_dim, config.linear_num_value_heads * config.linear_value_head_dim]
    parts = {{}}
    for name, tensor in weights:
        owner, _, last = name.rpartition(".")
        owner, _, part = owner.rpartition(".")
        if last != "weight" or part not in {sources}:
            yield name, tensor
            continue
        parts.setdefault(owner, {{}})[part] = tensor
        if len(parts[owner]) == {count}:
            held = parts.pop(owner)
            joined = torch.cat([held[source] for source in {sources}])
            for source, piece in zip({sources}, joined.split(sizes)):
                yield f"{{owner}}.{{source}}.weight", piece
"""


def concatenated_convs(body: list[cst.BaseStatement], mixer) -> list[cst.BaseStatement]:
    """load_weights taking a gated delta net's convolutions that transformers concatenates at
    load (OLMo-hybrid's ``q_conv1d``, ``k_conv1d``, ``v_conv1d``: ``GatedDeltaNetPlan.conv_sources``)
    together, re-split into the q, k and v channels vLLM's conv1d loads as shards 0, 1, 2."""
    sources = f"({_tuple_items(mixer.conv_sources)})"
    helper = _CONCATENATED.format(
        names=", ".join(mixer.conv_sources), attr=mixer.attr, sources=sources, count=len(mixer.conv_sources)
    )
    out = []
    for member in body:
        if isinstance(member, cst.FunctionDef) and member.name.value == "load_weights":
            member = member.visit(WrapWeights("_concatenated_convs"))
            out.append(t.stmt(helper).with_changes(leading_lines=member.leading_lines))
        out.append(member)
    return out
