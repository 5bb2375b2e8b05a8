"""parallel_embedding: VocabParallelEmbedding / ParallelLMHead with tying and PP stages."""

import dataclasses

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import parallel_embedding
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE_TIED_LM_HEAD = """\
class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
"""

AFTER_TIED_LM_HEAD = """\
class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        if get_pp_group().is_first_rank or (
            config.tie_word_embeddings and get_pp_group().is_last_rank
        ):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
            )
        else:
            self.embed_tokens = PPMissingLayer()


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=maybe_prefix(prefix, "lm_head")
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
        else:
            self.lm_head = PPMissingLayer()
"""


def test_tied_lm_head():
    assert_rewrites(parallel_embedding, BEFORE_TIED_LM_HEAD, AFTER_TIED_LM_HEAD, llama_like())


BEFORE_UNTIED_LM_HEAD = """\
class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
"""

AFTER_UNTIED_LM_HEAD = """\
class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        if get_pp_group().is_first_rank or (
            config.tie_word_embeddings and get_pp_group().is_last_rank
        ):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
            )
        else:
            self.embed_tokens = PPMissingLayer()


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=maybe_prefix(prefix, "lm_head")
            )
            self.logits_processor = LogitsProcessor(config.vocab_size)
        else:
            self.lm_head = PPMissingLayer()
"""


def test_untied_lm_head():
    """A source whose model never shares the head's weight (found so by the analysis)."""
    plan = dataclasses.replace(llama_like(), head_tied_to=None)
    assert_rewrites(parallel_embedding, BEFORE_UNTIED_LM_HEAD, AFTER_UNTIED_LM_HEAD, plan)


def test_the_tie_is_the_analysis_fact_not_the_spelling():
    """The tie follows ``head_tied_to`` even where no ``_tied_weights_keys`` is spelled."""
    assert "self.lm_head.tie_weights(self.model.embed_tokens)" in rewrite(
        parallel_embedding, BEFORE_UNTIED_LM_HEAD, llama_like()
    )


LM_HEAD_BIAS = """\
class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
"""


def test_lm_head_bias_is_kept():
    out = rewrite(parallel_embedding, LM_HEAD_BIAS, llama_like())
    assert "config.vocab_size, config.hidden_size, bias=True, quant_config=quant_config" in out


def test_refuses_a_head_that_is_not_linear():
    with pytest.raises(HfrewriteError, match="is not nn.Linear"):
        rewrite(
            parallel_embedding,
            LM_HEAD_BIAS.replace("nn.Linear(", "MyHead("),
            llama_like(),
        )


def test_lm_head_positional_bias_is_read():
    # nn.Linear(in, out, False): the third positional argument is the bias
    out = rewrite(parallel_embedding, LM_HEAD_BIAS.replace("bias=True)", "False)"), llama_like())
    assert "config.vocab_size, config.hidden_size, quant_config=quant_config" in out


SCALED_EMBEDDING = """\
class ScaledWordEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx, embed_scale=1.0):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scalar_embed_scale = embed_scale

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


""" + LM_HEAD_BIAS.replace(
    "nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)",
    "ScaledWordEmbedding(config.vocab_size, config.hidden_size, self.padding_idx, embed_scale=2.0)",
)


def scaled_plan():
    return dataclasses.replace(llama_like(), embed_class="ScaledWordEmbedding")


def test_scaled_embedding_class_moves_onto_vocab_parallel():
    out = rewrite(parallel_embedding, SCALED_EMBEDDING, scaled_plan())
    assert "class ScaledWordEmbedding(VocabParallelEmbedding):" in out
    assert "super().__init__(num_embeddings, embedding_dim)\n" in out  # vLLM's third parameter is a dtype
    assert (
        "self.embed_tokens = ScaledWordEmbedding(config.vocab_size, config.hidden_size, self.padding_idx, "
        "embed_scale=2.0)"
    ) in out


def test_scaled_embedding_without_num_and_dim_is_refused():
    source = SCALED_EMBEDDING.replace(
        "super().__init__(num_embeddings, embedding_dim, padding_idx)",
        "super().__init__(num_embeddings, embedding_dim=embedding_dim)",
    )
    with pytest.raises(HfrewriteError, match=r"does not pass \(num, dim\)"):
        rewrite(parallel_embedding, source, scaled_plan())


def test_lm_head_bias_expression_is_kept():
    out = rewrite(
        parallel_embedding,
        LM_HEAD_BIAS.replace("bias=True)", "bias=config.lm_head_bias)"),
        llama_like(),
    )
    assert "config.vocab_size, config.hidden_size, bias=config.lm_head_bias, quant_config=quant_config" in out


def test_scaled_embedding_with_padding_by_keyword_keeps_num_and_dim():
    source = SCALED_EMBEDDING.replace(
        "super().__init__(num_embeddings, embedding_dim, padding_idx)",
        "super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)",
    )
    assert "super().__init__(num_embeddings, embedding_dim)\n" in rewrite(
        parallel_embedding, source, scaled_plan()
    )
