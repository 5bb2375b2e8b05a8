"""Custom code that calls torch's scaled_dot_product_attention itself (not transformers'
attention interface) is refused with that reason, not taken for a recurrent mixer."""

import shutil
from pathlib import Path
from unittest import mock

import pytest
import transformers

from hfrewrite.analyze import model as analysis
from hfrewrite.errors import HfrewriteError

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code" / "tinyllama_renamed"


def test_direct_sdpa_is_refused_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA, tmp_path / "tinyllama_renamed")
    config = transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True)
    build = transformers.AutoModelForCausalLM.from_config
    with (
        mock.patch.object(
            transformers.AutoModelForCausalLM,
            "from_config",
            lambda c, **kw: build(c, trust_remote_code=True, **kw),
        ),
        pytest.raises(HfrewriteError, match="calls torch's scaled_dot_product_attention directly"),
    ):
        analysis.analyze(config)
