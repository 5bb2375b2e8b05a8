"""flatten_base_model: ChatGLM3's parts, built by holders the base model wraps through
``skip_init``, built flat in the base model; its lm_head built by the causal LM."""

import dataclasses

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import flatten_base_model
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE = """\
class Embedding(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, self.hidden_size, device=device)


class GLMTransformer(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.post_layer_norm = config.post_layer_norm
        self.num_layers = config.num_layers
        self.layers = nn.ModuleList([GLMBlock(config, i + 1, device=device) for i in range(self.num_layers)])
        if self.post_layer_norm:
            self.final_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon, device=device)


class ChatGLMModel(ChatGLMPreTrainedModel):
    def __init__(self, config, device=None, empty_init=True):
        super().__init__(config)
        init_method = skip_init if empty_init else default_init
        init_kwargs = {}
        if device is not None:
            init_kwargs["device"] = device
        self.embedding = init_method(Embedding, config, **init_kwargs)
        self.num_layers = config.num_layers
        self.encoder = init_method(GLMTransformer, config, **init_kwargs)
        self.output_layer = init_method(
            nn.Linear, config.hidden_size, config.padded_vocab_size, bias=False, **init_kwargs
        )


class ChatGLMForConditionalGeneration(ChatGLMPreTrainedModel):
    def __init__(self, config, empty_init=True, device=None):
        super().__init__(config)
        self.transformer = ChatGLMModel(config, empty_init=empty_init, device=device)
        self.config = config
"""

# the holders' statements in place of the holders, their parameters bound (device: its
# default), `if self.post_layer_norm:` read as the config test the analysis evaluated, the
# locals only the holders' wrapper read gone; the lm_head, unwrapped, built by the causal LM
AFTER = """\
class Embedding(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, self.hidden_size, device=device)


class GLMTransformer(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.post_layer_norm = config.post_layer_norm
        self.num_layers = config.num_layers
        self.layers = nn.ModuleList([GLMBlock(config, i + 1, device=device) for i in range(self.num_layers)])
        if self.post_layer_norm:
            self.final_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon, device=device)


class ChatGLMModel(ChatGLMPreTrainedModel):
    def __init__(self, config, device=None, empty_init=True):
        super().__init__(config)
        self.hidden_size = config.hidden_size
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, self.hidden_size, device=None)
        self.num_layers = config.num_layers
        self.post_layer_norm = config.post_layer_norm
        self.layers = nn.ModuleList([GLMBlock(config, i + 1, device=None) for i in range(self.num_layers)])
        if config.post_layer_norm:
            self.final_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon, device=None)


class ChatGLMForConditionalGeneration(ChatGLMPreTrainedModel):
    def __init__(self, config, empty_init=True, device=None):
        super().__init__(config)
        self.transformer = ChatGLMModel(config, empty_init=empty_init, device=device)
        self.output_layer = nn.Linear(
            config.hidden_size, config.padded_vocab_size, bias=False)
        self.config = config
"""

PLAN = dataclasses.replace(
    llama_like("ChatGLM", "chatglm"),
    base_model_class="ChatGLMModel",
    architecture="ChatGLMForConditionalGeneration",
    base_model_attr="transformer",
    embed_tokens="word_embeddings",
    final_norm="final_layernorm",
    lm_head="output_layer",
    flat_holders=(("embedding", "Embedding"), ("encoder", "GLMTransformer")),
    flat_head="Linear",
)


def test_holders_are_built_flat_in_the_base_model():
    assert_rewrites(flatten_base_model, BEFORE, AFTER, PLAN)


def test_a_plan_without_holders_changes_nothing():
    assert rewrite(flatten_base_model, BEFORE, llama_like("ChatGLM", "chatglm")) == BEFORE


def test_an_attribute_a_holder_assigns_otherwise_is_refused():
    clashing = BEFORE.replace(
        "self.num_layers = config.num_layers\n        self.encoder",
        "self.num_layers = 2\n        self.encoder",
    )
    with pytest.raises(HfrewriteError, match="self.num_layers is assigned otherwise by the base model"):
        rewrite(flatten_base_model, clashing, PLAN)
