"""emit/taken_init.py: an ``__init__`` switch replaced by the branch the traced config took."""

from __future__ import annotations

import ast
from textwrap import dedent

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.taken_init import taken_init_branches

BLOCK = dedent(
    """\
    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.use_expert_bias = config.use_expert_bias
            if self.use_expert_bias:
                self.expert_bias = nn.Buffer(torch.zeros(config.num_experts))
    """
)


def _init(source: str) -> tuple[cst.ClassDef, cst.FunctionDef]:
    cls = t.find_class(cst.parse_module(source), "Block")
    return cls, t.find_method(cls, "__init__")


def test_a_switch_on_an_attribute_set_from_the_config_is_taken_and_guarded():
    """LFM2-MoE builds its expert bias under ``if self.use_expert_bias:``; the analysis proved
    ``config.use_expert_bias`` true: the branch is inlined, the other configs refused."""
    cls, init = _init(BLOCK)
    taken, guards = taken_init_branches(init, (("config.use_expert_bias", True),), "Block", t.init_exprs(cls))
    code = t.code(taken)
    assert "if self.use_expert_bias" not in code and "self.expert_bias = nn.Buffer(" in code
    assert guards.startswith("if not (config.use_expert_bias):\n    raise NotImplementedError(")


def test_without_the_classs_expressions_the_attribute_test_is_not_matched():
    _, init = _init(BLOCK)
    taken, guards = taken_init_branches(init, (("config.use_expert_bias", True),), "Block")
    assert t.code(taken) == t.code(init) and guards == ""


def test_an_optional_part_built_under_a_config_test_is_taken_and_guarded():
    """Granite-4.0-H builds its rotary embedding as ``Part(config) if <test> else None``: on a
    config traced without it, the part is None and the configs that build it are refused."""
    source = dedent(
        """\
        class Block(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.rotary_emb = Rotary(config) if config.position_embedding_type == "rope" else None
        """
    )
    from hfrewrite.analyze.branches import _optional_part

    assert _optional_part(ast.parse('Rotary(config) if config.kind == "rope" else None', mode="eval").body)
    assert not _optional_part(ast.parse("A(config) if config.kind else B(config)", mode="eval").body)
    _, init = _init(source)
    taken, guards = taken_init_branches(init, (('config.position_embedding_type == "rope"', False),), "Block")
    assert "self.rotary_emb = None\n" in t.code(taken)
    assert guards.startswith('if (config.position_embedding_type == "rope"):\n    raise NotImplementedError(')
