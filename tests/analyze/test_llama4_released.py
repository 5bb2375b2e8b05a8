"""The released Llama-4 configs (tests/data/hub_configs/llama4), converted as users bring them:
multimodal configs whose text model converts. Maverick turns q/k norms off
(``use_qk_norm: false``): its file proves them anyway on a sibling config that turns them on,
found through the forward's ``if hasattr(self, "qk_norm"):`` and the ``__init__`` test that
builds ``self.qk_norm``; without that proof the file would drop the branch, and since no test
``__init__`` can make before building the attribute refuses the configs that take it, the
conversion is refused instead."""

from pathlib import Path

import pytest

from hfrewrite.analyze import qk_norm_variants
from hfrewrite.convert import generate
from hfrewrite.errors import HfrewriteError
from hfrewrite.resolve import resolve

RELEASED = Path(__file__).resolve().parents[1] / "data" / "hub_configs" / "llama4"


def _checkpoint_dir(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text((RELEASED / f"meta-llama__{name}.json").read_text())
    return directory


def test_maverick_proves_the_q_k_norms_its_config_turns_off(tmp_path):
    generated = generate(resolve(str(_checkpoint_dir(tmp_path, "Llama-4-Maverick-17B-128E-Instruct"))))
    assert ("q/k norms (use_qk_norm true)",) == tuple(what for what, _ in generated.sibling_configs)
    assert 'if hasattr(self, "qk_norm"):' in generated.text
    assert "class Llama4ForConditionalGeneration(Llama4ForCausalLM):" in generated.text
    assert "apply_router_weight_on_input=True" in generated.text


def test_a_dropped_hasattr_branch_refuses_the_conversion(tmp_path, monkeypatch):
    monkeypatch.setattr(qk_norm_variants, "_built_under", lambda test, cls: None)
    with pytest.raises(
        HfrewriteError, match=r"the forward's `hasattr\(self, .qk_norm.\)` branch was never traced"
    ):
        generate(resolve(str(_checkpoint_dir(tmp_path, "Llama-4-Maverick-17B-128E-Instruct"))))
