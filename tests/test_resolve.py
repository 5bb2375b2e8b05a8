"""resolve(): local dirs, bare types, Hub ids from a fake local cache (no network), bad input."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest

from hfrewrite.errors import HfrewriteError
from hfrewrite.resolve import resolve

SHA = "0123456789abcdef0123456789abcdef01234567"
TINY = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty offline HF cache; returns a function that adds `org/name` repos to it."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def add(repo_id: str, config: dict, sha: str = SHA) -> Path:
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(config))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(sha)
        return snap

    return add


def write_config(directory: Path, config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "config.json").write_text(text)
    return directory


def test_bare_type_uses_config_defaults():
    r = resolve("llama")
    assert (r.source_kind, r.model_type, r.revision) == ("type", "llama", None)
    assert r.modeling_module == "transformers.models.llama.modeling_llama"
    assert r.modeling_path.name == "modeling_llama.py" and r.modeling_path.is_file()
    assert r.config.model_type == "llama"
    assert r.transformers_version == "5.19.0"


def test_local_dir_is_recorded_as_given(tmp_path, monkeypatch):
    write_config(tmp_path / "ckpt", TINY)
    monkeypatch.chdir(tmp_path)
    r = resolve("./ckpt")
    assert (r.model_id, r.source_kind, r.model_type) == ("./ckpt", "dir", "llama")
    assert r.config.hidden_size == 128


def test_hub_id_from_local_cache(hub_cache):
    hub_cache("org/tiny", TINY)
    r = resolve("org/tiny")
    assert (r.source_kind, r.model_type, r.config.hidden_size) == ("hub", "llama", 128)
    assert resolve("org/tiny", revision=SHA).revision == SHA


def test_hub_id_not_cached_and_offline(hub_cache):
    with pytest.raises(HfrewriteError, match="not in the local Hugging Face cache.*unreachable"):
        resolve("org/absent")


def test_unknown_name(hub_cache):
    with pytest.raises(HfrewriteError, match="notamodel: not a local directory"):
        resolve("notamodel")


def test_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(HfrewriteError, match="no config.json in"):
        resolve(str(tmp_path / "empty"))


def test_malformed_json(tmp_path):
    d = write_config(tmp_path / "bad", '{"model_type": "llama",')
    with pytest.raises(HfrewriteError, match="not valid JSON"):
        resolve(str(d))


def test_unknown_model_type_is_named(tmp_path):
    d = write_config(tmp_path / "m", {"model_type": "frobnicator"})
    with pytest.raises(HfrewriteError, match="unknown model type 'frobnicator'"):
        resolve(str(d))


def test_auto_map_refused_without_trust(tmp_path):
    d = write_config(tmp_path / "m", {**TINY, "auto_map": {"AutoConfig": "x.Y"}})
    with pytest.raises(HfrewriteError, match="--trust-remote-code"):
        resolve(str(d))
    r = resolve(str(d), trust_remote_code=True)  # installed llama modeling file exists
    assert r.model_type == "llama" and r.trust_remote_code


def test_auto_map_refusal_names_transformers_own_type_where_there_is_one(tmp_path):
    # MPT-7B's config.json names its repository's code, and transformers has its own mpt:
    # the line says how to convert that one; a type only Hub code has gets no such hint
    d = write_config(tmp_path / "m", {**TINY, "auto_map": {"AutoConfig": "x.Y"}})
    with pytest.raises(HfrewriteError, match="transformers has its own 'llama': to convert that instead"):
        resolve(str(d))
    custom = write_config(tmp_path / "c", {"model_type": "mycustom", "auto_map": {"AutoConfig": "x.Y"}})
    with pytest.raises(HfrewriteError, match=r"refusing without --trust-remote-code$"):
        resolve(str(custom))


def test_auto_map_to_the_repository_code_is_not_replaced_by_transformers_own(tmp_path):
    # model_type llama, but the checkpoint runs its own modeling file: that file is the
    # source (here it is missing, and the error says which class failed), never
    # transformers' llama in its place
    auto = {"AutoConfig": "x.Y", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    d = write_config(tmp_path / "m", {**TINY, "auto_map": auto})
    with pytest.raises(
        HfrewriteError,
        match=r"the repository's code \(modeling_x.XForCausalLM\) does not load under transformers",
    ):
        resolve(str(d), trust_remote_code=True)


def test_auto_map_custom_type_has_no_installed_source(tmp_path):
    d = write_config(tmp_path / "m", {"model_type": "mycustom", "auto_map": {"AutoConfig": "x.Y"}})
    with pytest.raises(HfrewriteError, match="its auto_map names no AutoModelForCausalLM"):
        resolve(str(d), trust_remote_code=True)


def test_revision_only_for_hub_ids():
    with pytest.raises(HfrewriteError, match="--revision applies to Hub ids"):
        resolve("llama", revision="main")


def test_missing_path_like_id():
    with pytest.raises(HfrewriteError, match="no such directory"):
        resolve("./does/not/exist")


def test_type_without_a_modeling_file_of_its_name_uses_its_causal_lm_class_file():
    # gpt-sw3 has no models/gpt_sw3/modeling_gpt_sw3.py: transformers maps it to GPT-2's
    # causal LM; data2vec-text's classes live in models/data2vec/modeling_data2vec_text.py
    sw3 = resolve("gpt-sw3")
    assert sw3.modeling_module == "transformers.models.gpt2.modeling_gpt2"
    assert sw3.modeling_path.name == "modeling_gpt2.py" and sw3.modeling_path.is_file()
    text = resolve("data2vec-text")
    assert text.modeling_module == "transformers.models.data2vec.modeling_data2vec_text"
    assert text.modeling_path.is_file()
