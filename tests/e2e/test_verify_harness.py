"""The verification harness proves a correct model file and catches broken ones.

The "generated" files here are stand-ins: vLLM's own model files, copied with absolute
imports, optionally broken on purpose. All vLLM runs of this module share one worker
process (``verify_many``), so vLLM is imported once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfrewrite.verify import compare, engine, fixtures, runner

# The tail of LlamaForCausalLM.load_weights in vLLM's llama.py (occurs once).
LOAD_TAIL = "        loader = AutoWeightsLoader(self)\n        return loader.load_weights(weights)\n"
BROKEN = {
    # Load fails: the run errors out; the worker must recover for the next runs.
    "crash": {LOAD_TAIL: "        raise RuntimeError('boom in load_weights')\n"},
    # GPT-J-style rotary instead of NeoX: tokens diverge.
    "rope": {"is_neox_style = True": "is_neox_style = False"},
    # Final norm 0.1% off: same tokens, logprobs off by ~1e-3 (> tolerance).
    "scaled": {
        LOAD_TAIL: "        weights = ((n, w * 1.001 if n == 'model.norm.weight' else w)"
        " for n, w in weights)\n" + LOAD_TAIL
    },
}
DENSE_LAYER = {
    "MoERunner": 0,
    "GateLinear": 0,
    "QKVParallelLinear": 1,
    "MergedColumnParallelLinear": 1,
    "RowParallelLinear": 2,
    "ColumnParallelLinear": 0,
    "ReplicatedLinear": 0,
    "Linear": 0,
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, compare.VerifyReport]:
    root = tmp_path_factory.mktemp("harness")
    ckpt = fixtures.make_tiny_checkpoint("llama", root / "llama")
    names = [*BROKEN, "good"]  # the crash goes first: later runs prove recovery
    cases = [
        compare.VerifyCase(
            ckpt,
            fixtures.write_vllm_standin(root / name / "llama.py", "llama", BROKEN.get(name)),
        )
        for name in names
    ]
    out = dict(zip(names, compare.verify_many(cases)))
    for name, report in out.items():
        print(f"\n[{name}] {report.summary()}")
    return out


@pytest.mark.vllm
def test_standin_equals_hf_and_native(reports):
    r = reports["good"]
    assert r.ok, r.summary()
    assert r.generated_tokens == r.hf_tokens == r.native_tokens
    assert len(r.hf_tokens) == len(fixtures.DEFAULT_PROMPTS)
    assert all(len(t) == 16 for t in r.hf_tokens)
    assert len(set(r.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert r.logprob_diff_native is not None and r.logprob_diff_native <= compare.LOGPROB_TOL
    assert r.logprob_diff_hf is not None and r.logprob_diff_hf <= compare.LOGPROB_TOL
    assert r.generated_class.startswith("hfrewrite_generated_")
    assert r.generated_structure == [DENSE_LAYER] * 2
    assert r.structure_matches_native


@pytest.mark.vllm
def test_crashing_file_fails_and_worker_recovers(reports):
    r = reports["crash"]
    assert not r.ok
    assert "boom in load_weights" in r.errors["generated"]
    assert r.native_tokens is not None  # the native run after the crash still worked


@pytest.mark.vllm
def test_wrong_rope_fails_on_tokens(reports):
    r = reports["rope"]
    assert not r.ok
    assert r.generated_tokens != r.hf_tokens
    assert any("tokens differ" in p for p in r.problems)


@pytest.mark.vllm
def test_scaled_weight_fails_on_logprobs(reports):
    r = reports["scaled"]
    assert not r.ok
    assert r.logprob_diff_native > compare.LOGPROB_TOL
    assert any("logprobs differ" in p for p in r.problems)


# --------------------------------------------------------------------------- no vLLM


def _tensors(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize(
    "model_type, overrides, expect",
    [
        ("qwen2", {}, ["model.layers.0.self_attn.q_proj.bias"]),
        ("qwen3", {}, ["model.layers.0.self_attn.q_norm.weight"]),
        (
            "llama",
            {"attention_bias": True, "mlp_bias": True},
            [
                "model.layers.0.self_attn.o_proj.bias",
                "model.layers.0.mlp.down_proj.bias",
            ],
        ),
    ],
)
def test_tiny_checkpoint_randomizes_biases_and_norms(tmp_path, model_type, overrides, expect):
    ckpt = fixtures.make_tiny_checkpoint(model_type, tmp_path, **overrides)
    tensors = _tensors(ckpt)
    for name in expect + ["model.norm.weight"]:
        t = tensors[name]
        assert t.std() > 0.1 and not (t == 1).all(), name


def test_tiny_checkpoint_config(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ckpt = fixtures.make_tiny_checkpoint(
        "llama",
        tmp_path,
        head_dim=64,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_parameters=rope,
    )
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["head_dim"], config["num_key_value_heads"]) == (64, 1)
    assert config["rope_parameters"] == rope
    assert config["dtype"] == "float32"
    tensors = _tensors(ckpt)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 64, 128)
    assert "lm_head.weight" not in tensors  # tied: saved once
    assert fixtures.checkpoint_architecture(ckpt) == "LlamaForCausalLM"


def test_inspect_structure_counts_plain_linears():
    from torch import nn

    layer = nn.Module()
    layer.q, layer.k, layer.v = (nn.Linear(4, 4) for _ in range(3))
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([layer, layer])
    model.lm_head = nn.Linear(4, 8)  # outside the decoder layers: not counted
    assert engine.inspect_structure(model) == [{**dict.fromkeys(engine.LINEAR_KINDS, 0), "Linear": 3}] * 2


def test_report_rules_without_native():
    case = compare.VerifyCase(Path("ck"), Path("gen.py"))
    hf = {"tokens": [[1, 2, 3]], "logprobs": [[-1.0, -2.0, -3.0]]}
    gen = {**hf, "structure": [], "model_class": "hfrewrite_generated_0_x.X", "model_file": "gen.py"}
    ok = compare._report(case, "X", hf, gen, None, {})
    assert ok.ok and ok.native_tokens is None and ok.logprob_diff_hf == 0.0
    off = compare._report(case, "X", hf, {**gen, "logprobs": [[-1.0, -2.001, -3.0]]}, None, {})
    assert not off.ok and off.logprob_diff_hf == pytest.approx(1e-3)
    bad = compare._report(case, "X", hf, {**gen, "tokens": [[1, 2, 4]]}, None, {})
    assert not bad.ok and "step 2" in bad.problems[0]
    native_ran = compare._report(case, "X", hf, {**gen, "model_class": "vllm.x.X"}, None, {})
    assert not native_ran.ok  # the generated class must be what vLLM ran
    # ... from the very file under test (a plugin's copy of the class is not it)
    other_file = compare._report(case, "X", hf, {**gen, "model_file": "site/plugin/x.py"}, None, {})
    assert not other_file.ok and "not the generated class of gen.py" in other_file.problems[0]
    assert f"vLLM instantiated X from {Path('gen.py').resolve()}" in ok.summary()


# --------------------------------------------------------------------------- full matrix


def test_worker_timeout_reports_every_run(tmp_path):
    run = {"kind": "hf", "ckpt": str(tmp_path), "prompts": [[1]], "max_tokens": 1}
    results, info = runner.run_worker([run, {**run, "max_tokens": 2}], timeout=0.5)
    assert info["returncode"] is None
    assert all("timed out" in r["error"] for r in results)
