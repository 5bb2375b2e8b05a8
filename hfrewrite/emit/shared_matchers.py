"""libcst matchers several passes share: shapes found by their structure, not their text."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

SUPER_INIT = m.Attribute(
    value=m.Call(func=m.Name("super"), args=[]), attr=m.Name("__init__")
)  # super().__init__
NN_MODULE = m.Attribute(value=m.Name("nn"), attr=m.Name("Module"))
# a statement line opening with `super().__init__(...)`; SUPER_INIT_BARE: `super().__init__()` alone
SUPER_INIT_CALL = m.SimpleStatementLine(body=[m.Expr(m.Call(func=SUPER_INIT)), m.ZeroOrMore()])
SUPER_INIT_BARE = m.SimpleStatementLine(body=[m.Expr(m.Call(func=SUPER_INIT, args=[]))])
ACT2FN_ENTRY = m.Subscript(value=m.Name("ACT2FN"))  # ACT2FN[...]


def nn_call(cls: str) -> m.Call:
    """``nn.<cls>(...)``: a torch module built in an ``__init__`` (``nn_call("Linear")``)."""
    return m.Call(func=m.Attribute(value=m.Name("nn"), attr=m.Name(cls)))


def builds(node: cst.CSTNode | None, matcher: m.BaseMatcherNode) -> bool:
    """Whether ``node`` (None: nothing was found) matches ``matcher``."""
    return node is not None and m.matches(node, matcher)


def self_attr(name: str) -> m.Attribute:
    """``self.<name>``."""
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


# `qkv, _ = self.<projection>(...)`: the fused projection fuse_qkv writes, where
# vllm_attention takes the forward over
QKV_PROJECTION = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[
                m.AssignTarget(target=m.Tuple(elements=[m.Element(m.Name("qkv")), m.Element(m.Name("_"))]))
            ],
            value=m.Call(func=m.Attribute(value=m.Name("self"))),
        )
    ]
)

# `tp_size = get_tensor_model_parallel_world_size()`: the local fuse_qkv's prologue binds
TP_SIZE_LOCAL = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("tp_size"))],
            value=m.Call(func=m.Name("get_tensor_model_parallel_world_size"), args=[]),
        )
    ]
)


def same(*nodes: cst.CSTNode | None) -> bool:
    """Whether ``nodes`` are one tree (compared node by node; None only with None)."""
    first = nodes[0]
    return all(
        (n is None and first is None) or (n is not None and first is not None and n.deep_equals(first))
        for n in nodes[1:]
    )
