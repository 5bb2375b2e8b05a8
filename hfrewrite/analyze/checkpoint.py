"""Checkpoint-layout facts from transformers' own load-time conversion table.

Hub checkpoints of MoE models keep one tensor per expert (``experts.N.w1.weight``) and
sometimes other module names (mixtral's ``block_sparse_moe``); transformers 5.x merges and
renames them at load time (``transformers.conversion_mapping``). The generated vLLM file
loads the Hub layout directly, so the same facts are read here: the per-expert names for
(gate, down, up) and plain substring renames.
"""

from __future__ import annotations

import re

try:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
except ImportError:  # transformers 4.x (isolated analyses): it renames nothing at load time

    def get_checkpoint_conversion_mapping(key: str) -> None:
        return None


_EXPERT_NAME = re.compile(r"experts\.\*\.(\w+)\.weight$")


def expert_checkpoint_names(model_type: str) -> tuple[str, str, str] | None:
    """(gate, down, up) per-expert weight names of Hub checkpoints, or None if unknown."""
    gate = up = down = None
    for rule in get_checkpoint_conversion_mapping(model_type) or ():
        targets = " ".join(getattr(rule, "target_patterns", ()) or ())
        names = [
            m.group(1) for p in getattr(rule, "source_patterns", ()) or () if (m := _EXPERT_NAME.search(p))
        ]
        if targets.endswith("gate_up_proj") and len(names) == 2:
            gate, up = names
        elif targets.endswith("down_proj") and len(names) == 1:
            down = names[0]
    return (gate, down, up) if gate and down and up else None


def checkpoint_renames(model_type: str) -> tuple[tuple[str, str], ...]:
    """Plain substring renames (Hub name -> module name), e.g. (".block_sparse_moe.", ".mlp.")."""
    renames = []
    for rule in get_checkpoint_conversion_mapping(model_type) or ():
        if type(rule).__name__ != "WeightRenaming":
            continue
        for source, target in zip(rule.source_patterns, rule.target_patterns):
            source = source.replace("\\.", ".")  # `a\.b` and `.a.` both name the literal text
            if _literal(source) and _literal(target):
                renames.append((source, target))
    return tuple(renames)


def concatenated_sources(model_type: str, target: str) -> tuple[str, ...]:
    """The checkpoint's names of the tensors transformers concatenates along dim 0 into the
    parameter named ``<...>.<target>`` at load (OLMo-hybrid's ``linear_attn.q_conv1d.weight``,
    ``k_conv1d``, ``v_conv1d`` into ``linear_attn.conv1d.weight``), each as the last module
    name (``q_conv1d``), in order; () where no rule does."""
    for rule in get_checkpoint_conversion_mapping(model_type) or ():
        targets = getattr(rule, "target_patterns", None) or ()
        operations = getattr(rule, "operations", None) or ()
        concat = [
            op for op in operations if type(op).__name__ == "Concatenate" and getattr(op, "dim", None) == 0
        ]
        if list(targets) != [target] or len(operations) != 1 or not concat:
            continue
        prefix = target.rpartition(".")[0].rpartition(".")[0]
        names = []
        for source in rule.source_patterns:
            parent, _, last = source.removesuffix(f".{target.rpartition('.')[2]}").rpartition(".")
            if parent != prefix or not re.fullmatch(r"\w+", last):
                return ()
            names.append(last)
        return tuple(names)
    return ()


def _literal(pattern: str) -> bool:
    """A pattern whose only regex metacharacters are dots."""
    return re.escape(pattern).replace("\\.", ".") == pattern


def checkpoint_prefix_renames(key: str) -> tuple[tuple[str, str], ...]:
    """Anchored prefix renames (Hub name -> module name) for a model type or causal-LM
    class name, e.g. gpt_neox's ``("embed_out.", "lm_head.")``; and a rename of one leading
    name unanchored (NemotronH's ``backbone.`` -> ``model.``), applied where a name starts
    with it (a checkpoint naming it deeper loads nothing under it: vLLM stops on the name)."""
    renames = []
    for rule in get_checkpoint_conversion_mapping(key) or ():
        if type(rule).__name__ != "WeightRenaming":
            continue
        for source, target in zip(rule.source_patterns, rule.target_patterns):
            plain = source.removeprefix("^").replace("\\.", ".")
            literal = re.escape(plain).replace("\\.", ".") == plain and _literal(target)
            if literal and (source.startswith("^") or re.fullmatch(r"\w+\.", plain)):
                renames.append((plain, target))
    return tuple(renames)


def unexpected_suffixes(model) -> tuple[str, ...]:
    """The plain names among transformers' ``_keys_to_ignore_on_load_unexpected`` of the
    model's class (GPT-2's ``attn.bias``: the causal-mask buffer its old checkpoints hold):
    load_weights ignores checkpoint tensors ending so when no parameter takes them."""
    patterns = getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or ()
    return tuple(p for p in patterns if isinstance(p, str) and re.fullmatch(r"[\w.]+", p))


def unexpected_prefixes(model) -> tuple[str, ...]:
    """The plain prefixes among transformers' ``_keys_to_ignore_on_load_unexpected`` of the
    model's class (``^mtp.*``: Qwen3-Next's and Qwen3.5's multi-token-prediction layers, which
    the causal LM does not build; NemotronH's unanchored ``mtp.*``, taken where a name starts
    with it): load_weights skips checkpoint tensors named so."""
    patterns = getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or ()
    found = []
    for pattern in patterns:
        plain = pattern.removeprefix("^")[:-2].replace("\\.", ".") if isinstance(pattern, str) else ""
        anchored = pattern.startswith("^") and re.fullmatch(r"\w+(\.\w+)*", plain)
        if pattern.endswith(".*") and (anchored or re.fullmatch(r"\w+", plain)):  # one name: not layers.61
            found.append(plain)
    return tuple(found)


def checkpoint_roots(model) -> tuple[str, ...]:
    """The causal LM's children that hold parameters (``transformer``, ``lm_head``): the
    first name of every tensor of a checkpoint saved from it. A checkpoint saved from the
    base model alone names its tensors without the base model's (transformers adds it)."""
    return tuple(name for name, child in model.named_children() if next(child.parameters(), None) is not None)
