"""A dense MLP whose act vLLM has no *AndMul for keeps that act as written between
column-sharded projections when each output lane is proven to read its gate/up lanes alone
(MiniMax-M3's clamped SwiGLU); one no rewrite fits keeps the source's class when each token
is proven to be computed alone on vLLM's flat [tokens, hidden] batch; otherwise the model is
refused with the rewrite's reason and why the class cannot be kept."""

import shutil
from pathlib import Path

import pytest
import transformers

from hfrewrite.analyze import model as analysis
from hfrewrite.analyze.mlp_forms import KeptMlp, MlpForm
from hfrewrite.cli import main
from hfrewrite.errors import HfrewriteError
from tests.analyze.carried_mlps import clamped_shared_expert, mlp_variant, tempered_moe

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code"
NAME = "tinyllama_renamed"


def _repo(tmp_path, monkeypatch, variant: str) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a directory name of its own: transformers imports a repository's code once per name
    repo = shutil.copytree(DATA / NAME, tmp_path / f"{NAME}_{variant}_{tmp_path.name}")
    source = repo / f"modeling_{NAME}.py"
    source.write_text(mlp_variant(source.read_text(), variant))
    return repo


def _convert(repo: Path, out: Path) -> str:
    assert main(["convert", str(repo), "--trust-remote-code", "--no-verify", "-o", str(out)]) == 0
    return (out / f"{NAME}.py").read_text()


def test_a_clamped_swiglu_on_one_gate_up_linear_runs_as_written_on_merged_columns(tmp_path, monkeypatch):
    repo = _repo(tmp_path, monkeypatch, "clamped_swiglu")
    plan = analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    assert (plan.mlp.form, plan.mlp.fused_gate_up, plan.mlp.up.attr) == (MlpForm.PAIRWISE, True, "w_gate_up")
    text = _convert(repo, tmp_path / "out")
    for line in (
        "self.w_gate_up = MergedColumnParallelLinear(",
        "[2 * config.intermediate_size // 2] * 2,",
        "self.w_down = RowParallelLinear(",
        "gate, up = self.w_gate_up(x)[0].chunk(2, dim=-1)",
        "gate = gate.clamp(max=self.limit)",
        "return self.w_down((up + 1.0) * gate * torch.sigmoid(gate * self.alpha))[0]",
    ):
        assert line in text, line
    assert '"w_gate_up": ["w_gate_up"]' in text  # the checkpoint's [gate; up] tensor, split at load


def test_an_mlp_with_an_inner_norm_runs_on_gathered_columns(tmp_path, monkeypatch):
    # NormFormer's FFN: the LayerNorm over the whole intermediate is kept and given every
    # rank's columns; gate and up merged with vLLM's *AndMul, down taking the whole input
    repo = _repo(tmp_path, monkeypatch, "inner_norm")
    plan = analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    assert (plan.mlp.form, plan.mlp.inner_norm, plan.mlp.down.attr) == (
        MlpForm.AND_MUL,
        "inner_norm",
        "w_down",
    )
    assert plan.kept_mlps == ()
    text = _convert(repo, tmp_path / "out")
    for line in (
        "self.inner_norm = nn.LayerNorm(config.intermediate_size)",
        "self.gate_up_proj = MergedColumnParallelLinear(",
        "input_is_parallel=False,",
        "self.inner_norm(tensor_model_parallel_all_gather(self.act_fn(gate_up)))",
    ):
        assert line in text, line
    assert "ReplicatedLinear" not in text


def test_a_norm_mixing_tokens_inside_an_mlp_is_not_gathered(tmp_path, monkeypatch):
    # the same block with a norm over the sequence: no gather before it computes the source's
    repo = _repo(tmp_path, monkeypatch, "inner_norm")
    modeling = next(repo.glob("modeling_*.py"))
    modeling.write_text(
        modeling.read_text().replace(
            "self.inner_norm = nn.LayerNorm(config.intermediate_size)", "self.inner_norm = SequenceNorm()"
        )
        + "\n\nclass SequenceNorm(nn.Module):\n    def forward(self, x):\n"
        "        return x - x.mean(dim=-2, keepdim=True)\n"
    )
    plan = analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    assert plan.mlp is None or plan.mlp.inner_norm is None, plan.mlp


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        ("token_shift", "a token's output depends on other tokens"),
        ("batch_layout", "it fails on vLLM's [tokens, hidden] layout (ValueError)"),
    ],
)
def test_an_mlp_that_cannot_run_per_token_refuses_the_model(tmp_path, monkeypatch, variant, why):
    repo = _repo(tmp_path, monkeypatch, variant)
    with pytest.raises(HfrewriteError) as err:
        analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    message = str(err.value)
    assert "FeedForward: fuse_gate_up:" in message and f"the source's block cannot be kept: {why}" in message


def test_a_clamped_shared_expert_beside_the_experts_is_sharded_with_its_own_code(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA / "tinymoe", tmp_path / f"tinymoe_shared_{tmp_path.name}")
    source = repo / "modeling_tinymoe.py"
    source.write_text(clamped_shared_expert(source.read_text()))
    plan = analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    assert plan.moe.shared_expert == "shared_expert"
    assert (plan.mlp.module_class, plan.mlp.form, plan.mlp.fused_gate_up) == (
        "TinyMoeSharedExpert",
        MlpForm.PAIRWISE,
        True,
    )
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "--no-verify", "-o", str(out)]) == 0
    text = (out / "tinymoe.py").read_text()
    for line in (
        "self.gate_up = MergedColumnParallelLinear(",
        "reduce_results=reduce_results,",  # vLLM's MoE runner sums the shared part with the experts'
        "gate, up = self.gate_up(x)[0].chunk(2, dim=-1)",
        "shared_experts=self.shared_expert,",
    ):
        assert line in text, line


def _tempered(tmp_path, monkeypatch, dense: bool) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA / "tinymoe", tmp_path / f"tinymoe_tempered_{dense}_{tmp_path.name}")
    source = repo / "modeling_tinymoe.py"
    source.write_text(tempered_moe(source.read_text(), dense))
    return repo


def test_experts_under_a_routing_vllm_does_not_compute_are_kept_when_one_graph(tmp_path, monkeypatch):
    repo = _tempered(tmp_path, monkeypatch, dense=True)
    plan = analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    assert plan.moe is None and plan.mlp is None
    (kept,) = [d for d in plan.declined if d.pattern == "carried_mlp"]
    assert kept.module_class == "TinyMoeSparseBlock" and kept.reason.startswith("fuse_experts: ")
    assert plan.kept_mlps == (KeptMlp("TinyMoeSparseBlock", ("router",)),)


@pytest.mark.parametrize("disabled", [None, "TORCHDYNAMO_DISABLE"])
def test_experts_in_a_loop_over_the_chosen_ones_are_refused_for_torch_compile(
    tmp_path, monkeypatch, disabled
):
    # runs per token on vLLM's flat batch, but branches on the values: vLLM's torch.compile
    # (fullgraph) of the model would fail on it; torch.compile turned off in the environment
    # (the tests' vLLM workers run so) must not make the proof pass without compiling
    if disabled:
        monkeypatch.setenv(disabled, "1")
    repo = _tempered(tmp_path, monkeypatch, dense=False)
    with pytest.raises(HfrewriteError) as err:
        analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    message = str(err.value)
    assert "TinyMoeSparseBlock: fuse_experts:" in message
    assert "the source's block cannot be kept: torch.compile cannot capture it as one graph" in message


def test_a_sequential_mlp_is_built_as_a_column_and_row_parallel_pair(tmp_path, monkeypatch):
    repo = _repo(tmp_path, monkeypatch, "sequential")
    plan = analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    assert plan.mlp is None and plan.kept_mlps == (KeptMlp("Sequential", (), parallel_at="ffn"),)
    text = _convert(repo, tmp_path / "out")
    assert "self.ffn = ParallelSequential(\n            lambda: FeedForward(config)," in text
    assert "class ParallelSequential(nn.Module):" in text


def test_a_sequential_mlp_with_an_inner_norm_stays_as_the_source_builds_it(tmp_path, monkeypatch):
    repo = _repo(tmp_path, monkeypatch, "sequential_inner_norm")
    plan = analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))
    assert plan.kept_mlps == (KeptMlp("Sequential", ()),)
    text = _convert(repo, tmp_path / "out")
    assert "self.ffn = FeedForward(config)" in text and "ParallelSequential" not in text
