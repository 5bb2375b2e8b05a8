"""vllm_model_interface: vLLM's model interface for the base model and the causal LM."""

import dataclasses
from pathlib import Path

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import vllm_model_interface
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE_LLAMA_MODEL_AND_CAUSAL_LM = """\
@auto_docstring
class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Initialize weights and apply final processing
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        return BaseModelOutputWithPast(last_hidden_state=input_ids)


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids, labels=None):
        return CausalLMOutputWithPast(logits=self.lm_head(self.model(input_ids)))
"""

AFTER_LLAMA_MODEL_AND_CAUSAL_LM = """\
@support_torch_compile
class LlamaModel(nn.Module, EagleModelMixin):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: LlamaDecoderLayer(config, extract_layer_index(prefix), cache_config=cache_config, quant_config=quant_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        if get_pp_group().is_last_rank:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )
    
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)
    
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if get_pp_group().is_first_rank:
            if inputs_embeds is not None:
                hidden_states = inputs_embeds
            else:
                hidden_states = self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]

        # the layers' outputs an EAGLE-3 draft reads (none unless one is set)
        aux_hidden_states: list[torch.Tensor] = []
        if get_pp_group().is_first_rank:
            self._maybe_add_hidden_state(
                aux_hidden_states, self.start_layer, hidden_states, residual
            )
        for idx, layer in enumerate(
            islice(self.layers, self.start_layer, self.end_layer),
            start=self.start_layer,
        ):
            hidden_states, residual = layer(positions, hidden_states, residual)
            self._maybe_add_hidden_state(
                aux_hidden_states, idx + 1, hidden_states, residual
            )

        if not get_pp_group().is_last_rank:
            return IntermediateTensors(
                {"hidden_states": hidden_states, "residual": residual}
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        if aux_hidden_states:
            return hidden_states, aux_hidden_states
        return hidden_states


class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsPP, SupportsEagle3):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.model = LlamaModel(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model")
        )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.make_empty_intermediate_tensors = (
            self.model.make_empty_intermediate_tensors
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.model._set_aux_hidden_state_layers(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        num_layers = len(self.model.layers)
        return (2, num_layers // 2, num_layers - 3)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Reads the original Hugging Face checkpoint names; fused projections are
        # loaded shard by shard through `hf_to_vllm_mapper`.
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
"""


def test_llama_model_and_causal_lm():
    assert_rewrites(
        vllm_model_interface, BEFORE_LLAMA_MODEL_AND_CAUSAL_LM, AFTER_LLAMA_MODEL_AND_CAUSAL_LM, llama_like()
    )


REFUSED_LAYERS_NOT_MODULE_LIST = """\
@auto_docstring
class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.layers = make_stack(
            [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Initialize weights and apply final processing
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        return BaseModelOutputWithPast(last_hidden_state=input_ids)


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids, labels=None):
        return CausalLMOutputWithPast(logits=self.lm_head(self.model(input_ids)))
"""


def test_refuses_layers_not_module_list():
    with pytest.raises(HfrewriteError, match="ModuleList"):
        rewrite(vllm_model_interface, REFUSED_LAYERS_NOT_MODULE_LIST, llama_like())


SCALED_LOGITS = BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
    "        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)\n",
    "        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)\n"
    "        self.logit_scale = config.logit_scale\n",
).replace(
    "        return CausalLMOutputWithPast(logits=self.lm_head(self.model(input_ids)))\n",
    "        hidden_states = self.model(input_ids).last_hidden_state\n"
    "        logits = self.lm_head(hidden_states)\n"
    "        logits = logits * self.logit_scale\n"
    "        return CausalLMOutputWithPast(logits=logits)\n",
)


def logits_plan():
    return dataclasses.replace(llama_like(), logits_postprocessed=True)


def test_logit_post_processing_is_carried_into_compute_logits():
    after = rewrite(vllm_model_interface, SCALED_LOGITS, logits_plan())
    assert "        self.logit_scale = config.logit_scale\n" in after
    logits = after[after.index("def compute_logits") :]
    assert "logits = logits * self.logit_scale\n" in logits


def test_logit_post_processing_reading_other_values_is_refused():
    source = SCALED_LOGITS.replace(
        "logits = logits * self.logit_scale", "logits = logits * bias_table[input_ids]"
    )
    with pytest.raises(
        HfrewriteError,
        match="the logits are post-processed, but not by statements right after",
    ):
        rewrite(vllm_model_interface, source, logits_plan())


@pytest.mark.parametrize("bias, added", [("True", True), ("config.lm_head_bias", True), ("False", False)])
def test_lm_head_bias_is_added_to_the_logits(bias, added):
    source = BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
        "ParallelLMHead(config.vocab_size, config.hidden_size)",
        f"ParallelLMHead(config.vocab_size, config.hidden_size, bias={bias})",
    )
    after = rewrite(vllm_model_interface, source, llama_like())
    assert ("return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)" in after) is added


def test_a_bias_on_another_layer_is_not_the_lm_heads():
    source = BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
        "        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)\n",
        "        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)\n"
        "        self.adapter = Linear(config.hidden_size, config.hidden_size, bias=True)\n",
    )
    after = rewrite(vllm_model_interface, source, llama_like())
    assert "self.lm_head.bias" not in after


def glue_source(glue: str) -> str:
    return BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
        "        return BaseModelOutputWithPast(last_hidden_state=input_ids)\n",
        "        inputs_embeds = self.embed_tokens(input_ids)\n"
        f"{glue}"
        "        for decoder_layer in self.layers:\n"
        "            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask)\n"
        "        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))\n",
    )


def transformed_plan():
    return dataclasses.replace(llama_like(), embeddings_transformed=True)


def test_steps_between_the_embeddings_and_the_first_layer_keep_their_order():
    after = rewrite(
        vllm_model_interface,
        glue_source(
            "        hidden_states = inputs_embeds * self.embedding_multiplier\n"
            "        hidden_states = hidden_states + self.embedding_bias\n"
            "        hidden_states = hidden_states * 2.0\n"
        ),
        transformed_plan(),
    )
    assert (
        "                hidden_states = self.embed_input_ids(input_ids)\n"
        "            # The source's own step between the embeddings and the first layer.\n"
        "            hidden_states = hidden_states * self.embedding_multiplier\n"
        "            hidden_states = hidden_states + self.embedding_bias\n"
        "            hidden_states = hidden_states * 2.0\n"
    ) in after


def test_a_switch_on_the_embeddings_is_carried_with_its_test():
    # AFMoE's muP: the `if` is the source's own, so configs either way compute what it does
    after = rewrite(
        vllm_model_interface,
        glue_source(
            "        hidden_states = inputs_embeds\n"
            "        if self.config.mup_enabled:\n"
            "            hidden_states = hidden_states * (self.config.hidden_size**0.5)\n"
            "        position_embeddings = self.rotary_emb(hidden_states, position_ids)\n"
        ),
        transformed_plan(),
    )
    assert (
        "                hidden_states = self.embed_input_ids(input_ids)\n"
        "            # The source's own step between the embeddings and the first layer.\n"
        "            if self.config.mup_enabled:\n"
        "                hidden_states = hidden_states * (self.config.hidden_size**0.5)\n"
        "            residual = None\n"
    ) in after


def test_a_switch_on_the_embeddings_reading_other_inputs_is_refused():
    with pytest.raises(HfrewriteError, match="the embeddings are changed with attention_mask"):
        rewrite(
            vllm_model_interface,
            glue_source(
                "        hidden_states = inputs_embeds\n"
                "        if self.config.mup_enabled:\n"
                "            hidden_states = hidden_states * attention_mask\n"
            ),
            transformed_plan(),
        )


def test_transformed_embeddings_with_no_step_to_carry_are_refused():
    # the analysis saw the first layer read something else than the embeddings; the source shows no step
    with pytest.raises(HfrewriteError, match="the first layer does not read the embeddings as they are"):
        rewrite(
            vllm_model_interface,
            glue_source("        hidden_states = inputs_embeds\n"),
            transformed_plan(),
        )


def test_a_scaled_lookup_is_carried_into_embed_input_ids():
    after = rewrite(
        vllm_model_interface,
        glue_source("").replace(
            "inputs_embeds = self.embed_tokens(input_ids)",
            "hidden_states = self.embed_tokens(input_ids) * 2.0",
        ),
        transformed_plan(),
    )
    embed = after[after.index("def embed_input_ids") : after.index("def forward")]
    assert "return self.embed_tokens(input_ids) * 2.0\n" in embed


def test_attributes_the_carried_logits_read_are_copied_once():
    source = SCALED_LOGITS.replace(
        "        self.logit_scale = config.logit_scale\n",
        "        self.logit_scale = config.logit_scale\n        self.config = config\n",
    )
    after = rewrite(vllm_model_interface, source, logits_plan())
    causal_lm = after[after.index("class LlamaForCausalLM") :]
    assert causal_lm.count("self.config = config\n") == 1


def test_a_layer_stack_built_by_a_loop_is_made_by_make_layers_with_the_index_wherever_read():
    """Bamba appends its layers in a loop, each told its kind by the loop's index: that is the
    stack ``nn.ModuleList([...])`` means, and each use of the index reads the layer's prefix."""
    looped = BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
        "        self.layers = nn.ModuleList(\n"
        "            [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]\n"
        "        )\n",
        "        decoder_layers = []\n"
        "        for i in range(config.num_hidden_layers):\n"
        "            decoder_layers.append(LlamaDecoderLayer(config, layer_idx=i, kind=config.kinds[i]))\n"
        "        self.layers = nn.ModuleList(decoder_layers)\n",
    )
    assert looped != BEFORE_LLAMA_MODEL_AND_CAUSAL_LM
    after = rewrite(vllm_model_interface, looped, llama_like())
    assert (
        "            lambda prefix: LlamaDecoderLayer(config, layer_idx=extract_layer_index(prefix), "
        "kind=config.kinds[extract_layer_index(prefix)], cache_config=cache_config, "
        "quant_config=quant_config, prefix=prefix),\n"
    ) in after
    assert "decoder_layers" not in after


def test_a_layer_class_chosen_in_the_loop_is_chosen_by_the_prefix_index():
    """Jamba names each layer's class in the loop before appending it: the lambda chooses the
    class by the layer's index too."""
    looped = BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
        "        self.layers = nn.ModuleList(\n"
        "            [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]\n"
        "        )\n",
        "        decoder_layers = []\n"
        "        for i in range(config.num_hidden_layers):\n"
        "            layer_class = LAYER_CLASSES[config.kinds[i]]\n"
        "            decoder_layers.append(layer_class(config, layer_idx=i))\n"
        "        self.layers = nn.ModuleList(decoder_layers)\n",
    )
    assert looped != BEFORE_LLAMA_MODEL_AND_CAUSAL_LM
    after = rewrite(vllm_model_interface, looped, llama_like())
    assert (
        "            lambda prefix: LAYER_CLASSES[config.kinds[extract_layer_index(prefix)]](config, "
        "layer_idx=extract_layer_index(prefix), cache_config=cache_config, "
        "quant_config=quant_config, prefix=prefix),\n"
    ) in after
    assert "layer_class" not in after


def test_a_layer_class_chosen_by_a_test_of_the_index_keeps_that_test():
    """OLMo-hybrid builds ``A(config, i) if config.layer_types[i] == ... else B(config, i)``:
    each branch gets vLLM's arguments, and the test reads the prefix's index too."""
    chosen = BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
        "[LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]",
        "[MixerLayer(config, layer_idx) if config.layer_types[layer_idx] == 'linear' "
        "else LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]",
    )
    assert chosen != BEFORE_LLAMA_MODEL_AND_CAUSAL_LM
    after = rewrite(vllm_model_interface, chosen, llama_like())
    extra = "cache_config=cache_config, quant_config=quant_config, prefix=prefix"
    assert (
        f"            lambda prefix: MixerLayer(config, extract_layer_index(prefix), {extra}) "
        "if config.layer_types[extract_layer_index(prefix)] == 'linear' "
        f"else LlamaDecoderLayer(config, extract_layer_index(prefix), {extra}),\n"
    ) in after


def test_a_loop_that_does_more_than_append_layers_is_not_a_stack():
    looped = BEFORE_LLAMA_MODEL_AND_CAUSAL_LM.replace(
        "        self.layers = nn.ModuleList(\n"
        "            [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]\n"
        "        )\n",
        "        decoder_layers = []\n"
        "        for i in range(config.num_hidden_layers):\n"
        "            decoder_layers.append(LlamaDecoderLayer(config, i))\n"
        "            decoder_layers.append(LlamaDecoderLayer(config, i))\n"
        "        self.layers = nn.ModuleList(decoder_layers)\n",
    )
    with pytest.raises(HfrewriteError, match="ModuleList"):
        rewrite(vllm_model_interface, looped, llama_like())


def test_a_base_model_without_a_final_norm_returns_the_last_layers_output():
    # GPT-1 (openai-gpt): the template's final norm goes; no EAGLE-3 draft can use its
    # `transformer` base model, so no states are collected either
    src = (Path(__file__).resolve().parents[2] / "golden" / "openai-gpt.py").read_text()
    base = src[src.index("class OpenAIGPTModel") : src.index("class OpenAIGPTLMHeadModel")]
    assert "self.norm" not in base and "aux_hidden_states" not in base
    assert (
        '            return IntermediateTensors({"hidden_states": hidden_states})\n'
        "        return hidden_states\n"
    ) in base
