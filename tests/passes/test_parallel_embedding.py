"""parallel_embedding: VocabParallelEmbedding / ParallelLMHead with tying and PP stages."""

import pytest

from harness import rewrite
from hfrewrite.errors import HfrewriteError
from hfrewrite.passes import parallel_embedding
from plans import llama_like


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
    assert rewrite(parallel_embedding, BEFORE_TIED_LM_HEAD, llama_like()) == AFTER_TIED_LM_HEAD


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
    assert rewrite(parallel_embedding, BEFORE_UNTIED_LM_HEAD, llama_like()) == AFTER_UNTIED_LM_HEAD


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
        rewrite(parallel_embedding, LM_HEAD_BIAS.replace("nn.Linear(", "MyHead("), llama_like())
