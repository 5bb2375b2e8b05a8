"""The other mixers a hybrid model's layers may hold, one row each: the analysis proving a
block one of vLLM's own state-caching layers, and the refusal saying a block is not of that
kind at all (so that another kind's more specific reason is the one given). A new mixer is
one row here, its plan in mixer_plans.py and its row in passes/hybrid_mixer.py."""

from __future__ import annotations

import ast
import dataclasses

from torch import nn

from hfrewrite.analyze.branches import config_branches, config_form, method_tree
from hfrewrite.analyze.gated_delta_net import NOT_A_GDN, analyze_gated_delta_net
from hfrewrite.analyze.lightning_attention import NOT_LIGHTNING, analyze_lightning
from hfrewrite.analyze.mamba1 import NOT_A_MAMBA1, analyze_mamba1
from hfrewrite.analyze.mamba2 import NOT_A_MAMBA2, analyze_mamba2
from hfrewrite.analyze.mixer_plans import MixerPlan
from hfrewrite.analyze.plan import NoMatch, Refusal
from hfrewrite.analyze.short_conv import NOT_A_CONV, analyze_short_conv

ROWS = (
    (analyze_short_conv, NOT_A_CONV),
    (analyze_mamba2, NOT_A_MAMBA2),
    (analyze_mamba1, NOT_A_MAMBA1),
    (analyze_gated_delta_net, NOT_A_GDN),
    (analyze_lightning, NOT_LIGHTNING),
)
# the kinds whose proof needs the layer's index in the stack (its decay rates depend on it)
_BY_INDEX = {analyze_lightning}


def analyze_mixer(
    layer: nn.Module, attr: str, config, layer_idx: int | None = None
) -> MixerPlan | NoMatch | None:
    """The plan of the first kind ``layer.<attr>`` (the layer at ``layer_idx`` of the stack)
    proves to be; else the refusal of a kind it has the parts of (None: it is of no kind here)."""
    specific = None
    for analyze, not_this_kind in ROWS:
        plan = (
            analyze(layer, attr, config, layer_idx) if analyze in _BY_INDEX else analyze(layer, attr, config)
        )
        if not isinstance(plan, NoMatch):
            return plan
        if plan.reason != not_this_kind:
            specific = specific or plan
    return specific


def mixer_child(layer: nn.Module, config) -> str:
    """The one direct child of ``layer`` proven a mixer of some kind ("" when none is); a
    child with the parts of a kind that fails its proof refuses with that kind's reason."""
    return proven_mixer(layer, config)[0]


def proven_mixer(layer: nn.Module, config, layer_idx: int | None = None) -> tuple[str, MixerPlan | None]:
    """``mixer_child`` and its plan (None where there is none)."""
    plans = {
        name: analyze_mixer(layer, name, config, layer_idx)
        for name, child in layer.named_children()
        if any(True for _ in child.parameters())
    }
    found = [name for name, plan in plans.items() if plan is not None and not isinstance(plan, NoMatch)]
    if len(found) == 1:
        return found[0], plans[found[0]]
    failed = [plan for plan in plans.values() if isinstance(plan, NoMatch)]
    if not found and failed:
        raise Refusal(failed[0])
    return "", None


def with_layer_test(plan: MixerPlan, layers: list[nn.Module], attention: list[bool], block: str) -> MixerPlan:
    """``plan`` with the decoder layer's own test choosing its mixer: an ``if`` of its forward
    calling ``self.<block>`` (the attention) on one side and the mixer on the other, whose
    test, evaluated on each traced layer, is true exactly where that layer has attention."""
    cls = type(layers[0])
    tree = method_tree(cls, "forward")
    found = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.If):
            body, orelse = _self_calls(node.body), _self_calls(node.orelse)
            if (
                {block, plan.attr} <= body | orelse
                and not {block, plan.attr} <= body
                and not {block, plan.attr} <= orelse
            ):
                found.append((node.test, block in body))
    if len(found) != 1:
        raise Refusal(
            NoMatch(
                "hybrid_layer", cls.__name__, f"no one test of its forward chooses {block} or {plan.attr}"
            )
        )
    test, attention_when = found[0]
    code = compile(ast.Expression(test), "<test>", "eval")
    for layer, has_attention in zip(layers, attention):
        try:
            chosen = bool(eval(code, {}, {"self": layer})) == attention_when  # the source's own test
        except Exception:  # noqa: BLE001 - a test on more than the layer
            chosen = None
        if chosen is not has_attention:
            raise Refusal(
                NoMatch(
                    "hybrid_layer",
                    cls.__name__,
                    f"`{ast.unparse(test)}` does not tell its attention layers apart",
                )
            )
    return dataclasses.replace(plan, layer_test=ast.unparse(test), attention_when=attention_when)


def _never_choosing(plan: MixerPlan, layers: list[nn.Module]) -> MixerPlan:
    """``plan`` of an attention-free model's layers. Where the forward chooses the mixer per
    layer (Bamba's ``self.block_type == "linear_attention"``, no attention layer in this
    config), the test must be a config switch that holds on every traced layer: the file then
    calls the mixer alone and refuses the configs that fail it (config_guards), never running
    a block no traced layer ran. Any other test refuses."""
    cls = type(layers[0])
    tree, form = method_tree(cls, "forward"), config_form(cls)
    branches = [config_branches(layer) for layer in layers]  # each layer's (test, value)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.If) and (plan.attr in _self_calls(node.body)) != (
            plan.attr in _self_calls(node.orelse)
        ):
            test = ast.unparse(node.test)
            values = {v for found in branches for t, v in found if t == test}
            if form(test) is None or len(values) != 1:
                what = (
                    "on more than the config" if form(test) is None else "differing between the traced layers"
                )
                why = (
                    f"no traced layer attends, and `{test}` chooses self.{plan.attr} per layer, "
                    f"a test {what}: convert a config whose layers include attention"
                )
                raise Refusal(NoMatch("hybrid_layer", cls.__name__, why))
    return plan


def _self_calls(statements: list[ast.stmt]) -> set[str]:
    """The ``self.<attr>(...)`` calls anywhere in ``statements``."""
    return {
        node.func.attr
        for statement in statements
        for node in ast.walk(statement)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }


def layers_mixer(plan: MixerPlan | None, per_layer: list, layers: list[nn.Module], lead: int, types: list):
    """``plan`` (None: no other mixer) with the layer's own test choosing it, proven on the
    traced layers (``per_layer``: their facts, ``lead`` the first with attention), and where
    vLLM computes it in bfloat16 only, the ``layer_types`` entry of the attention layers."""
    if plan is None:
        return None
    has_attention = [facts.attention is not None for facts in per_layer]
    beside = [facts.attention is not None and facts.mixer is not None for facts in per_layer]
    if all(beside):  # attention and the mixer in every layer (Falcon-H1): no test chooses
        return plan
    if per_layer[lead].decoder.one_block:  # its kind is its class (block_kinds.py): no test
        return plan
    if len({type(layer) for layer in layers}) > 1:  # the mixer's layers' own class (layer_classes.py)
        return plan
    if not any(has_attention):  # attention-free (a Mamba-2 model): nothing to choose from
        return _never_choosing(plan, layers)
    if any(beside):
        raise Refusal(
            NoMatch(
                "hybrid_layer", plan.module_class, "some layers hold the mixer beside attention, others not"
            )
        )
    if per_layer[lead].decoder.attention_block == plan.attr:  # one child, attention or the mixer by layer
        return by_class(plan, layers, has_attention, lead)
    plan = with_layer_test(plan, layers, has_attention, per_layer[lead].decoder.attention_block)
    if plan.vllm_dtype != "float32":  # validated in float32 with attention in every layer
        plan = dataclasses.replace(plan, attention_layer_type=attention_layer_type(types, has_attention))
    return plan


def by_class(plan: MixerPlan, layers: list[nn.Module], has_attention: list[bool], lead: int) -> MixerPlan:
    """``plan`` where one child of the layer holds the attention in some layers and the mixer
    in the others (MiniMax's ``self_attn``, built by a test in ``__init__``): the layer's
    forward chooses by the child's class, the attention layers' on every traced layer."""
    attention = type(layers[lead].get_submodule(plan.attr))
    for layer, attends in zip(layers, has_attention):
        if isinstance(layer.get_submodule(plan.attr), attention) is not attends:
            why = (
                f"self.{plan.attr} is a {attention.__name__} in a layer without attention, or not in one with"
            )
            raise Refusal(NoMatch("hybrid_layer", type(layer).__name__, why))
    test = f"isinstance(self.{plan.attr}, {attention.__name__})"
    return dataclasses.replace(plan, layer_test=test, attention_when=True)


def attention_layer_type(types: list, has_attention: list[bool]) -> str:
    """The one entry of the config's ``layer_types`` that the traced layers with attention
    have and the others have not ("" where there is no such entry)."""
    kinds = {kind for kind, attends in zip(types, has_attention) if attends}
    others = {kind for kind, attends in zip(types, has_attention) if not attends}
    if len(kinds) != 1 or kinds & others or not isinstance(next(iter(kinds)), str):
        return ""
    return next(iter(kinds))


def layer_mixer(traced, decoder, attention, small, proven, layer_idx: int | None = None) -> tuple:
    """(attention, None) for a layer whose mixer is attention, or (attention, plan) with a
    mixer beside it (Falcon-H1); (None, plan) for a hybrid model's layer whose mixer is a
    proven one; else the refusal of the two that says why (the attention's, unless the block
    is a mixer). ``proven``: the carried layer's mixer child, already analysed."""
    if not isinstance(attention, NoMatch):
        return attention, proven if decoder.mixer_block else None
    block = decoder.attention_block
    mixer = proven if proven is not None and proven.attr == block else None
    mixer = mixer or (analyze_mixer(traced.module, block, small, layer_idx) if block else None)
    if mixer is not None and not isinstance(mixer, NoMatch):
        return None, mixer
    raise Refusal(mixer or attention)
