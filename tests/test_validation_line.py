"""The line convert prints after validating: what was checked, in which dtype, how closely."""

from hfrewrite.verify.validate import Validation


def test_a_float32_validation_says_tokens_and_logprobs():
    line = Validation(4, 1.5e-05, 12.0, model_class="LlamaForCausalLM").line()
    assert line == (
        "validated in vLLM against Hugging Face on tiny random checkpoints of this config: greedy "
        "tokens equal on 4 prompts each, max |logprob diff| 1.5e-05; vLLM ran the generated "
        "LlamaForCausalLM (12 s)"
    )


def test_a_file_with_state_layers_in_bfloat16_says_both_checks_apart():
    configs = ("the converted config", "the config with attention in every layer")
    line = Validation(
        4,
        1.7e-05,
        15.0,
        configs,
        "Qwen3NextForCausalLM",
        bfloat16_configs=("the converted config",),
        state_layer_diff=1.1e-02,
        whole=3,
    ).line()
    assert "in float32, greedy tokens equal on 4 prompts each, max |logprob diff| 1.7e-05; " in line
    assert "in bfloat16 (vLLM's CPU kernel of the file's state layers computes in no other) on 1, " in line
    assert "the first state layer 1.1e-02 from Hugging Face's in float32 (tolerance 5e-02)" in line
    assert "greedy tokens all equal on 3 of 4 prompts (reported, not judged)" in line
