"""Custom code that calls torch's scaled_dot_product_attention itself (not transformers'
attention interface) is refused with that reason, not taken for a recurrent mixer."""

import shutil
from pathlib import Path

import pytest
import transformers

from hfrewrite.analyze import model as analysis
from hfrewrite.errors import HfrewriteError

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code"


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("tinyllama_renamed", "SelfAttention: vllm_attention"),
        ("fusedqkv_postnorm", "PostNormLayer: decoder_layer"),
    ],
)
def test_direct_sdpa_is_refused_with_its_reason(name, where, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA / name, tmp_path / name)
    config = transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True)
    with pytest.raises(HfrewriteError, match=f"{where}: calls torch's scaled_dot_product_attention directly"):
        analysis.analyze(config)
