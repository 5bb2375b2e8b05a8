"""Each layer's rope base read from a per-layer config list (Granite-SWA's
``layer_rope_theta``, 0 for no rope): the shrink gives each traced layer its own base and
one layer none (analyze/shrink.py), the replay finds the list whose entry turns each layer
(analyze/rope.py), and the emitted attention builds its rope at that entry, none at 0."""

import copy
from pathlib import Path

import pytest
import transformers
from transformers.models.granite_swa import modeling_granite_swa

from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.rope_styles import RopeLayers
from hfrewrite.analyze.shrink import shrink_config
from hfrewrite.errors import HfrewriteError

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def _config(**changes):
    config = transformers.AutoConfig.for_model("granite_swa")
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def test_the_shrink_varies_the_bases_and_keeps_a_layer_without_rope_beside_one_of_its_kind():
    small = shrink_config(_config())
    assert small.layer_rope_theta == [20000.0, 0.0, 40000.0]
    assert small.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]


def test_a_released_list_of_bases_and_zeros_is_varied_the_same_way():
    config = _config()
    config.layer_rope_theta = [0.0 if t == "full_attention" else 10000.0 for t in config.layer_types]
    assert shrink_config(config).layer_rope_theta == [20000.0, 0.0, 40000.0]


def test_a_config_without_such_a_list_keeps_two_layers():
    small = shrink_config(transformers.AutoConfig.for_model("llama"))
    assert small.num_hidden_layers == 2


def test_the_plan_reads_each_layers_base_from_the_list():
    attention = analyze(_config()).attention
    assert attention.rope_base_field == "layer_rope_theta"
    assert attention.rope_layers is RopeLayers.SOME


def test_the_golden_builds_the_rope_at_the_layers_entry_and_none_at_zero():
    src = (GOLDEN / "granite_swa.py").read_text()
    assert "rope_theta = config.layer_rope_theta[layer_idx]  # this layer's own base" in src
    assert 'rope_parameters={**config.rope_parameters, "rope_theta": rope_theta},' in src
    assert "        self.rotary_emb = None\n        if rope_theta:\n" in src
    assert "        if self.rotary_emb is not None:  # layers without rope (NoPE)\n" in src


def test_layers_turned_at_a_base_that_is_not_their_entry_are_refused(monkeypatch):
    original = modeling_granite_swa.GraniteSWARotaryEmbedding.compute_default_rope_parameters

    def one_base(config, **kwargs):  # every rotary module at 20000, whatever its layers' entry
        fixed = copy.deepcopy(config)
        fixed.rope_parameters = {**config.rope_parameters, "rope_theta": 20000.0}
        return original(fixed, **kwargs)

    monkeypatch.setattr(
        modeling_granite_swa.GraniteSWARotaryEmbedding,
        "compute_default_rope_parameters",
        staticmethod(one_base),
    )
    with pytest.raises(HfrewriteError, match="rope"):
        analyze(_config())
