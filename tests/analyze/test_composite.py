"""Multimodal configs that nest a text model's (analyze/composite.py): the text config is the
one analysed, and the checkpoint's text tensors are found where the multimodal class keeps
them, in memory and as save_pretrained writes them (found by value, not by name)."""

import transformers

from hfrewrite.analyze.composite import composite_class, composite_plan, text_part, with_text
from hfrewrite.analyze.shrink import shrink_config


def _plan(model_type: str):
    config = transformers.AutoConfig.for_model(model_type)
    return composite_plan(config, shrink_config(text_part(config)))


def test_a_text_config_has_no_text_part_and_a_multimodal_one_has_its_own():
    assert text_part(transformers.AutoConfig.for_model("llama")) is None
    assert type(text_part(transformers.AutoConfig.for_model("llama4"))).__name__ == "Llama4TextConfig"
    assert type(text_part(transformers.AutoConfig.for_model("gemma3"))).__name__ == "Gemma3TextConfig"


def test_llama4_keeps_its_text_causal_lm_under_language_model():
    plan = _plan("llama4")
    assert plan.architecture == "Llama4ForConditionalGeneration"
    assert dict(plan.prefixes) == {
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "vision_model.": None,
        "multi_modal_projector.": None,
    }


def test_gemma3_is_read_in_the_layout_it_is_saved_in_and_the_one_it_is_held_in():
    prefixes = dict(_plan("gemma3").prefixes)
    assert prefixes["language_model.model."] == "model."  # what save_pretrained writes
    assert prefixes["model.language_model."] == "model."  # transformers 5's names in memory
    assert prefixes["vision_tower."] is None and prefixes["model.vision_tower."] is None
    assert prefixes["language_model.lm_head."] == "lm_head."  # an untied checkpoint's
    assert "lm_head." not in prefixes  # the name in memory: never skipped


def test_which_configs_flag_ties_the_lm_head_is_seen_on_the_multimodal_class():
    assert _plan("gemma3").tie_from_composite  # Gemma3ForConditionalGeneration holds it
    assert not _plan("llama4").tie_from_composite  # its Llama4ForCausalLM, with the text config


def test_the_tiny_multimodal_model_keeps_the_text_config_and_one_vision_layer():
    config = transformers.AutoConfig.for_model("llama4")
    small_text = shrink_config(text_part(config))
    small = with_text(config, small_text)
    assert small.text_config.num_hidden_layers == small_text.num_hidden_layers
    assert small.vision_config.num_hidden_layers == 1
    assert composite_class(small).__name__ == "Llama4ForConditionalGeneration"
