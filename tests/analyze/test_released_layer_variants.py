"""Layers of one class that a released config makes differ where the file builds each from the
source's own expressions: Laguna-XS.2's heads per layer (48 or 64, with one output gate per
head) and its rope parameters per layer type (partial YaRN on full layers, whole-head default
rope on sliding ones). Converting from that config must agree with the golden's file."""

from __future__ import annotations

import json
from pathlib import Path

from hfrewrite.analyze.layer_agreement import _in_fields
from hfrewrite.analyze.output_gates import GateActivation, OutputGate
from hfrewrite.cli import main

ROOT = Path(__file__).resolve().parents[2]
XS2 = ROOT / "tests" / "data" / "hub_configs" / "laguna" / "poolside__Laguna-XS.2-FP8.json"


def test_laguna_xs2_converts_from_its_own_config_to_the_goldens_file(tmp_path):
    data = json.loads(XS2.read_text())
    for field in ("quantization_config", "auto_map"):  # (float32; transformers' own laguna)
        data.pop(field, None)
    checkpoint = tmp_path / "xs2"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    assert main(["convert", str(checkpoint), "--no-verify", "-o", str(out)]) == 0
    body = (out / "laguna.py").read_text().split("\n\n", 1)[1]  # (the header names the source)
    assert body == (ROOT / "golden" / "laguna.py").read_text().split("\n\n", 1)[1]


def test_a_differing_layer_names_the_facts_it_differs_in():
    gate = OutputGate("g_proj", 64, 48, False, next(iter(GateActivation)), per_head=True, upcast=True)
    other = OutputGate("g_proj", 64, 64, False, next(iter(GateActivation)), per_head=False, upcast=True)
    assert _in_fields(other, gate) == " in out_features, per_head"
    assert _in_fields(gate, gate) == ""
