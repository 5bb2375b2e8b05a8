"""A config switch added to each kind of forward: the file carries it or refuses the config.

Each case edits an installed modeling file so that one forward (attention, MLP, decoder
layer, base model, causal LM, MoE block) doubles its output when ``config.hfrewrite_switch``
is set. The file is converted with the switch off; then it runs in real vLLM on a config with
the switch on. It must either equal Hugging Face (the switch carried) or refuse that config
with hfrewrite's message, never compute something else.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from hfrewrite import convert
from hfrewrite.errors import HfrewriteError
from hfrewrite.resolve import resolve
from hfrewrite.verify.validate import validate

HERE = Path(__file__).resolve().parent
SWITCH = "hfrewrite_switch"
_STORE = ("        super().__init__()\n", "        super().__init__()\n        self.config = config\n")

# forward kind -> (model type, [(old, new), ...]); each edit must match exactly once
CASES = {
    "attention": (
        "llama",
        [
            (
                "        attn_output = self.o_proj(attn_output)\n",
                (
                    "        attn_output = self.o_proj(attn_output)\n"
                    f"        if self.config.{SWITCH}:\n            attn_output = attn_output * 2\n"
                ),
            )
        ],
    ),
    "mlp": (
        "llama",
        [
            (
                "        return down_proj\n",
                f"        if self.config.{SWITCH}:\n            down_proj = down_proj * 2\n        return down_proj\n",
            )
        ],
    ),
    "decoder layer": (
        "llama",
        [
            (
                "        super().__init__()\n        self.hidden_size = config.hidden_size\n",
                "        super().__init__()\n        self.config = config\n        self.hidden_size = config.hidden_size\n",
            ),
            (
                "        hidden_states = residual + hidden_states\n        return hidden_states\n",
                (
                    "        hidden_states = residual + hidden_states\n"
                    f"        if self.config.{SWITCH}:\n            hidden_states = hidden_states * 2\n"
                    "        return hidden_states\n"
                ),
            ),
        ],
    ),
    "base model": (
        "llama",
        [
            (
                "        hidden_states = self.norm(hidden_states)\n        return BaseModelOutputWithPast(",
                (
                    "        hidden_states = self.norm(hidden_states)\n"
                    f"        if self.config.{SWITCH}:\n            hidden_states = hidden_states * 2\n"
                    "        return BaseModelOutputWithPast("
                ),
            )
        ],
    ),
    "causal LM": (
        "llama",
        [
            (
                "        logits = self.lm_head(hidden_states[:, slice_indices, :])\n",
                (
                    "        logits = self.lm_head(hidden_states[:, slice_indices, :])\n"
                    f"        if self.config.{SWITCH}:\n            logits = logits * 2\n"
                ),
            )
        ],
    ),
    "MoE block": (
        "qwen3_moe",
        [
            (
                "        super().__init__()\n        self.experts = Qwen3MoeExperts(config)\n",
                "        super().__init__()\n        self.config = config\n        self.experts = Qwen3MoeExperts(config)\n",
            ),
            (
                "        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)\n",
                (
                    f"        if self.config.{SWITCH}:\n            final_hidden_states = final_hidden_states * 2\n"
                    "        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)\n"
                ),
            ),
        ],
    ),
}


def _mutated_module():
    spec = importlib.util.spec_from_file_location("source_mutations", HERE / "test_source_mutations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mutated_module


@pytest.mark.vllm
@pytest.mark.parametrize("kind", list(CASES))
def test_a_config_switch_is_carried_or_refused(kind, tmp_path, monkeypatch):
    model_type, edits = CASES[kind]
    package, module, path = _mutated_module()(model_type, edits, tmp_path)
    for name in module.__all__:  # transformers' auto classes now build the edited classes
        monkeypatch.setattr(package, name, getattr(module, name), raising=False)
    resolved = dataclasses.replace(resolve(model_type), modeling_path=path)
    setattr(resolved.config, SWITCH, False)
    generated = convert.generate(resolved)
    assert f"config.{SWITCH}" in generated.text  # carried or guarded: never dropped
    switched = resolved.config.__class__.from_dict({**resolved.config.to_dict(), SWITCH: True})
    try:
        validate(resolved, generated, (("the switch on", switched),))
    except HfrewriteError as exc:  # refused on that config, by the file's own guard
        assert "on the switch on" in str(exc) and "NotImplementedError: hfrewrite:" in str(exc), exc
        assert f"config.{SWITCH}" in str(exc), exc
    # else: the file carries the switch, and equals Hugging Face with it on


@pytest.mark.vllm
def test_a_layer_kind_the_trace_never_saw_is_refused_by_the_file():
    """LFM2's default config has attention layers only, and its layer tests its kind per
    layer (``config.layer_types[layer_idx]``): the file, whose layers call attention only,
    refuses in real vLLM a checkpoint with short-conv layers instead of failing in forward."""
    resolved = resolve("lfm2")
    generated = convert.generate(resolved)
    hybrid = resolved.config.__class__.from_dict(
        {**resolved.config.to_dict(), "layer_types": ["full_attention", "conv"], "num_hidden_layers": 2}
    )
    with pytest.raises(HfrewriteError) as refused:
        validate(resolved, generated, (("conv layers", hybrid),))
    message = str(refused.value)
    assert "on conv layers" in message and "NotImplementedError: hfrewrite: Lfm2DecoderLayer" in message
    assert "config.layer_types[layer_idx] == 'full_attention'" in message
