"""Vocabulary-parallel input embedding and LM head, with weight tying and pipeline stages.

Matches ``self.embed_tokens = nn.Embedding(V, H, ...)`` in the base model and
``self.lm_head = nn.Linear(H, V, bias=False)`` in the causal-LM class; the tie target is the
module whose weight the analysis found the head sharing on a model built with
``tie_word_embeddings=True`` (``ModelPlan.head_tied_to``), not what ``_tied_weights_keys`` spells.

Emits, as vLLM's ``llama.py`` does::

    if get_pp_group().is_first_rank or (config.tie_word_embeddings and get_pp_group().is_last_rank):
        self.embed_tokens = VocabParallelEmbedding(V, H, quant_config=..., prefix=...)
    else:
        self.embed_tokens = PPMissingLayer()
    ...
    if get_pp_group().is_last_rank:
        self.lm_head = ParallelLMHead(V, H, quant_config=..., prefix=...)
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(V)
    else:
        self.lm_head = PPMissingLayer()

with ``LogitsProcessor(V, soft_cap=config.<field>)`` where the analysis proved the logits
soft-capped by that config field (``ModelPlan.logit_soft_cap``, gemma2's
``final_logit_softcapping``); vllm_model_interface then carries no post-processing.

An ``nn.Embedding`` subclass the analysis proved a scaled lookup (gemma's
``ScaledWordEmbedding``) is kept, built by the source's own call, and rebased onto
``VocabParallelEmbedding``.

Preconditions: the embedding is ``nn.Embedding`` or such a subclass, and the head an
``nn.Linear`` without bias.
"""

from __future__ import annotations

from functools import partial

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.lm_head import EMBEDDING
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.shared_matchers import SUPER_INIT, builds, nn_call
from hfrewrite.emit.taken_init import with_traced_branches
from hfrewrite.errors import HfrewriteError

NAME = "parallel_embedding"


def _replace_assignment(cls: cst.ClassDef, attr: str, build) -> cst.ClassDef:
    init = t.find_method(cls, "__init__")
    body = list(init.body.body)
    for i, s in enumerate(body):
        if t.self_attr_assigned(s) == attr:
            new = build(t.assigned_value(s))
            new[0] = new[0].with_changes(leading_lines=s.leading_lines)
            body[i : i + 1] = new
            return t.set_method(cls, t.with_body(init, body))
    raise HfrewriteError(f"{cls.name.value}: {NAME}: self.{attr} is not assigned in __init__")


def _assigned(cls: cst.ClassDef, attr: str) -> cst.BaseExpression | None:
    """What ``cls.__init__`` assigns ``self.<attr>`` at its top level, or None."""
    init = t.find_method(cls, "__init__")
    return next((t.assigned_value(s) for s in init.body.body if t.self_attr_assigned(s) == attr), None)


def _onto_vocab_parallel(cls: cst.ClassDef) -> cst.ClassDef:
    """``class C(nn.Embedding)`` -> ``class C(VocabParallelEmbedding)``; its
    ``super().__init__(num, dim, padding_idx)`` keeps (num, dim): vLLM's third parameter
    is the dtype, and the padding row only matters for training."""
    name = cls.name.value
    if [t.code(b.value) for b in cls.bases] != ["nn.Embedding"]:
        raise HfrewriteError(f"{name}: {NAME}: not a direct nn.Embedding subclass")

    class _Super(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            if m.matches(updated.func, SUPER_INIT):
                positional = [a for a in updated.args if a.keyword is None]
                if len(positional) < 2:
                    raise HfrewriteError(f"{name}: {NAME}: super().__init__ does not pass (num, dim)")
                return updated.with_changes(
                    args=[a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in positional[:2]]
                )
            return updated

    return cls.with_changes(bases=[cst.Arg(cst.Name("VocabParallelEmbedding"))]).visit(_Super())


def _vocab_parallel_embedding(plan, call: cst.BaseExpression) -> list[cst.BaseStatement]:
    """``self.<embed> = nn.Embedding(V, H)`` -> a ``VocabParallelEmbedding`` on the pipeline
    stages that look tokens up (the first, and the last when the head is tied to it)."""
    embed = plan.embed_tokens
    if plan.embed_class is not None and t.call_name(call) == plan.embed_class:
        built = t.code(call)  # the source's own class, now a VocabParallelEmbedding
    elif builds(call, nn_call("Embedding")):
        vocab, hidden = (
            t.code(t.arg(call, 0, "num_embeddings")),
            t.code(t.arg(call, 1, "embedding_dim")),
        )
        built = (
            f"VocabParallelEmbedding(\n"
            f'        {vocab}, {hidden}, quant_config=quant_config, prefix=f"{{prefix}}.{embed}"\n    )'
        )
    else:
        raise HfrewriteError(f"{plan.base_model_class}: {NAME}: self.{embed} is not nn.Embedding")
    last = (  # the last stage holds it too where the head is its weight
        "get_pp_group().is_last_rank"
        if plan.lm_head_weight == EMBEDDING
        else "(\n    config.tie_word_embeddings and get_pp_group().is_last_rank\n)"
    )
    return t.stmts(
        f"if get_pp_group().is_first_rank or {last}:\n"
        f"    self.{embed} = {built}\n"
        "else:\n"
        f"    self.{embed} = PPMissingLayer()\n"
    )


def _parallel_lm_head(
    plan, embedding: cst.BaseExpression, call: cst.BaseExpression
) -> list[cst.BaseStatement]:
    """``self.<head> = nn.Linear(H, V)`` -> a ``ParallelLMHead`` on the last pipeline stage,
    tied to ``plan.head_tied_to`` when the config ties them, with its logits processor; no
    head module (the embedding's weight, ``embedding`` its construction): one, always tied."""
    head = plan.lm_head
    tie = plan.head_tied_to  # found by identity on a model built tied (analyze/tied_head.py)
    bias = t.arg(call, 2, "bias") if isinstance(call, cst.Call) else None
    if plan.lm_head_weight == EMBEDDING:  # OpenELM's F.linear with the token embeddings' weight
        bias = cst.Name("False")
        vocab, hidden = (
            t.code(t.arg(embedding, 0, "num_embeddings")),
            t.code(t.arg(embedding, 1, "embedding_dim")),
        )
    elif plan.lm_head_weight:  # the source's own head class: one [vocab, hidden] weight, no bias
        bias, hidden, vocab = cst.Name("False"), "config.hidden_size", "config.vocab_size"
    elif not builds(call, nn_call("Linear")):
        raise HfrewriteError(f"{plan.architecture}: {NAME}: self.{head} is not nn.Linear")
    else:
        hidden, vocab = (
            t.code(t.arg(call, 0, "in_features")),
            t.code(t.arg(call, 1, "out_features")),
        )
    with_bias = (
        f", bias={t.code(bias) if bias is not None else 'True'}"
        if bias is None or not m.matches(bias, m.Name("False"))
        else ""
    )
    tying = (
        f"    if config.tie_word_embeddings:\n        self.{head} = self.{head}.tie_weights(self.{tie})\n"
        if tie
        else ""
    )
    if plan.lm_head_weight == EMBEDDING:  # the source computes its logits with that weight itself
        tying = f"    # The source's logits use the token embeddings' own weight.\n    self.{head} = self.{head}.tie_weights(self.{tie})\n"
    # a final-logit soft cap proven on the values (analyze/logit_softcap.py)
    soft_cap = f", soft_cap=config.{plan.logit_soft_cap}" if plan.logit_soft_cap else ""
    return t.stmts(
        "if get_pp_group().is_last_rank:\n"
        f"    self.{head} = ParallelLMHead(\n"
        f'        {vocab}, {hidden}{with_bias}, quant_config=quant_config, prefix=maybe_prefix(prefix, "{head}")\n'
        "    )\n"
        f"{tying}"
        f"    self.logits_processor = LogitsProcessor({vocab}{soft_cap})\n"
        "else:\n"
        f"    self.{head} = PPMissingLayer()\n"
    )


def _fusion_rows(plan) -> tuple[FusionRow, ...]:
    """The report's rows: the embedding and the head, each with what it became."""
    embed, head, tie = plan.embed_tokens, plan.lm_head, plan.head_tied_to
    embedded = (
        f"{embed} -> {plan.embed_class} (a scaled lookup, proven by replay) on VocabParallelEmbedding"
        if plan.embed_class
        else f"{embed} -> VocabParallelEmbedding"
    )
    return (
        FusionRow(plan.base_model_class, embedded),
        FusionRow(
            plan.architecture,
            f"{head} -> ParallelLMHead"
            + (
                f" (the weight of {tie}, with which the source computes its logits)"
                if plan.lm_head_weight == EMBEDDING
                else f" (tied to {tie} when config.tie_word_embeddings)"
                if tie
                else ""
            ),
        ),
    )


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    causal = t.find_class(module, plan.architecture)
    sites = Sites()  # the embedding subclass rebased, the classes assigning the embedding and the head
    if plan.embed_class is not None:
        module = sites.replace_class(
            module,
            plan.embed_class,
            _onto_vocab_parallel(t.find_class(module, plan.embed_class)),
        )
    embedding = _assigned(
        t.find_class(module, plan.base_model_class), plan.embed_tokens
    )  # as the source builds it
    base = _replace_assignment(
        t.find_class(module, plan.base_model_class),
        plan.embed_tokens,
        partial(_vocab_parallel_embedding, plan),
    )
    module = sites.replace_class(module, plan.base_model_class, base)
    if plan.head_init_switches:  # the branch the traced config took (OpenELM's shared head)
        causal = with_traced_branches(causal, plan.head_init_switches)
    causal = _replace_assignment(causal, plan.lm_head, partial(_parallel_lm_head, plan, embedding))
    module = sites.replace_class(module, plan.architecture, causal)
    return PassResult(
        module=module,
        imports=(
            "VocabParallelEmbedding",
            "ParallelLMHead",
            "LogitsProcessor",
            "PPMissingLayer",
            "get_pp_group",
            "maybe_prefix",
        ),
        fused=_fusion_rows(plan),
        matches=sites.count,
    )
