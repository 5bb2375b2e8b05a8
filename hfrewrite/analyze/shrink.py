"""The shrunk copy of a config that analysis traces and validation decodes: every flag,
switch and head layout of the original, at sizes that build and run in a moment."""

from __future__ import annotations

import ast
import copy
import inspect

import transformers

from hfrewrite.analyze.branches import method_tree
from hfrewrite.analyze.trace import ATTN_IMPLEMENTATION

try:  # transformers 5's strict config dataclasses (huggingface_hub's validation)
    from huggingface_hub.errors import StrictDataclassError

    INVALID_FIELD: tuple[type[Exception], ...] = (TypeError, ValueError, StrictDataclassError)
except ImportError:  # the older huggingface_hub of a transformers 4.x analysis
    INVALID_FIELD = (TypeError, ValueError)

HIDDEN, HEADS, INTERMEDIATE, VOCAB = 128, 4, 256, 256
# Other size fields, shrunk when the config has them, so that MoE and linear-attention
# models build quickly and are refused by analysis rather than by memory.
_OTHER_SIZES = {
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    # vLLM's CPU kernel of gated delta nets takes heads of 64 or more (not 32)
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    # dbrx keeps these in its attn_config / ffn_config sub-configs
    "ffn_hidden_size": 64,
    "moe_num_experts": 4,
    "moe_top_k": 2,
}


def shrink_config(
    config: transformers.PretrainedConfig, heads_to: int = HEADS
) -> transformers.PretrainedConfig:
    """A small copy of ``config`` that keeps its flags and head layout, with ``heads_to``
    query heads (the head size stays; analyze/qkv_width.py traces a second count).

    Keeps MQA (one kv head) and MHA (kv heads == heads), an explicit head_dim that is
    not hidden/heads, the biases, the tying, one layer per distinct ``layer_types``
    entry (at least two), and sets the opaque attention implementation.
    """
    small = copy.deepcopy(config)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if hasattr(config, "head_dim") and head_dim is None and heads:
        # Configs that leave head_dim unset (ministral, nemotron, hunyuan defaults):
        # the value the model means is hidden / heads.
        head_dim = config.hidden_size // heads
    explicit = bool(head_dim and heads and head_dim * heads != config.hidden_size)
    hidden = HIDDEN // HEADS * heads_to
    sizes = {"hidden_size": hidden, "intermediate_size": INTERMEDIATE}
    sizes |= {"vocab_size": VOCAB, "num_attention_heads": heads_to, **_OTHER_SIZES}
    # an encoder-decoder family's decoder used alone (Whisper's, PLBart's): its own head count
    sizes |= {"decoder_attention_heads": heads_to, "encoder_attention_heads": heads_to}
    for name, size in sizes.items():
        if isinstance(getattr(small, name, None), int):
            _set(small, name, size)
    for name in same_as_hidden(config, sizes):  # OPT's word_embed_proj_dim: kept equal
        _set(small, name, hidden)
    if hasattr(config, "num_key_value_heads") and config.num_key_value_heads is None:
        _set(small, "num_key_value_heads", heads_to)  # unset means one kv head per head (MHA)
    for field in ("num_key_value_heads", "num_kv_heads"):  # (Falcon's own name)
        if type(kv := getattr(config, field, None)) is int and kv:  # (OpenELM's is a list per layer)
            _set(small, field, 1 if kv == 1 else heads_to if kv == heads else 2)
    if head_dim:
        _set(small, "head_dim", 2 * HIDDEN // HEADS if explicit else HIDDEN // HEADS)
        _shrink_value_heads(config, small, head_dim)
    rotary = getattr(config, "rotary_dim", None)
    if isinstance(rotary, int) and heads:  # an absolute rope width (GPT-J, CodeGen): its share kept
        before = head_dim or config.hidden_size // heads
        after = getattr(small, "head_dim", None) or small.hidden_size // small.num_attention_heads
        _set(small, "rotary_dim", max(2, 2 * round(rotary * after / before / 2)))
    _shrink_layer_kinds(config, small)
    _shrink_kv_sharing(config, small)
    _vary_rope_bases(small)
    _shrink_dense_layers(config, small)
    _shrink_routing(config, small)
    _shrink_windows(small)
    _shrink_rope_factors(small)
    _shrink_mla(config, small)
    _shrink_state_space(config, small)
    _shrink_sub_configs(config, small, sizes, heads_to)
    _shrink_pad(small)
    small = _rebuilt(small)
    small._attn_implementation = ATTN_IMPLEMENTATION
    return small


def _rebuilt(small):
    """The configuration built again from the shrunk values: a class that derives fields in
    its ``__init__`` or ``__post_init__`` (OpenELM's head counts per layer, from ``model_dim``,
    ``head_dim`` and the layer count; Zamba2's ``mamba_headdim`` and ``hybrid_layer_ids``)
    derives them from the shrunk ones, as it will when a checkpoint saved from this config is
    loaded. Only those fields are taken from the new build; every other one stays as shrunk
    (the class's ``model_type`` put on the instance, too); ``small`` itself where that does
    not build."""
    cls = type(small)
    computed = _derived(cls)
    if not computed:
        return small  # nothing derived: as shrunk
    try:  # what the class computes itself (no parameter of its __init__) is left to it
        fresh = cls.from_dict({k: v for k, v in small.to_dict().items() if k not in computed})
    except Exception:  # noqa: BLE001 - a class that cannot take its own dict back: as shrunk
        return small
    for name in sorted(computed):
        if name in vars(fresh):
            _set(small, name, getattr(fresh, name))
    return small


def _derived(cls: type) -> set[str]:
    """The attributes ``cls``'s own methods set (``self.x = ...``) that are no parameter of
    its ``__init__``: what it computes from the others."""
    params = set(inspect.signature(cls.__init__).parameters)
    found = set()
    for name, method in vars(cls).items():
        if not callable(method) or name.startswith("__") and name not in ("__init__", "__post_init__"):
            continue
        tree = method_tree(cls, name)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Assign):
                found |= {
                    t.attr
                    for t in node.targets
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                }
    return found - params


def _shrink_pad(small) -> None:
    """A pad id beyond the shrunk vocabulary: none, or the last id where the field is typed
    int (ModernBERT-decoder's)."""
    pad = getattr(small, "pad_token_id", None)
    if isinstance(pad, int) and pad >= VOCAB:
        try:
            _set(small, "pad_token_id", None)
        except INVALID_FIELD:
            _set(small, "pad_token_id", VOCAB - 1)


def _shrink_layer_kinds(config, small) -> None:
    """Two layers, or one per distinct entry of the per-layer kind lists (attention, MLP),
    each kind kept once, in order; three where a per-layer list holds the rope base
    (_vary_rope_bases: the layer without rope then shares its kind with a layer with one)."""
    kinds = {}
    for field in ("layer_types", "mlp_layer_types"):
        types = getattr(config, field, None)
        if isinstance(types, list) and types:
            kinds[field] = list(dict.fromkeys(types))
    least = 3 if _rope_base_lists(config) else 2
    n = max(least, *map(len, kinds.values())) if kinds else least
    _set(small, "num_hidden_layers", n)
    for field in ("num_layers", "num_transformer_layers"):  # ChatGLM's, OpenELM's own names
        if type(getattr(config, field, None)) is int:
            _set(small, field, n)
    for field, distinct in kinds.items():
        set_layer_kinds(config, small, field, distinct + distinct[-1:] * (n - len(distinct)))
    _shrink_layer_patterns(config, small, n)
    _shrink_layer_periods(config, small, n)


def _shrink_layer_periods(config, small, n: int) -> None:
    """A kind of layer placed every ``<kind>_period`` layers from ``<kind>_offset`` (Jamba's
    attention layers, one in 8) placed every ``n`` layers instead, at offset 0 or 1 as it was
    first or not, so that the shrunk layers hold it and the others both."""
    for name, period in sorted(vars(config).items()):
        stem = name.removesuffix("_period")
        offset = getattr(config, f"{stem}_offset", None)
        if stem == name or type(period) is not int or type(offset) is not int or not 0 <= offset < period:
            continue
        if period > n:
            _set(small, name, n)
            _set(small, f"{stem}_offset", min(offset, 1))


def _shrink_dense_layers(config, small) -> None:
    """MoE models whose config can make some layers dense: one layer of each kind traced."""
    if getattr(config, "num_experts", 0) and hasattr(config, "mlp_only_layers"):
        _set(small, "mlp_only_layers", [0])
        _set(small, "decoder_sparse_step", 1)
    if getattr(config, "num_local_experts", 0) and isinstance(getattr(config, "moe_layers", None), list):
        _set(small, "moe_layers", [1])  # Llama-4's MoE layers by index: one dense layer, then MoE
    if getattr(config, "num_experts", 0) and (getattr(config, "num_dense_layers", 0) or 0) > 0:
        _set(small, "num_dense_layers", 1)  # LFM2-MoE's first dense layers: one, then MoE
    kinds = getattr(config, "mlp_layer_types", None)
    if isinstance(kinds, list) and set(kinds) == {"sparse"} and small.num_hidden_layers >= 2:
        # transformers' per-layer MLP kinds are "dense" or "sparse"; a config of MoE layers
        # only (Mellum's default) traces a dense first layer too
        dense = ["dense"] + ["sparse"] * (small.num_hidden_layers - 1)
        set_layer_kinds(config, small, "mlp_layer_types", dense)


def _shrink_kv_sharing(config, small) -> None:
    """Layers that reuse an earlier layer's keys and values (Gemma-3n's last
    ``num_kv_shared_layers``, each sharing the last unshared layer of its kind): the shrunk
    layers twice, the second time sharing, so that each kind is traced both ways."""
    shared = getattr(config, "num_kv_shared_layers", None)
    if type(shared) is not int or shared <= 0:
        return
    n = small.num_hidden_layers
    extend_layers(config, small, lambda items: items + items)
    _set(small, "num_hidden_layers", 2 * n)
    _set(small, "num_kv_shared_layers", n)


def _rope_base_lists(config) -> list[str]:
    """Per-layer lists holding the config's rope base or 0 at every layer, the base at one
    at least (Granite-SWA's ``layer_rope_theta``: each layer's base, 0 for no rope)."""
    params = getattr(config, "rope_parameters", None)
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    layers = getattr(config, "num_hidden_layers", None)
    if type(theta) not in (int, float) or not theta or type(layers) is not int or layers < 2:
        return []
    return [
        name
        for name, items in sorted(vars(config).items())
        if isinstance(items, list)
        and len(items) == layers
        and all(type(v) in (int, float) and v in (theta, 0) for v in items)
        and theta in items
    ]


def _vary_rope_bases(small) -> None:
    """Each list of _rope_base_lists gets each layer's own base and 0 at the second layer:
    the trace then shows whether a layer's rope reads its own entry, and what 0 does
    (analyze/rope.py proves it)."""
    lists = _rope_base_lists(small)
    for name in lists:
        theta = float(small.rope_parameters["rope_theta"])
        _set(small, name, [0.0 if i == 1 else theta * (i + 2) for i in range(small.num_hidden_layers)])


def extend_layers(config, small, extend) -> None:
    """Each per-layer list of ``small`` (one entry a shrunk layer, cut from a list of
    ``config`` with one entry a layer) replaced by ``extend(list)``: the layer kinds through
    ``set_layer_kinds``, the others (Laguna's head counts) as they are. The caller sets
    ``num_hidden_layers`` to the new length."""
    n, layers = small.num_hidden_layers, getattr(config, "num_hidden_layers", None)
    kinds = ("layer_types", "mlp_layer_types")  # properties in some configs (Bamba's)
    for field in (*kinds, *sorted(set(vars(small)) - set(kinds))):
        items, whole = getattr(small, field, None), getattr(config, field, None)
        if not (isinstance(items, list) and len(items) == n and isinstance(whole, list)):
            continue
        if field in kinds:
            set_layer_kinds(small, small, field, extend(items))
        elif len(whole) == layers:
            _set(small, field, extend(items))


def set_layer_kinds(config, small, field: str, wanted: list) -> None:
    """``small.<field>`` (a per-layer kind list of ``config``) set to ``wanted``; where the
    config computes that list from the indices of one kind's layers (Bamba's
    ``attn_layer_indices``), that index list, found by its values, set to where ``wanted``
    has that kind."""
    if _set(small, field, wanted):
        return
    types = getattr(config, field)
    for name, indices in sorted(vars(config).items()):
        if not (isinstance(indices, list | tuple) and indices and all(type(i) is int for i in indices)):
            continue
        kinds = {types[i] for i in indices if 0 <= i < len(types)}
        if len(kinds) == 1 and [i for i, kind in enumerate(types) if kind in kinds] == list(indices):
            _set(small, name, [i for i, kind in enumerate(wanted) if kind in kinds])
            return


def same_as_hidden(config, sizes: dict) -> list[str]:
    """Other width fields (``*_dim``, ``*_size``) equal to ``hidden_size``: equal in the
    shrunk config too, so that the branches that test their equality are the same."""
    hidden = getattr(config, "hidden_size", None)
    return [
        name
        for name, value in sorted(vars(config).items())
        if name.endswith(("_dim", "_size"))
        and name not in sizes
        and name != "head_dim"
        and isinstance(value, int)
        and not isinstance(value, bool)
        and value == hidden
    ]


def _shrink_routing(config, small) -> None:
    """Routing values the replay can tell apart: every routing step changes the output
    and each constant is a distinct number (analyze/routing.py finds its attribute by
    value). Grouped top-k (deepseek_v3, glm4_moe, dots1): 8 experts in 4 groups, 2 kept,
    top-3; a scaling factor of 2.5; renormalisation on; one dense layer, then MoE."""
    if isinstance(getattr(config, "n_group", None), int):
        for name in ("num_experts", "num_local_experts"):  # exaone_moe's name for them
            if isinstance(getattr(config, name, None), int) and not hasattr(config, "n_routed_experts"):
                _set(small, name, 8)
        for name, size in (
            ("n_routed_experts", 8),
            ("n_group", 4),
            ("topk_group", 2),
            ("num_experts_per_tok", 3),
        ):
            _set(small, name, size)
        if hasattr(config, "n_shared_experts") and config.n_shared_experts is None:
            _set(small, "n_shared_experts", 1)  # a bare type's default config (dots1) leaves it unset
    if hasattr(config, "num_experts_per_tok") and config.num_experts_per_tok is None:
        _set(small, "num_experts_per_tok", 3)  # a bare type's default config (deepseek_v2) leaves it unset
    # routing scales (DeepSeek's routed_scaling_factor, AFMoE's route_scale, Laguna's
    # moe_routed_scaling_factor): a scale of 1 multiplies invisibly
    for name, scale in sorted(vars(config).items()):
        if "rout" in name and "scal" in name and type(scale) in (int, float):
            _set(small, name, 2.5)
    if isinstance(getattr(config, "norm_topk_prob", None), bool):
        _set(small, "norm_topk_prob", True)
    if getattr(config, "moe_num_shared_experts", None) == 0:  # ernie: trace its optional shared expert
        _set(small, "moe_num_shared_experts", 1)
    if isinstance(getattr(config, "first_k_dense_replace", None), int):
        _set(small, "first_k_dense_replace", 1)


def _shrink_layer_patterns(config, small, n: int) -> None:
    """Other per-layer lists cut to ``n`` layers, each kind once (GPT-Neo's ``attention_layers``), and a
    pattern repeated per layer (GPT-Neo's ``attention_types``, ``[[kinds, repeats]]``) repeated
    to ``n`` layers, so that a saved and reloaded shrunk config stays consistent."""
    layers = getattr(config, "num_hidden_layers", None)
    if type(layers) is not int or layers == n:  # (fewer layers than n: extended to n alike)
        return
    for name, items in sorted(vars(config).items()):
        if name in ("layer_types", "mlp_layer_types") or not isinstance(items, list | tuple):
            continue
        distinct = _distinct(items)
        if len(items) == layers and distinct is not None and len(distinct) <= n:
            _set(small, name, distinct + distinct[-1:] * (n - len(distinct)))  # each kind kept once
        elif _repeated(items) == layers and len(items[0][0]) <= n and n % len(items[0][0]) == 0:
            _set(small, name, [[list(items[0][0]), n // len(items[0][0])]])


def _distinct(items) -> list | None:
    """The entries of a per-layer list, each once in order; None for unhashable entries."""
    try:
        return list(dict.fromkeys(items))
    except TypeError:
        return None


def _repeated(items) -> int | None:
    """The layers a ``[[kinds, repeats]]`` pattern of one entry spans, else None."""
    if len(items) != 1 or not isinstance(items[0], list | tuple) or len(items[0]) != 2:
        return None
    kinds, repeats = items[0]
    ok = isinstance(kinds, list | tuple) and isinstance(repeats, int) and kinds
    return len(kinds) * repeats if ok else None


# a local attention window the example run sees (it is 5 tokens long): GPT-Neo's window_size
_WINDOW = 3


def _shrink_windows(small) -> None:
    """Local attention windows (``*window_size``) and chunks (Llama-4's
    ``attention_chunk_size``) narrower than the example run, so that a windowed or chunked
    mask is seen on the values (analyze/mask_window.py, analyze/attention_options.py)."""
    for name, size in sorted(vars(small).items()):
        local = name.endswith(("window_size", "attention_chunk_size"))
        if local and type(size) is int and size > _WINDOW:
            _set(small, name, _WINDOW)


def _shrink_rope_factors(small) -> None:
    """Per-frequency rope factors (longrope's ``short_factor``/``long_factor``: one per
    rotary frequency, 48 in Phi-3.5, 16 in MiniCPM3) fitted to the shrunk head's frequencies,
    evenly sampled so that they still differ from each other."""
    params = getattr(small, "rope_parameters", None)
    if not isinstance(params, dict):
        return
    if params.get("llama_4_scaling_beta"):
        # Llama-4's q scale grows with position // original_max_position_embeddings: a short
        # period makes it differ over the example's positions and the validation's prompts
        # (not shorter: vLLM's YaRN caches original_max_position_embeddings * factor positions)
        params["original_max_position_embeddings"] = 4
    head_dim = getattr(small, "head_dim", None) or small.hidden_size // small.num_attention_heads
    rotary = int(head_dim * params.get("partial_rotary_factor", getattr(small, "partial_rotary_factor", 1.0)))
    n = rotary // 2
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if isinstance(factors, list) and len(factors) != n and n > 1:  # fewer: some repeat
            params[key] = [factors[round(i * (len(factors) - 1) / (n - 1))] for i in range(n)]


def _shrink_sub_configs(config, small, sizes: dict, heads_to: int) -> None:
    """Sizes a model reads from its sub-configs (dbrx's ``attn_config``/``ffn_config``):
    the same sizes, and kv heads (``kv_n_heads``) by the rule above."""
    heads = getattr(config, "num_attention_heads", None)
    for name in getattr(config, "sub_configs", None) or {}:
        sub, small_sub = getattr(config, name, None), getattr(small, name, None)
        if not isinstance(small_sub, transformers.PretrainedConfig):
            continue
        for field, size in sizes.items():
            if isinstance(getattr(small_sub, field, None), int):
                _set(small_sub, field, size)
        kv = getattr(sub, "kv_n_heads", None)
        if isinstance(kv, int):
            _set(small_sub, "kv_n_heads", 1 if kv == 1 else heads_to if kv == heads else 2)


def _shrink_value_heads(config, small, head_dim: int) -> None:
    """A value head size of its own beside ``head_dim`` (MiMo-V2-Flash's ``v_head_dim``, MLA
    aside): kept equal, half as wide or twice, as the config has it."""
    v_head_dim = getattr(config, "v_head_dim", None)
    if type(v_head_dim) is not int or isinstance(getattr(config, "kv_lora_rank", None), int):
        return
    ratio = 1 if v_head_dim == head_dim else 0.5 if v_head_dim < head_dim else 2
    _set(small, "v_head_dim", int(small.head_dim * ratio))


def _shrink_mla(config, small) -> None:
    """MLA sizes (deepseek_v2/v3) that differ from each other and from every other size,
    so analysis/mla.py finds each one's attribute by value; a low-rank query stays
    low-rank. The rope width is also the config's head_dim (transformers' rotary reads it).
    vLLM's CPU MLA backend caches only 512 + 64 wide latents (DeepSeek's own sizes), and
    the validation runs this config."""
    if not isinstance(getattr(config, "kv_lora_rank", None), int):
        return
    sizes = {
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 48,
        "v_head_dim": 80,
    }
    if getattr(config, "q_lora_rank", None) is not None:
        sizes["q_lora_rank"] = 96
    for name, size in sizes.items():
        _set(small, name, size)
    if hasattr(config, "qk_head_dim"):
        _set(small, "qk_head_dim", sizes["qk_rope_head_dim"] + sizes["qk_nope_head_dim"])
    if hasattr(config, "head_dim"):
        _set(small, "head_dim", sizes["qk_rope_head_dim"])
    if getattr(small, "max_position_embeddings", None) in sizes.values():  # a tiny config's 512
        _set(small, "max_position_embeddings", 4096)


# Mamba-2 mixers (Bamba, Granite-4.0-H): heads, head size and state size, the heads times
# the head size kept equal to the expanded width and a multiple of the groups
_SSM_HEADS, _SSM_STATE = 8, 16


def _shrink_state_space(config, small) -> None:
    """A Mamba-2 mixer's sizes at the shrunk width: ``mamba_n_heads`` heads whose widths add up
    to the expanded width (``mamba_expand * hidden_size``, or Falcon-H1's ``mamba_d_ssm``), a
    16-wide state; Mamba2's own config names them ``num_heads``, ``head_dim``, ``state_size``."""
    names = _MAMBA2_NAMES if _is_mamba2_config(config) else _HYBRID_NAMES
    heads_field, head_field, state_field, expand_field, groups_field = names
    heads, expand = getattr(config, heads_field, None), getattr(config, expand_field, None)
    if not (isinstance(heads, int) and isinstance(expand, int)):
        return
    groups = getattr(config, groups_field, 1) or 1
    heads = _SSM_HEADS if _SSM_HEADS % groups == 0 else 2 * groups
    _set(small, heads_field, heads)
    inner = expand * small.hidden_size
    if isinstance(getattr(config, "mamba_d_ssm", None), int):
        _set(small, "mamba_d_ssm", inner)
    if isinstance(getattr(config, head_field, None), int):
        _set(small, head_field, inner // heads)
    if isinstance(getattr(config, state_field, None), int):
        _set(small, state_field, _SSM_STATE)


# (heads, head size, state size, expansion, groups) of a hybrid's Mamba-2 config (Bamba,
# Granite-4.0-H, Falcon-H1), and of Mamba2's own
_HYBRID_NAMES = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_expand", "mamba_n_groups")
_MAMBA2_NAMES = ("num_heads", "head_dim", "state_size", "expand", "n_groups")


def _is_mamba2_config(config) -> bool:
    """A config of Mamba-2 layers alone (``Mamba2Config``): every one of its size fields."""
    return all(isinstance(getattr(config, name, None), int) for name in _MAMBA2_NAMES) and not hasattr(
        config, "num_attention_heads"
    )


def _set(config, name: str, value) -> bool:
    """Set a config field, unless the config computes it (a read-only property, possibly
    under another name through its ``attribute_map``); whether it was set."""
    name = getattr(config, "attribute_map", {}).get(name, name)
    attr = getattr(type(config), name, None)
    if isinstance(attr, property) and attr.fset is None:
        return False
    try:
        setattr(config, name, value)
    except NotImplementedError:  # a setter refusing the field (ProphetNet's num_hidden_layers)
        return False
    return True
