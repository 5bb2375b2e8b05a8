"""The frozen facts that analysis hands to the rewrite passes.

Analysis (torch.fx) fills these in; passes only read them. Attribute names (``q_proj``,
``input_layernorm``...) are the names in the Hugging Face modeling source; sizes are those
of the (shrunken) config that was traced and serve as evidence, not as constants to emit:
the emitted file keeps the source's own expressions so it is right for every config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NoReturn

from hfrewrite.analyze.attention_calls import AttentionCall
from hfrewrite.analyze.mixer_plans import (  # noqa: F401 - re-exported
    GatedDeltaNetPlan,
    LightningPlan,
    Mamba1Plan,
    Mamba2Plan,
    MixerPlan,
    ShortConvPlan,
)
from hfrewrite.analyze.mla_cache import MlaCache
from hfrewrite.analyze.mlp_forms import KeptMlp, MlpForm
from hfrewrite.analyze.moe_plan import MoePlan
from hfrewrite.analyze.norm_kinds import NormKind, QkNormOrder
from hfrewrite.analyze.output_gates import OutputGate
from hfrewrite.analyze.qkv_layouts import QkvLayout
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle, RopeTurn


@dataclass(frozen=True)
class NoMatch:
    """A pattern that did not match, and why. Never ``None``: ``--explain`` prints these.

    The one non-match of analysis: returned as a value, or raised in a :class:`Refusal`
    where a check deep in an analysis has to unwind it."""

    pattern: str  # e.g. "fuse_qkv"; "" when analysis stopped before any pattern (no model built)
    module_class: str  # e.g. "LlamaAttention"; "" when no module is at hand
    reason: str
    topic: str = field(default="", compare=False)  # what was refused, for a caller to tell: "rope"

    def __str__(self) -> str:
        return ": ".join(part for part in (self.module_class, self.pattern, self.reason) if part)


class Refusal(Exception):
    """Unwinds an analysis with the :class:`NoMatch` that stopped it: the pattern
    analyses return it (:meth:`at`), ``analyze`` reports it with the model type."""

    def __init__(self, no_match: NoMatch) -> None:
        super().__init__(no_match)  # str(): the NoMatch's; pickles back to a Refusal
        self.no_match = no_match

    def at(self, module_class: str) -> NoMatch:
        """The NoMatch, naming ``module_class`` when the check that raised it had none."""
        no_match = self.no_match
        return no_match if no_match.module_class else replace(no_match, module_class=module_class)


def refuse(pattern: str, reason: str, module_class: str = "") -> NoReturn:
    """Raise ``NoMatch(pattern, module_class, reason)``; a check that does not know the
    module leaves ``module_class`` to the analysis that catches it (:meth:`Refusal.at`)."""
    raise Refusal(NoMatch(pattern, module_class, reason))


@dataclass(frozen=True)
class LinearFact:
    attr: str
    in_features: int
    out_features: int
    bias: bool


@dataclass(frozen=True)
class AttentionPlan:
    module_class: str
    q: LinearFact
    k: LinearFact
    v: LinearFact
    o: LinearFact
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Per-head norms applied to q/k after the projection and before rope (qwen3), else None.
    q_norm: str | None
    k_norm: str | None
    rope_layers: RopeLayers  # the layers whose q and k a rotary embedding turns
    scaling: float
    sliding_window: int | None
    attention_chunk: int | None = None  # Llama-4's chunked layers (analyze/chunked_layers.py)
    # What the q/k norms normalise over: "head" (each head_dim slice alike, qwen3), "each_head"
    # (weights per head, StableLM-2) or "all_heads" (olmoe); None without q/k norms.
    qk_norm_over: str | None = None
    # The rope the numeric replay proved (analyze/rope.py): its style (analyze/rope_styles.py:
    # neox halves or GPT-J even/odd pairs), over the first ``rotary_dim`` lanes of each head.
    rope_style: RopeStyle = RopeStyle.NEOX
    rotary_dim: int | None = None
    # ... turning by theta, or by -theta (nanochat): vLLM's rotary embedding, sin negated
    rope_turn: RopeTurn = RopeTurn.FORWARD
    logit_softcap: float | None = None  # tanh soft cap of the attention scores
    # rope_parameters are given per layer type: get_rope reads the layer's entry
    rope_per_layer_type: bool = False
    rope_base_field: str | None = None  # each layer's base: its entry of this per-layer list
    # How one checkpoint tensor holds q, k and v (analyze/qkv_layouts.py): phi3's [q; k; v]
    # qkv_proj (q, k and v then name it), gpt_neox's per head, InternLM2's grouped per kv
    # head, or k and v beside q's own projection (TeleChat's key_value). None: three Linears
    qkv_layout: QkvLayout | None = None
    # The source lines where the forward takes q's, k's and v's own lanes of the fused
    # output (by layout alone, proven on the values): the rewrite binds vLLM's q, k, v there
    qkv_unpack_lines: tuple[str, ...] = ()
    # the forward's source line scaling q per token by a factor of the positions alone, after
    # the rope (ministral3; Llama-4 with the factor's expression: analyze/position_scale.py)
    q_position_scale: tuple[str, ...] | None = None
    # the source's expression q is multiplied by right after its projection, the attention
    # then run at its own scale times it (OPT's self.scaling; analyze/q_prescale.py)
    q_prescale: str | None = None
    # (role, the source's expression) for k or v multiplied by a config number on its path:
    # k's folded into the scale, v's multiplied after the split (analyze/path_scale.py)
    path_scales: tuple[tuple[str, str], ...] = ()
    # v's head size where narrower than q's and k's (MiMo-V2-Flash): padded for vLLM's attention
    v_head_dim: int | None = None
    # the config field holding the rotated width in lanes (GPT-J's rotary_dim), when the
    # replay proved that width: the file passes its share of the head to get_rope
    rotary_dim_field: str | None = None
    # the forward's source lines where the trace recorded nodes (analyze/traced_lines.py)
    traced_lines: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # Whether the q/k norms precede the rotary embedding (qwen3) or follow it (hunyuan), and
    # whether some layers have none (Llama-4's NoPE layers: the source's test is kept)
    qk_norm_order: QkNormOrder = QkNormOrder.BEFORE_ROPE
    qk_norm_layers_some: bool = False
    # Calls in the forward (functions it calls, methods it calls itself) whose every
    # traced node the plan accounts for: the proven rope, layout on the q/k/v and output
    # paths, the attention call, GQA expansions: the rewrite may drop them
    replaced_calls: tuple[str, ...] = ()
    # How the source calls its attention (analyze/attention_calls.py)
    attention_call: AttentionCall = AttentionCall.INTERFACE
    # A hand-written attention selecting its scores by a boolean buffer of its module proven a
    # causal band (GPT-Neo's `bias`): each layer's window is read off it (analyze/mask_window.py)
    window_mask: str | None = None
    heads_field: str | None = None  # config fields holding the head counts (found by value)
    kv_heads_field: str | None = None
    # else __init__'s own expression of the config (Falcon-7B; analyze/head_counts.py)
    heads_expr: str | None = None
    kv_heads_expr: str | None = None
    # The attention module's parameter of per-head sink logits (gpt_oss's `sinks`, passed
    # to the attention interface as s_aux), handed to vLLM's Attention(sinks=...)
    sinks: str | None = None
    # ALiBi instead of rope (analyze/alibi.py): the expression of the factor on the standard
    # slopes ("1.0", or the scale where the bias is added before scaling); None without
    alibi: str | None = None
    # A config without rope_parameters (written for transformers 4.x): (rope_parameters key,
    # config field) of the rope the replay proved, emitted as get_rope's parameters
    rope_fields: tuple[tuple[str, str], ...] = ()
    # The config field holding the longest position the rope table must cover
    max_position_field: str = "max_position_embeddings"
    # A base no config field holds: the source's rotary module whose table the file reads it
    # off at load (analyze/rope_table.py), else None
    rope_table: RopeTable | None = None
    # The block returns its output projection plus a tensor it is given (BLOOM, TeleChat)
    adds_residual: bool = False
    # parameters of its own the block returns beside its output, for the layer to read
    # (GPT-NeoX-Japanese's dense_bias, which its layer adds): the carried layer reads them off it
    returned_parameters: tuple[str, ...] = ()
    # the attention output times act(gate(x)) before its projection (analyze/output_gate.py)
    output_gate: OutputGate | None = None
    # the attention's norm module over the whole output [heads * head_dim] before its
    # projection (BitNet's attn_sub_norm; analyze/output_norm.py): kept, the heads gathered
    output_norm: str | None = None


@dataclass(frozen=True)
class RopeTable:
    """The attention's child module whose rope table the file reads the base off at load,
    and its call as the file writes it."""

    child: str  # the attention's attribute (``rotary_emb``)
    call: str  # its arguments, ``n`` the length: ``torch.zeros(n, 1, 1), dtype=torch.float32``


@dataclass(frozen=True)
class MlaPlan:
    """Multi-head latent attention (deepseek_v2/v3): q from a low-rank ``q_a -> norm -> q_b``
    (or one ``q`` projection), a joint latent ``kv_a`` split into the compressed kv (normed,
    expanded by ``kv_b`` into per-head k_nope and v) and one shared rope key; attention over
    ``[q_nope, rope(q_pe)]`` and ``[k_nope, rope(k_pe)]``; ``o`` after it. Proven by replaying
    that computation against the traced module. Sizes are attributes of the attention
    module (found by value): ``dims`` maps each MLA size to the attribute holding it."""

    module_class: str
    q_a: str | None  # low-rank query: q_a -> q_a_norm -> q_b; else one q projection
    q_a_norm: str | None
    q_b: str  # the projection producing the per-head queries (q_b_proj, or q_proj)
    kv_a: str
    kv_a_norm: str
    kv_b: str
    o: str
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    q_lora_rank: int | None
    scaling: float
    rope_style: RopeStyle
    # The rope type proven ("default", or "deepseek_yarn": vLLM's YaRN with the ratio of the
    # mscale factors, which is what transformers computes for a "yarn" config)
    rope_kind: str = "default"
    # (size, attribute of the attention module holding it), e.g. (("kv_lora_rank", "kv_lora_rank"),)
    dims: tuple[tuple[str, str], ...] = ()
    # Attributes the traced module holds as None (branches of the source's __init__ not
    # taken, e.g. ``q_proj`` beside a low-rank query): the file refuses configs that set them
    none_attrs: tuple[str, ...] = ()
    # Config switches of the source's forward and their traced values (analyze/branches.py),
    # e.g. (("self.config.rope_interleave", True),): the file refuses configs that flip them
    config_branches: tuple[tuple[str, bool], ...] = ()
    # Rope kinds proven (the traced config's first; analyze/mla_variants.py adds the other)
    rope_kinds: tuple[str, ...] = ()
    # Both queries proven (analyze/mla_variants.py): the single q projection of the other
    # branch, and the forward's config test choosing the low-rank one with its value then
    q_other: str | None = None
    q_switch: tuple[str, bool] | None = None
    # Attention written out by hand (no attention_interface call to read ``scaling=`` from):
    # the attention module's attribute holding the proven scale (DeepSeek's softmax_scale)
    scale_attr: str | None = None
    # Config switches of the helpers ``__init__`` calls (``self._init_rope()``), which the
    # rewrite drops with what they build: the file refuses configs flipping them
    init_branches: tuple[tuple[str, bool], ...] = ()
    # Where the config keeps the rope's parameters: transformers 5's rope_parameters, or a
    # 4.x config's rope_scaling (its rope type under "type"; the base beside it)
    rope_source: str = "rope_parameters"
    kv_cache: MlaCache = MlaCache.LATENT  # the cache vLLM gives the type (analyze/mla_cache.py)

    def dim(self, name: str) -> str:
        return dict(self.dims)[name]


@dataclass(frozen=True)
class MlpPlan:
    module_class: str
    gate: LinearFact | None  # None: an ungated ``down(act(up(x)))``
    up: LinearFact
    down: LinearFact
    act_attr: str  # attribute holding the activation, e.g. "act_fn"; "": torch's function, called inline
    activation: str  # gated: the config's activation name, e.g. "silu"; else its class
    # The checkpoint holds one [gate; up] projection (phi3, glm): gate and up name it
    fused_gate_up: bool = False
    form: MlpForm = MlpForm.AND_MUL  # analyze/mlp_forms.py: how the file shards it
    init_switches: tuple[tuple[str, bool], ...] = ()  # its __init__'s, on config alone: traced branch built
    # a norm over the whole intermediate between the product and down (BitNet's ffn_sub_norm):
    # kept, the ranks' columns gathered before it (analyze/mlp.py's _inner_norm)
    inner_norm: str | None = None

    def __post_init__(self) -> None:
        if (self.gate is None) != (self.form is MlpForm.UNGATED):
            raise ValueError(f"{self.module_class}: an MLP has no gate exactly when its form is UNGATED")


@dataclass(frozen=True)
class NormPlan:
    module_class: str  # e.g. "LlamaRMSNorm"
    kind: NormKind  # the row of analyze/norm_kinds.py the replay proved (and vLLM's class)
    eps: float
    # A class built from the config alone (ERNIE-4.5's `Norm(config)`): the config fields
    # holding its size and eps, found by value; `Norm(c)` becomes `RMSNorm(c.size, eps=c.eps)`
    config_fields: tuple[str, str] | None = None


@dataclass(frozen=True)
class ResidualBlock:
    """``hidden = residual + post_norm(block(norm(hidden)))`` inside a decoder layer."""

    norm: str  # e.g. "input_layernorm"
    block: str  # e.g. "self_attn"
    post_norm: str | None = None  # sandwich norms (gemma2/3): applied to the block's output


@dataclass(frozen=True)
class BlockKinds:
    """A layer of one block whose kind each layer chooses (analyze/block_kinds.py)."""

    attr: str  # the layer's block, e.g. "mixer"
    attention_class: str  # the class of the block in the layers that attend ("": none do)
    table: str = ""  # the modeling module's dict the block's class is read from ("": none)
    key: str = ""  # the expression of the layer indexing it, e.g. "self.block_type"
    # (key, class) of the traced layers, in the table's order
    kinds: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class DecoderLayerPlan:
    """A decoder layer: its attention and MLP submodules, and, when the layer is a
    sequence of pre-norm residual blocks whose norms vLLM fuses with the residual add,
    those blocks. Without blocks the layer's forward is carried from the source
    (post/sandwich norms, parallel blocks, multipliers...)."""

    module_class: str
    blocks: tuple[ResidualBlock, ...]  # in execution order; () = carried from the source
    attention_block: str = "self_attn"
    mlp_block: str = "mlp"  # "": the MLP is written into the layer, its linears are:
    mlp_linears: tuple[str, ...] = ()  # the layer's own up and down Linears (OPT's fc1, fc2)
    # a dense MLP beside a MoE mlp_block, summed with it by the carried forward (Granite-4.0-H)
    shared_mlp_block: str = ""
    # The attention submodule returns a tuple (Hugging Face: output, weights); custom code
    # often returns the output tensor alone
    attention_returns_tuple: bool = True
    attention_returns_list: bool = False  # that tuple is a list (GPT-1's `[a] + ...`)
    # Classes of the modules a carried layer reaches its attention through (dbrx's
    # DbrxNormAttentionNorm: norms around it), outermost first; each forward is carried too
    attention_wrappers: tuple[str, ...] = ()
    # The layer's forward returns a tuple whose first element is the hidden states
    # (transformers 4.x: ``(hidden_states, present, attentions)``)
    returns_tuple: bool = False
    # Parameters of the carried forward with literal defaults that vLLM may leave at them:
    # not passed by the model, or proven not to change the hidden states (layer_defaults.py)
    free_defaults: tuple[str, ...] = ()
    # a hybrid's other mixer beside the attention in the same layer (Falcon-H1's Mamba-2;
    # ModelPlan.mixer), the carried forward calling both ("": none)
    mixer_block: str = ""
    # a layer of one block (attention, another mixer or an MLP by layer: NemotronH's)
    block_kinds: BlockKinds | None = None

    @property
    def fused(self) -> bool:
        return bool(self.blocks)

    @property
    def one_block(self) -> bool:
        """A layer of one block whose kind each layer chooses (analyze/block_kinds.py)."""
        return len(self.blocks) == 1 and self.attention_block == self.mlp_block


@dataclass(frozen=True)
class PositionEmbeddingPlan:
    """A position table added to the token embeddings (analyze/position_embedding.py, position_table.py)."""

    attr: str  # the base model's child holding the table (``wpe``; "": the base model, CTRL)
    offset: int  # the row of position 0 (OPT and BioGPT keep two in front)
    module_call: bool  # an ``nn.Embedding`` at offset 0: called as a module on the positions
    # the table: the module's weight, or the buffer its __init__ builds (XGLM's sinusoids)
    table: str = "weight"
    token_scale: str | None = None  # the source's factor on the tokens' rows (CTRL's sqrt(d))


@dataclass(frozen=True)
class CompositePlan:
    """Where a multimodal checkpoint keeps the text model the file converts (analyze/composite.py)."""

    architecture: str  # the checkpoint's class, e.g. "Llama4ForConditionalGeneration"
    # checkpoint name prefix -> the text causal LM's ("model.", "lm_head."), or None: not loaded
    prefixes: tuple[tuple[str, str | None], ...]
    # the multimodal config's own tie_word_embeddings ties the lm_head, not the text config's
    tie_from_composite: bool = False


@dataclass(frozen=True)
class ModelPlan:
    model_type: str
    architecture: str  # the top-level class, e.g. "LlamaForCausalLM"
    base_model_class: str  # e.g. "LlamaModel"
    base_model_attr: str  # attribute of the CausalLM holding the base model, e.g. "model"
    embed_tokens: str
    layers: str
    final_norm: str  # "": none, the lm_head reads the last layer's output (GPT-1)
    lm_head: str
    tie_word_embeddings: bool
    decoder_layer: DecoderLayerPlan
    attention: AttentionPlan | MlaPlan
    mlp: MlpPlan | None  # the dense MLP class (dense layers, shared experts), if any
    norm: NormPlan | None  # None: the source's norm classes are kept
    declined: tuple[NoMatch, ...] = field(default=())
    moe: MoePlan | None = None  # the sparse MoE block, if any layer has one
    kept_mlps: tuple[KeptMlp, ...] = ()  # dense MLP classes kept from the source, Linears replicated
    # An nn.Embedding subclass proven to compute a scaled lookup (gemma): carried from
    # the source onto VocabParallelEmbedding. None for plain nn.Embedding.
    embed_class: str | None = None
    # The causal LM changes the lm_head output (final-logit softcap, logit scale): the
    # source's statements after the lm_head are carried into compute_logits.
    logits_postprocessed: bool = False
    # That post-processing is a tanh soft cap by this config field (analyze/logit_softcap.py):
    # vLLM's ``LogitsProcessor(soft_cap=config.<field>)`` instead of the carried statements.
    logit_soft_cap: str | None = None
    # The base model changes the embeddings before the first layer (a multiplier, a norm):
    # the source's statements between the embedding and the layer loop are carried.
    embeddings_transformed: bool = False
    # Hub checkpoint name prefix -> module name prefix (transformers' own load-time renames)
    checkpoint_prefix_renames: tuple[tuple[str, str], ...] = ()
    # ... and substrings (OLMo-hybrid's ``attention_layer_norm`` -> ``input_layernorm``), those
    # a MoE plan does not already hold; not the prefix renames above
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # the causal LM's children holding parameters (analyze/checkpoint.py): a checkpoint tensor
    # under none of them was saved from the base model alone, and gets the base model's prefix
    checkpoint_roots: tuple[str, ...] = ()
    # transformers' plain unexpected-key names (GPT-2's old ``attn.bias`` buffers): ignored
    checkpoint_unexpected: tuple[str, ...] = ()
    # ... and prefixes (``^mtp.*``: layers the causal LM does not build): skipped at load
    checkpoint_skipped: tuple[str, ...] = ()
    # How the lm_head computes its logits (analyze/lm_head.py): "" nn.Linear, or a kind of its
    # own ("l2_normalized": Baichuan2's NormHead; "embedding": no head module, OpenELM's)
    lm_head_weight: str = ""
    # The lm_head reads the final norm's output times a constant (MiniCPM's division by
    # hidden_size / dim_model_base): the source's argument expression is carried into compute_logits
    head_input_scaled: bool = False
    # the config's count of MTP layers after the decoder (DeepSeek-V3): load_weights skips them
    mtp_layers_field: str | None = None
    # (name, expression of self): sizes vLLM reads that the config holds otherwise (vllm_sizes.py)
    vllm_sizes: tuple[tuple[str, str], ...] = ()
    config_class: str = ""  # the HF configuration class (``Qwen3Config``): vLLM's ``hf_config``
    # (description, config) of the sibling configs whose branches the analysis proved beside
    # the traced one (analyze/mla_variants.py): validation runs the file on each of them too
    sibling_configs: tuple[tuple[str, object], ...] = field(default=(), compare=False, repr=False)
    # (class, config test, traced value) of each config switch in the forward of a class the
    # file keeps or replaces (causal LM, base model, decoder layer, attention, MLP, MoE block),
    # in the form ``__init__`` evaluates (analyze/branches.py): passes/config_guards.py
    # refuses configs flipping those the emitted class no longer tests
    forward_switches: tuple[tuple[str, str, bool], ...] = ()
    # ... of the methods those forwards call (Falcon's _split_heads): a test only __init__
    # still makes (a size) does not show that the emitted forward takes the other branch
    helper_switches: tuple[tuple[str, str, bool], ...] = ()
    # (class, config test) of those switches its ``__init__`` tests: an ``if`` the file's
    # ``__init__`` still makes carries them; the forward's own need a test in a method
    init_switches_tested: tuple[tuple[str, str], ...] = ()
    # The source's nn.Linear subclasses proven to compute nn.Linear's function and built with
    # its constructor (analyze/linear_classes.py: Falcon-RW's ``Linear``): built as nn.Linear
    linear_classes: tuple[str, ...] = ()
    # The module whose weight the lm_head shares when the config ties them, found by identity
    # on a model built tied (analyze/tied_head.py); None: the source never ties them
    head_tied_to: str | None = None
    # A multimodal checkpoint's text model: the file reads its text config and loads it alone
    composite: CompositePlan | None = None
    # Classes proven to compute ``x @ weight + bias`` with an ``[in, out]`` weight and built as
    # ``Cls(out, in)`` (GPT-2's Conv1D, analyze/transposed_linears.py): built as ``nn.Linear(in, out)``
    transposed_linear_classes: tuple[str, ...] = ()
    # their modules' paths inside a decoder layer (``attn.c_attn``): weights transposed when loaded
    transposed_linears: tuple[str, ...] = ()
    # A learned absolute position table whose rows the base model adds to the tokens' embeddings
    position_embedding: PositionEmbeddingPlan | None = None
    # Switches of the base model's __init__ on its config alone ((test, traced value): OPT's
    # final norm and word-embedding projections): the traced branch is built, others refused
    base_init_switches: tuple[tuple[str, bool], ...] = ()
    head_init_switches: tuple[tuple[str, bool], ...] = ()  # ... of the causal LM's (an EMBEDDING head)
    # The child of the HF base model that holds the stack, when the base model only wraps it
    # (OPT's "decoder"): the file builds that child as the base model; names are mapped
    base_model_inner: str = ""
    # (attribute, class) of the base model's children holding its parts where they sit deeper
    # (ChatGLM3's embedding and encoder; analyze/flat_layout.py): built flat in the base model
    flat_holders: tuple[tuple[str, str], ...] = ()
    # the class of the lm_head built inside the base model's __init__ (ChatGLM3's output_layer: "Linear")
    flat_head: str = ""
    # A hybrid model's other layers' mixer (LFM2's short convolutions, Bamba's Mamba-2)
    mixer: MixerPlan | None = None
    # ... and those layers' own class, where it is not ``decoder_layer``'s (Jamba's
    # JambaMambaDecoderLayer; analyze/layer_classes.py): rewritten with this plan
    mixer_layer: DecoderLayerPlan | None = None

    @property
    def mixer_shares_child(self) -> bool:
        """Whether one child of the layer holds the attention in some layers and the mixer in
        the others (MiniMax's ``self_attn``, chosen by class): not a layer of one block by kind
        (NemotronH's), nor the mixer's layers of a class of their own (Jamba's)."""
        layer, mixer = self.decoder_layer, self.mixer
        return (
            mixer is not None
            and self.attention is not None  # (an attention-free model's layer holds the mixer alone)
            and self.mixer_layer is None
            and layer.block_kinds is None
            and mixer.attr == layer.attention_block
        )

    @property
    def decoder_layers(self) -> tuple[DecoderLayerPlan, ...]:
        """The decoder-layer classes the file rewrites: the attention layers' first."""
        return (self.decoder_layer,) + ((self.mixer_layer,) if self.mixer_layer else ())
