"""The shrunk copy of an MoE config whose per-layer MLP kinds are all "sparse" (Mellum's and
Cohere2-MoE's defaults) traces a dense first layer too, so the file's dense MLP class is
rewritten instead of carried untraced; a config that already names both kinds keeps them."""

import pytest
import transformers

from hfrewrite.analyze.shrink import shrink_config


@pytest.mark.parametrize("model_type", ["mellum", "cohere2_moe"])
def test_a_config_of_sparse_layers_only_traces_a_dense_layer(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    assert set(config.mlp_layer_types) == {"sparse"}
    small = shrink_config(config)
    assert small.mlp_layer_types == ["dense"] + ["sparse"] * (small.num_hidden_layers - 1)
    small._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(small)
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert len(set(mlps)) == 2, mlps  # one dense MLP class, one MoE block


def test_a_config_naming_both_kinds_keeps_its_order():
    config = transformers.AutoConfig.for_model("exaone_moe")
    kinds = list(dict.fromkeys(config.mlp_layer_types))
    assert set(kinds) == {"dense", "sparse"}
    assert shrink_config(config).mlp_layer_types == kinds
