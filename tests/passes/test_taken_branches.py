"""taken_branches: a config switch around the projections becomes the branch the traced
config took (config_guards then refuses the configs taking the other)."""

import dataclasses
from textwrap import dedent

import libcst as cst
from hfrewrite.passes import taken_branches
from plans import llama_like

from hfrewrite.emit.pass_api import PassContext

SOURCE = """\
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.norm_topk_prob = config.norm_topk_prob

    def forward(self, x):
        if self.config.pretraining_tp > 1:
            slices = self.q_proj.weight.split(4, dim=0)
            q = torch.cat([F.linear(x, s) for s in slices], dim=-1)
        else:
            q = self.q_proj(x)
        if self.norm_topk_prob:
            q = q / 2
        return q
"""


def _run(custom: bool, value: bool = False):
    plan = dataclasses.replace(
        llama_like(),
        forward_switches=(
            ("LlamaAttention", "config.pretraining_tp > 1", value),
            ("LlamaAttention", "config.norm_topk_prob", True),
        ),
    )
    ctx = PassContext(plan, "modeling_test.py", custom_code=custom)
    return taken_branches.run(cst.parse_module(dedent(SOURCE)), ctx)


def test_the_traced_branch_around_the_projections_is_kept():
    out = _run(custom=True).module.code
    assert "pretraining_tp" not in out and "slices" not in out
    assert "        q = self.q_proj(x)\n" in out
    assert "if self.norm_topk_prob:" in out  # a switch around no projection: the other passes' own


def test_the_other_value_keeps_the_other_branch():
    out = _run(custom=True, value=True).module.code
    assert "slices = self.q_proj.weight.split(4, dim=0)" in out and "q = self.q_proj(x)" not in out


def test_transformers_own_models_take_the_traced_branch_too():
    """BLOOM's ``if self.pretraining_tp > 1 and self.slow_but_exact:`` around its projections."""
    assert _run(custom=False).module.code == _run(custom=True).module.code != dedent(SOURCE)


INIT_SOURCE = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.is_cross_attention = is_cross_attention
        if self.is_cross_attention:
            self.q_proj = nn.Linear(4, 8)
            self.kv = nn.Linear(4, 8)
        else:
            self.q_proj = nn.Linear(4, 24)

    def forward(self, x):
        if self.is_cross_attention:
            return self.q_proj(x) + 1
        return self.q_proj(x)
"""


def test_projections_built_under_a_constructor_flag_take_the_traced_branch_in_init_too():
    """gpt_bigcode's ``if self.is_cross_attention:`` around ``self.c_attn = ...``: the flag's
    traced value (in the form ``__init__`` reads it: the parameter) picks the branch in both
    methods, and the row is reported once."""
    plan = dataclasses.replace(
        llama_like(), forward_switches=(("LlamaAttention", "is_cross_attention", False),)
    )
    result = taken_branches.run(
        cst.parse_module(dedent(INIT_SOURCE)), PassContext(plan, "modeling_test.py", custom_code=False)
    )
    assert result.module.code == dedent(INIT_SOURCE).replace(
        "        if self.is_cross_attention:\n"
        "            self.q_proj = nn.Linear(4, 8)\n"
        "            self.kv = nn.Linear(4, 8)\n"
        "        else:\n"
        "            self.q_proj = nn.Linear(4, 24)\n",
        "        self.q_proj = nn.Linear(4, 24)\n",
    ).replace("        if self.is_cross_attention:\n            return self.q_proj(x) + 1\n", "")
    assert [r.fused for r in result.fused] == ["config switch `is_cross_attention`: the traced branch kept"]


def test_config_guards_refuse_each_condition_once():
    """GPT-2 sets ``self.is_causal = not is_cross_attention`` and tests ``self.is_cross_attention``:
    two switches (``is_cross_attention`` False, ``not is_cross_attention`` True) refusing the
    same condition make one guard, placed before anything is built."""
    from hfrewrite.passes import config_guards

    source = dedent(
        """\
        class LlamaAttention(nn.Module):
            def __init__(self, config, is_cross_attention=False):
                super().__init__()
                self.q_proj = nn.Linear(4, 4)

            def forward(self, x):
                return self.q_proj(x)
        """
    )
    plan = dataclasses.replace(
        llama_like(),
        forward_switches=(
            ("LlamaAttention", "is_cross_attention", False),
            ("LlamaAttention", "not is_cross_attention", True),
        ),
    )
    out = config_guards.run(cst.parse_module(source), PassContext(plan, "modeling_test.py")).module.code
    assert out.count("if is_cross_attention:\n") == 1
    assert out.index("if is_cross_attention:") < out.index("self.q_proj = nn.Linear(4, 4)")


def test_config_guards_leave_implementation_selectors_alone():
    """Falcon tests ``self.config._attn_implementation == "sdpa"``: a choice of how transformers
    computes the attention the rewrite replaced, so no guard; a model switch beside it gets one."""
    from hfrewrite.passes import config_guards

    source = dedent(
        """\
        class LlamaAttention(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.q_proj = nn.Linear(4, 4)

            def forward(self, x):
                return self.q_proj(x)
        """
    )
    plan = dataclasses.replace(
        llama_like(),
        forward_switches=(
            ("LlamaAttention", 'config._attn_implementation == "sdpa"', False),
            ("LlamaAttention", "config.multi_query", True),
        ),
    )
    out = config_guards.run(cst.parse_module(source), PassContext(plan, "modeling_test.py")).module.code
    assert "_attn_implementation" not in out
    assert "if not (config.multi_query):\n" in out


_LAYER_KIND = dedent(
    """\
    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.is_attention_layer = config.layer_types[layer_idx] == "full_attention"
            if self.is_attention_layer:
                self.self_attn = Attention(config)
            else:
                self.conv = ShortConv(config)

        def forward(self, positions, hidden_states):
            return self.self_attn(positions, hidden_states)
    """
)
_KIND_TEST = 'config.layer_types[layer_idx] == "full_attention"'


def test_config_guards_refuse_a_forward_switch_that_init_also_tests():
    """LFM2 tests its layer kind in ``__init__`` (what to build) and in forward (what to call):
    a template forward that calls only the attention drops the second, so the ``if`` that
    ``__init__`` still makes does not carry it, and configs with other kinds are refused."""
    from hfrewrite.passes import config_guards

    plan = dataclasses.replace(llama_like(), forward_switches=(("LlamaDecoderLayer", _KIND_TEST, True),))
    out = config_guards.run(cst.parse_module(_LAYER_KIND), PassContext(plan, "modeling_test.py")).module.code
    guard = f"if not ({_KIND_TEST}):\n"
    assert guard in out and out.index(guard) < out.index("self.is_attention_layer =")


def test_config_guards_leave_a_switch_only_init_tests_to_init():
    """A switch of ``__init__`` alone (GPT-2's scale, StableLM's second norm) is carried by the
    ``if`` the emitted ``__init__`` still makes: no guard."""
    from hfrewrite.passes import config_guards

    plan = dataclasses.replace(
        llama_like(),
        forward_switches=(("LlamaDecoderLayer", _KIND_TEST, True),),
        init_switches_tested=(("LlamaDecoderLayer", _KIND_TEST),),
    )
    result = config_guards.run(cst.parse_module(_LAYER_KIND), PassContext(plan, "modeling_test.py"))
    assert result.module.code == _LAYER_KIND and not result.fused


def test_config_guards_read_a_conditional_attribute_as_one_operand():
    """Cohere2's ``self.sliding_window`` is ``config.sliding_window if <kind> else None``: the
    carried ``if self.sliding_window is not None:`` is that whole expression tested, not a
    conditional whose else branch is ``None is not None``."""
    from hfrewrite.passes import config_guards

    source = dedent(
        """\
        class LlamaAttention(nn.Module):
            def __init__(self, config, layer_idx):
                super().__init__()
                self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "s" else None

            def forward(self, q):
                if self.sliding_window is not None:
                    q = q + 1
                return q
        """
    )
    test = '(config.sliding_window if config.layer_types[layer_idx] == "s" else None) is not None'
    plan = dataclasses.replace(llama_like(), forward_switches=(("LlamaAttention", test, True),))
    result = config_guards.run(cst.parse_module(source), PassContext(plan, "modeling_test.py"))
    assert result.module.code == source and not result.fused
