"""Hub custom code written for transformers 4.x, in real vLLM: `convert --trust-remote-code`
analyses each repository under the release it names (the newest 4.x here, from the cache
`make setup` fills), writes a file that carries the repository's configuration class as a
config shim, validates it against the repository's own model under that release, and
`verify CHECKPOINT_DIR` agrees on a second checkpoint the repository's code saved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.isolate.client import run_front
from hfrewrite.isolate.environment import NEWEST_4X
from hfrewrite.resolve import resolve
from hfrewrite.verify import fixtures
from hfrewrite.verify.validate import validation_config

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code" / "transformers4"

pytestmark = pytest.mark.vllm

# family -> (model type, what its file shows of the patterns it needed)
CONVERTED = {
    "qwen": ("qwen", "q, k, v = qkv.split("),  # c_attn [q; k; v], rope in [b, s, h, d], tuple cache
    "stablelm_epoch": ("stablelm_epoch", '"partial_rotary_factor": config.rope_pct'),  # 4.x rope field
    "internlm2": ("internlm2", "def _qkv_per_head_to_blocks"),  # grouped wqkv, reordered at load
    "baichuan2": ("baichuan", "def _lm_head_normalized"),  # NormHead, W_pack taken apart by index
    "minicpm": ("minicpm", "# as the source scales the lm_head's input"),  # projections in a helper
    "oldmoe_sizes": ("oldmoe_sizes", 'ckpt_names=("w1", "w2", "w3")'),  # experts take routing weights
    "falcon_rw": ("falcon_rw", "return outputs[0]"),  # [b * h] ALiBi attention, a 4.x tuple layer
    # head [hidden, vocab] when untied, rope counted from the length, q scaled first, Norm(config)
    "ernie4_5": ("ernie4_5", "def _lm_head_transposed"),
    # MLA by hand (q, k written into empty tensors, softmax_scale), a gate class with grouped
    # top-k over sorted-token experts, a shared expert, experts built under `if ep_size > 1`
    "deepseek": ("deepseek_v3", "scale=self.softmax_scale"),
    # ... with DeepSeek-R1's released YaRN (a 4.x rope_scaling): vLLM's deepseek_yarn rope
    "deepseek_r1_yarn": ("deepseek_v3", '"rope_type": "deepseek_yarn"}'),
    # parts at three depths built flat, sequence-first layers, multi-query [q; k; v], a rope
    # over half of each head at 10000 * rope_ratio (proven on sibling configs), a swiglu closure
    "chatglm": ("chatglm", '"rope_theta": 10000.0 * config.rope_ratio'),
    # layer-wise scaling (each layer its own head counts and MLP width, from per-layer lists),
    # one fused qkv_proj split per head, no lm_head module (the logits are F.linear with the
    # token embeddings' weight), a rope base in a field of its own (rope_freq_constant), and
    # the sizes vLLM reads given to the config shim
    "openelm": ("openelm", "config.num_query_heads[layer_idx]"),
}
# variants: (the repository, its config.json's values changed)
R1_YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
VARIANTS = {"deepseek_r1_yarn": ("deepseek", {"rope_scaling": R1_YARN, "max_position_embeddings": 163840})}
# what else a family's file must show: DeepSeek's rope helper dropped, its switch a guard
# (a YaRN checkpoint is refused at load)
ALSO_SHOWS = {
    "deepseek": "        if config.rope_scaling is not None:\n            raise NotImplementedError(",
    "deepseek_r1_yarn": "        if config.rope_scaling is None:\n            raise NotImplementedError(",
    "openelm": '"rope_theta": config.rope_freq_constant',
}
# the second checkpoint's config, where it differs from the repository's (json values)
SECOND = {
    "ernie4_5": {"tie_word_embeddings": False},  # the head's other layout
    "chatglm": {"rope_ratio": 50},  # ChatGLM3-6B-32K's: another rope base
    "openelm": {"rope_freq_constant": 500000},  # another rope base, read from its own field
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_converts_validates_and_verifies_under_its_release(name, tmp_path, capsys):
    model_type, shows = CONVERTED[name]
    source, edits = VARIANTS.get(name, (name, {}))
    repo = shutil.copytree(DATA / source, tmp_path / name)
    if edits:
        config = json.loads((repo / "config.json").read_text()) | edits
        (repo / "config.json").write_text(json.dumps(config, indent=2))
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "greedy tokens equal on 4 prompts" in printed, printed
    text = (out / f"{model_type}.py").read_text()
    header = " ".join(line.lstrip("# ") for line in text.splitlines()[:10])  # cut to 88 columns
    assert f"(Hub custom code, run under transformers {NEWEST_4X})" in header
    assert "hfrewrite config shim" in text and shows in text and ALSO_SHOWS.get(name, "") in text

    # a second checkpoint, saved by the repository's own code under its release
    second = None
    if name in SECOND:  # (the repository's code is found from name_or_path)
        second = json.loads((repo / "config.json").read_text()) | SECOND[name] | {"name_or_path": str(repo)}
    job = {"kind": "references", "model_id": str(repo), "configs": [["a second checkpoint", second]]}
    job |= {"prompts": [[1, 2, 3]], "max_tokens": 1, "out_dir": str(tmp_path / "second"), "seed": 1}
    ckpt = Path(run_front(NEWEST_4X, job)["references"][0]["ckpt"])
    assert fixtures.runs_custom_code(ckpt)
    saved = json.loads((ckpt / "config.json").read_text())
    assert all(saved[key] == value for key, value in SECOND.get(name, {}).items()), saved
    generated = str(out / f"{model_type}.py")
    assert main(["verify", str(ckpt), "--generated", generated, "--trust-remote-code"]) == 0
    report = capsys.readouterr().out
    assert report.strip().endswith("verified"), report
    assert f"from {Path(generated).resolve()}" in report, report  # the file under test ran


def test_baichuan_13b_alibi_converts_in_place_and_verifies(tmp_path, capsys):
    """Baichuan-13B's remote code builds and runs under the installed transformers: analysed in
    place (no release, no shim), its ALiBi proven and handed to vLLM's attention."""
    repo = shutil.copytree(DATA / "baichuan_13b", tmp_path / "baichuan_13b")
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "-o", str(out)]) == 0
    assert "greedy tokens equal on 4 prompts" in capsys.readouterr().out
    generated = out / "baichuan.py"
    text = generated.read_text()
    assert "alibi_slopes=" in text and "hfrewrite config shim" not in text

    config = validation_config(resolve(str(repo), trust_remote_code=True).config)
    ckpt = fixtures.save_random_checkpoint(config, tmp_path / "ckpt", seed=1)
    assert fixtures.runs_custom_code(ckpt)
    assert main(["verify", str(ckpt), "--generated", str(generated), "--trust-remote-code"]) == 0
    assert capsys.readouterr().out.strip().endswith("verified")


def test_telechat_reads_the_rope_base_its_rotary_class_computes_at_load(tmp_path, capsys):
    """TeleChat's rotary class computes its base from an NTK alpha of
    ``config.training_seqlen`` (no config field holds it): the file reads the base off that
    class's own table at load, so a checkpoint trained on another length, whose base differs,
    verifies too. (vLLM removed its own TeleChat, v1, in 0.25.)"""
    repo = shutil.copytree(DATA / "telechat", tmp_path / "telechat")
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "-o", str(out)]) == 0
    assert "greedy tokens equal on 4 prompts" in capsys.readouterr().out
    generated = out / "telechat.py"
    text = generated.read_text()
    assert "rope_theta = source_rope_theta(" in text and "def source_rope_theta(" in text

    config = validation_config(resolve(str(repo), trust_remote_code=True).config)
    config.training_seqlen = 32768  # NTK alpha 15 instead of 3: another base
    ckpt = fixtures.save_random_checkpoint(config, tmp_path / "ckpt", seed=1)
    assert fixtures.runs_custom_code(ckpt)
    assert main(["verify", str(ckpt), "--generated", str(generated), "--trust-remote-code"]) == 0
    assert capsys.readouterr().out.strip().endswith("verified")


def test_telechat_embedding_layernorm_switch_is_carried_with_its_test(tmp_path, capsys):
    """TeleChat normalises its embeddings under ``if self.config.embed_layernorm:``; the trace
    leaves that branch off, and the file carries the source's ``if`` (its norm vLLM's RMSNorm,
    proven for the class): a checkpoint that turns it on verifies too."""
    repo = shutil.copytree(DATA / "telechat", tmp_path / "telechat")
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "--no-verify", "-o", str(out)]) == 0
    generated = out / "telechat.py"
    assert "            if self.config.embed_layernorm:\n" in generated.read_text()
    config = validation_config(resolve(str(repo), trust_remote_code=True).config)
    assert not config.embed_layernorm
    config.embed_layernorm = True
    ckpt = fixtures.save_random_checkpoint(config, tmp_path / "ckpt", seed=2)
    capsys.readouterr()
    assert main(["verify", str(ckpt), "--generated", str(generated), "--trust-remote-code"]) == 0
    assert capsys.readouterr().out.strip().endswith("verified")


def test_chatglm_equals_vllms_own_chatglm(tmp_path):
    """vLLM ships ChatGLM3 (``chatglm.py``): the generated file computes what it computes, on
    a checkpoint the repository's code saved with ChatGLM3-6B-32K's ``rope_ratio``."""
    from hfrewrite.verify.engine import vllm_run

    repo = shutil.copytree(DATA / "chatglm", tmp_path / "chatglm")
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "--no-verify", "-o", str(out)]) == 0
    second = json.loads((repo / "config.json").read_text()) | {"rope_ratio": 50, "name_or_path": str(repo)}
    job = {"kind": "references", "model_id": str(repo), "configs": [["rope_ratio 50", second]]}
    job |= {"prompts": [[1, 2, 3]], "max_tokens": 1, "out_dir": str(tmp_path / "second"), "seed": 1}
    ckpt = Path(run_front(NEWEST_4X, job)["references"][0]["ckpt"])
    arch, prompts = (
        "ChatGLMForConditionalGeneration",
        [[1], [1, 2, 3, 4, 5], [i % 200 + 1 for i in range(40)]],
    )
    native = vllm_run(ckpt, prompts, 16, architecture=arch)
    generated = vllm_run(ckpt, prompts, 16, generated_module=out / "chatglm.py", architecture=arch)
    assert native["model_file"].endswith("vllm/model_executor/models/chatglm.py"), native["model_file"]
    assert generated["model_file"] == str((out / "chatglm.py").resolve()), generated["model_file"]
    assert generated["tokens"] == native["tokens"]
    diff = max(abs(a - b) for x, y in zip(native["logprobs"], generated["logprobs"]) for a, b in zip(x, y))
    assert diff < 1e-4, diff
