"""`convert --trust-remote-code` on Hub custom code: the repository's own modeling file is
the source, rewritten into vLLM layers under its own names; what cannot be is refused
(one line, exit 2, nothing written) with the reason."""

import json
import shutil
from pathlib import Path

import pytest

from hfrewrite.cli import main
from tests.analyze.kv_fused import mp_blocks, q_beside_kv

DATA = Path(__file__).resolve().parent / "data" / "custom_code"


def run(capsys, *argv) -> tuple[int, str]:
    code = main(["convert", "--no-verify", *map(str, argv)])
    return code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# what each repository's own code becomes: vLLM layers under its own names
EXPECTED = {
    "tinyllama_renamed": (
        '"qkv_proj": ["wq", "wk", "wv"],',  # its own SDPA helper, proven causal
        "q, k = self.rotary_emb(positions, q, k)",
        "self.attn = Attention(",
        '"gate_up_proj": ["w_gate", "w_up"],',
    ),
    "fusedqkv_postnorm": (
        "self.Wqkv = QKVParallelLinear(",  # the checkpoint's fused Wqkv, split in one call
        "self.fc1 = ColumnParallelLinear(",
        "x = x + self.post_attn_norm(self.attn(positions=positions, hidden_states=x))",
    ),
    "tinymoe": (
        "self.experts = FusedMoEFactory(",  # per-expert modules dispatched in a Python loop
        "top_k=config.num_experts_per_tok,",
        "renormalize=config.norm_topk_prob,",
        'activation="silu",',
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_custom_code_needs_the_flag_and_converts_from_its_own_source(name, tmp_path, capsys):
    repo = shutil.copytree(DATA / name, tmp_path / name)
    out = tmp_path / "out"
    code, err = run(capsys, repo, "-o", out)
    assert code == 2 and "refusing without --trust-remote-code" in err
    assert not out.exists()
    code, err = run(capsys, repo, "--trust-remote-code", "-o", out)
    assert code == 0, err
    text = (out / f"{name}.py").read_text()
    assert "from transformers import PretrainedConfig" in text and "from ." not in text
    assert "F.scaled_dot_product_attention(" not in text and "cache.update" not in text
    for line in EXPECTED[name]:
        assert line in text, line
    compile(text, f"{name}.py", "exec")


def test_custom_code_whose_classes_live_in_transformers_is_refused_with_the_class(tmp_path, capsys):
    # the repository's own class is a subclass of transformers' llama: analysis proves it,
    # but the modules it runs are defined in transformers' file, not the repository's
    repo = tmp_path / "myllama"
    repo.mkdir()
    (repo / "configuration_myllama.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MyLlamaConfig(LlamaConfig):\n    model_type = 'myllama'\n"
    )
    (repo / "modeling_myllama.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaForCausalLM\n\n"
        "from .configuration_myllama import MyLlamaConfig\n\n\n"
        "class MyLlamaForCausalLM(LlamaForCausalLM):\n    config_class = MyLlamaConfig\n"
    )
    config = {
        "model_type": "myllama",
        "architectures": ["MyLlamaForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_myllama.MyLlamaConfig",
            "AutoModelForCausalLM": "modeling_myllama.MyLlamaForCausalLM",
        },
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    }
    (repo / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code, err = run(capsys, repo, "--trust-remote-code", "-o", out)
    assert code == 2 and err.count("\n") == 1, err
    assert "LlamaModel is not defined in the repository's modeling_myllama.py" in err
    assert not out.exists()


def test_custom_code_through_the_attention_interface_converts_from_its_own_source(tmp_path, capsys):
    repo = shutil.copytree(DATA / "interface_llama", tmp_path / "interface_llama")
    out = tmp_path / "out"
    code, err = run(capsys, repo, "--trust-remote-code", "-o", out)
    assert code == 0, err
    text = (out / "interface_llama.py").read_text()
    header = " ".join(line.lstrip("# ") for line in text.splitlines()[:8])  # cut to 88 columns
    assert "Adapted from modeling_interface_llama.py of " in header
    assert "(Hub custom code, run under transformers " in header
    # the repository's configuration class is not importable from the file: its base annotates
    assert "InterfaceLlamaConfig" not in text and "from transformers import PretrainedConfig" in text
    assert "config: PretrainedConfig," in text
    assert "from ." not in text  # no relative import of the repository's modules
    # its own names, vLLM's layers: fused q/k/v and gate/up, the inline F.silu as SiluAndMul
    for line in (
        "class InterfaceAttention(nn.Module):",
        "self.qkv_proj = QKVParallelLinear(",
        '"qkv_proj": ["query_proj", "key_proj", "value_proj"],',
        '"gate_up_proj": ["gate", "up"],',
        'self.act_fn = get_act_and_mul_fn("silu")',
        "q, k = self.rotary_emb(positions, q, k)",  # its `rotate` helper, proven the rope
        'vllm_config=vllm_config, prefix=maybe_prefix(prefix, "backbone")',
    ):
        assert line in text, line
    compile(text, "interface_llama.py", "exec")
    # the header records --trust-remote-code: `check` regenerates it byte for byte
    assert main(["check", str(out / "interface_llama.py")]) == 0, capsys.readouterr().err


GELU_MLP = """class GeluMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
"""


def _split_repo(tmp_path, import_line: str, layers_head: str = "") -> Path:
    """fusedqkv_postnorm with its MLP class moved into the repository's own layers.py."""
    repo = shutil.copytree(DATA / "fusedqkv_postnorm", tmp_path / "split_repo")
    modeling = repo / "modeling_fusedqkv_postnorm.py"
    text = modeling.read_text()
    assert text.count(GELU_MLP) == 1
    marker = "from .configuration_fusedqkv_postnorm import"
    text = text.replace(GELU_MLP, "").replace(marker, f"{import_line}\n{marker}")
    modeling.write_text(text)
    head = (
        layers_head
        or '"""Layers of the repository."""\n\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n'
    )
    (repo / "layers.py").write_text(head + GELU_MLP)
    return repo


def test_the_repository_s_own_modules_are_inlined(tmp_path, capsys):
    repo = _split_repo(tmp_path, "from .layers import GeluMLP")
    out = tmp_path / "out"
    code, err = run(capsys, repo, "--trust-remote-code", "-o", out)
    assert code == 0, err
    text = (out / "fusedqkv_postnorm.py").read_text()
    assert "class GeluMLP(nn.Module):" in text and "self.fc1 = ColumnParallelLinear(" in text
    assert "from ." not in text
    compile(text, "fusedqkv_postnorm.py", "exec")


def test_a_name_on_both_sides_of_a_local_import_is_refused(tmp_path, capsys):
    clash = '"""Layers."""\n\nimport torch.nn.functional as F\nfrom torch import nn\n\n\ndef rotate_half(x):\n    return x\n\n\n'
    repo = _split_repo(tmp_path, "from .layers import GeluMLP", clash)
    code, err = run(capsys, repo, "--trust-remote-code", "-o", tmp_path / "out")
    assert code == 2 and "rotate_half is defined both in the modeling file and in layers.py" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("layout", "rows"), [("per_head", "kv_heads, 2"), ("blocks", "2, kv_heads")])
def test_a_q_beside_one_k_v_linear_loads_into_qkv_proj_split_by_its_proven_layout(
    layout, rows, tmp_path, capsys
):
    # (a name of its own: transformers keeps a repository's modules by its folder's name)
    repo = shutil.copytree(DATA / "fusedqkv_postnorm", tmp_path / f"q_kv_{layout}")
    source = repo / "modeling_fusedqkv_postnorm.py"
    source.write_text(q_beside_kv(source.read_text(), layout))
    code, err = run(capsys, repo, "--trust-remote-code", "-o", tmp_path / "out")
    assert code == 0, err
    text = (tmp_path / "out" / "fusedqkv_postnorm.py").read_text()
    for line in (
        "self.qkv_proj = QKVParallelLinear(",
        '".wq": (".qkv_proj", "q"),',
        '".wkv_k": (".qkv_proj", "k"),',
        '".wkv_v": (".qkv_proj", "v"),',
        f"rows = tensor.reshape({rows}, -1, *tensor.shape[1:])",
        "self._kv_split(self._base_model_names(weights)),",
    ):
        assert line in text, line
    assert "self.wkv" not in text and "self.wq(" not in text


def test_k_and_v_of_one_linear_in_another_order_are_refused(tmp_path, capsys):
    repo = shutil.copytree(DATA / "fusedqkv_postnorm", tmp_path / "v_k_blocks")
    source = repo / "modeling_fusedqkv_postnorm.py"
    swapped = q_beside_kv(source.read_text(), "blocks").replace("k, v = self.wkv(x)", "v, k = self.wkv(x)")
    source.write_text(swapped)
    code, err = run(capsys, repo, "--trust-remote-code", "-o", tmp_path / "out")
    assert code == 2 and "wkv feeds k and v neither as [k; v] nor per kv head" in err, err
    assert not (tmp_path / "out").exists()


def _mp_blocks_repo(tmp_path: Path, order: str) -> Path:
    repo = shutil.copytree(DATA / "fusedqkv_postnorm", tmp_path / f"mp_{order.replace(', ', '')}")
    source = repo / "modeling_fusedqkv_postnorm.py"
    source.write_text(mp_blocks(source.read_text(), order))
    config = json.loads((repo / "config.json").read_text())
    (repo / "config.json").write_text(
        json.dumps({**config, "num_key_value_heads": config["num_attention_heads"]})
    )
    return repo


def test_four_blocks_of_q_v_k_load_reordered_into_qkv_proj(tmp_path, capsys):
    code, err = run(
        capsys, _mp_blocks_repo(tmp_path, "q, v, k"), "--trust-remote-code", "-o", tmp_path / "out"
    )
    assert code == 0, err
    text = (tmp_path / "out" / "fusedqkv_postnorm.py").read_text()
    assert "q, v, k = tensor.reshape(4, 3, -1, *tensor.shape[1:]).unbind(1)" in text
    assert "self._qkv_mp_blocks_to_blocks(self._base_model_names(weights))" in text


def test_a_layout_that_reads_per_head_only_at_four_heads_is_refused(tmp_path, capsys):
    # four blocks of [q; k; v]: with four heads, exactly the per-head layout; with eight, not
    code, err = run(
        capsys, _mp_blocks_repo(tmp_path, "q, k, v"), "--trust-remote-code", "-o", tmp_path / "out"
    )
    assert code == 2, err
    assert "Wqkv is laid out as q/k/v interleaved per head in the checkpoint" in err, err
    assert "with 4 heads, but not with 8" in err, err
    assert not (tmp_path / "out").exists()


ROPE_K = "        k = apply_rope(k, positions, self.theta)\n"


def _q_scaled_repo(tmp_path: Path, name: str, factor: str) -> Path:
    """fusedqkv_postnorm with q scaled after the rope by ``factor`` (a [b, 1, t, 1] tensor)."""
    repo = shutil.copytree(DATA / "fusedqkv_postnorm", tmp_path / name)
    source = repo / "modeling_fusedqkv_postnorm.py"
    text = source.read_text()
    assert text.count(ROPE_K) == 1
    source.write_text(text.replace(ROPE_K, f"{ROPE_K}        q = q * {factor}\n"))
    return repo


def test_q_scaled_per_token_by_a_function_of_the_positions_is_carried_after_the_rope(tmp_path, capsys):
    # Llama-4's attention temperature, written inline: one factor per token, from positions alone
    factor = "(1 + 0.1 * torch.log(1 + torch.floor(positions / 2)))[:, None, :, None]"
    code, err = run(
        capsys, _q_scaled_repo(tmp_path, "q_scaled", factor), "--trust-remote-code", "-o", tmp_path / "out"
    )
    assert code == 0, err
    text = (tmp_path / "out" / "fusedqkv_postnorm.py").read_text()
    order = [
        "q, k = self.rotary_emb(positions, q, k)",
        "# q scaled per token by the source's function of the positions, after the rope",
        "q = q * (1 + 0.1 * torch.log(1 + torch.floor(positions[None] / 2)))[",
        "].reshape(-1, 1)",
        "attn_output = self.attn(q, k, v)",
    ]
    at = [text.find(line) for line in order]
    assert -1 not in at and at == sorted(at), at


def test_q_scaled_by_something_other_than_the_positions_is_refused(tmp_path, capsys):
    # a factor per token computed from the hidden states: not a function of the positions
    factor = "torch.sigmoid(x.mean(-1))[:, None, :, None]"
    code, err = run(
        capsys, _q_scaled_repo(tmp_path, "q_gated", factor), "--trust-remote-code", "-o", tmp_path / "out"
    )
    assert code == 2, err
    assert "position-dependent op is not applied to exactly q and k" in err or "rotary embedding" in err, err
    assert not (tmp_path / "out").exists()


MLP_INIT = "        self.mlp = GeluMLP(config)\n"
MLP_CALL = "        return x + self.post_mlp_norm(self.mlp(x))\n"
INLINE_INIT = """        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
"""


def _inline_mlp_repo(tmp_path: Path, name: str, call: str) -> Path:
    """fusedqkv_postnorm with its MLP written into the layer (OPT's and BioGPT's way)."""
    repo = shutil.copytree(DATA / "fusedqkv_postnorm", tmp_path / name)
    source = repo / "modeling_fusedqkv_postnorm.py"
    text = source.read_text()
    assert text.count(MLP_INIT) == 1 and text.count(MLP_CALL) == 1
    source.write_text(text.replace(MLP_INIT, INLINE_INIT).replace(MLP_CALL, call))
    return repo


def test_an_mlp_written_into_the_layer_is_sharded_in_place(tmp_path, capsys):
    call = "        h = F.gelu(self.fc1(x))\n        return x + self.post_mlp_norm(self.fc2(h))\n"
    code, err = run(
        capsys, _inline_mlp_repo(tmp_path, "inline_mlp", call), "--trust-remote-code", "-o", tmp_path / "out"
    )
    assert code == 0, err
    text = (tmp_path / "out" / "fusedqkv_postnorm.py").read_text()
    for line in (
        "self.fc1 = ColumnParallelLinear(",
        "self.fc2 = RowParallelLinear(",
        "h = F.gelu(self.fc1(x)[0])",
        "return x + self.post_mlp_norm(self.fc2(h)[0])",
    ):
        assert line in text, line


def test_an_mlp_in_the_layer_whose_intermediate_is_read_elsewhere_is_refused(tmp_path, capsys):
    # the intermediate would be a column shard under tensor parallelism: its mean is not
    call = "        h = F.gelu(self.fc1(x))\n        return x + self.post_mlp_norm(self.fc2(h)) + h.mean(-1, keepdim=True)\n"
    code, err = run(
        capsys,
        _inline_mlp_repo(tmp_path, "inline_mlp_read", call),
        "--trust-remote-code",
        "-o",
        tmp_path / "out",
    )
    assert code == 2, err
    assert "reads fc1's output other than through the act into fc2" in err, err
    assert not (tmp_path / "out").exists()
