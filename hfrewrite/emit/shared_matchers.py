"""libcst matchers several passes share: shapes found by their structure, not their text."""

from __future__ import annotations

import libcst.matchers as m

SUPER_INIT = m.Attribute(
    value=m.Call(func=m.Name("super"), args=[]), attr=m.Name("__init__")
)  # super().__init__
NN_MODULE = m.Attribute(value=m.Name("nn"), attr=m.Name("Module"))

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
