"""fuse_gate_up: act(gate(x)) * up(x) -> MergedColumnParallelLinear + *AndMul."""

import pytest
from harness import apply, assert_rewrites, rewrite
from hfrewrite.passes import fuse_gate_up
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE_LLAMA_MLP = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj
"""

AFTER_LLAMA_MLP = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=config.mlp_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = get_act_and_mul_fn(config.hidden_act)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        down_proj = self.down_proj(self.act_fn(gate_up))
        return down_proj
"""


def test_llama_mlp():
    assert_rewrites(fuse_gate_up, BEFORE_LLAMA_MLP, AFTER_LLAMA_MLP, llama_like())


BEFORE_UP_TIMES_ACT_ORDER = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))
        return down_proj
"""

AFTER_UP_TIMES_ACT_ORDER = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=config.mlp_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = get_act_and_mul_fn(config.hidden_act)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        down_proj = self.down_proj(self.act_fn(gate_up))
        return down_proj
"""


def test_up_times_act_order():
    assert_rewrites(fuse_gate_up, BEFORE_UP_TIMES_ACT_ORDER, AFTER_UP_TIMES_ACT_ORDER, llama_like())


BEFORE_OTHER_CLASS_UNTOUCHED = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class VisionMLP(nn.Module):
    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)) * self.up_proj(x))
"""

AFTER_OTHER_CLASS_UNTOUCHED = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=config.mlp_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = get_act_and_mul_fn(config.hidden_act)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        down_proj = self.down_proj(self.act_fn(gate_up))
        return down_proj


class VisionMLP(nn.Module):
    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)) * self.up_proj(x))
"""


def test_other_class_untouched():
    assert_rewrites(fuse_gate_up, BEFORE_OTHER_CLASS_UNTOUCHED, AFTER_OTHER_CLASS_UNTOUCHED, llama_like())


NOT_ACT2FN = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = nn.GELU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj
"""


def test_activation_module_built_otherwise_gets_the_activation_the_analysis_replayed():
    # `nn.GELU()` instead of ACT2FN[config.hidden_act]: the key is the plan's activation (the
    # analysis replays the module on the traced values), not a spelling of the source
    out = rewrite(fuse_gate_up, NOT_ACT2FN, llama_like())
    assert 'self.act_fn = get_act_and_mul_fn("silu")' in out
    assert "nn.GELU" not in out


REFUSED_DIFFERENT_INPUTS = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x + 1))
        return down_proj
"""


def test_refuses_different_inputs():
    with pytest.raises(HfrewriteError, match="only use"):
        rewrite(fuse_gate_up, REFUSED_DIFFERENT_INPUTS, llama_like())


REFUSED_DIFFERENT_BIAS = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj
"""


def test_refuses_different_bias():
    with pytest.raises(HfrewriteError, match="bias"):
        rewrite(fuse_gate_up, REFUSED_DIFFERENT_BIAS, llama_like())


def test_refuses_gate_and_up_reading_different_inputs():
    # act(gate(y)) * up(x) is not a gated MLP over one input: nothing to merge
    source = BEFORE_LLAMA_MLP.replace("self.gate_proj(x)", "self.gate_proj(y)").replace(
        "def forward(self, x)", "def forward(self, x, y)"
    )
    with pytest.raises(HfrewriteError, match="is not the only use of gate_proj/up_proj"):
        rewrite(fuse_gate_up, source, llama_like())


def test_gate_and_up_sizes_spelled_differently_are_listed_apart():
    source = BEFORE_LLAMA_MLP.replace(
        "self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size",
        "self.up_proj = nn.Linear(config.hidden_size, config.ffn_size",
    )
    after = rewrite(fuse_gate_up, source, llama_like())
    assert "            [config.intermediate_size, config.ffn_size],\n" in after


def test_reports_one_match():
    assert apply(fuse_gate_up, BEFORE_LLAMA_MLP, llama_like()).matches == 1


@pytest.mark.parametrize("up_in", ["config.model_dim", "config.embed_dim"])  # sorting after and before
def test_refuses_gate_and_up_reading_different_input_sizes(up_in):
    source = BEFORE_LLAMA_MLP.replace(
        "self.up_proj = nn.Linear(config.hidden_size,",
        f"self.up_proj = nn.Linear({up_in},",
    )
    with pytest.raises(HfrewriteError, match="read different input sizes"):
        rewrite(fuse_gate_up, source, llama_like())


def test_refuses_two_gated_products_in_one_statement():
    # act(gate(x)) * up(x) + act(gate(y)) * up(y): one gate_up call cannot stand for both
    source = BEFORE_LLAMA_MLP.replace(
        "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",
        "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)"
        " + self.act_fn(self.gate_proj(y)) * self.up_proj(y))",
    ).replace("def forward(self, x)", "def forward(self, x, y)")
    with pytest.raises(HfrewriteError, match="is not the only use"):
        rewrite(fuse_gate_up, source, llama_like())


@pytest.mark.parametrize("which", ["gate_proj", "up_proj"])
def test_refuses_a_gate_or_up_of_another_class(which):
    source = BEFORE_LLAMA_MLP.replace(f"self.{which} = nn.Linear(", f"self.{which} = LoraLinear(")
    with pytest.raises(HfrewriteError, match="are not nn.Linear"):
        rewrite(fuse_gate_up, source, llama_like())
