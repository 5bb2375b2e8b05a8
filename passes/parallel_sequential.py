"""Build a kept ``nn.Sequential`` MLP as vLLM's column- and row-parallel pair.

Matches, in the decoder layer's ``__init__``, the one ``self.<attr> = <expr>`` of the
attribute the analysis proved an ``nn.Sequential`` of an up projection, layers without
weights and a down projection, the act between them per lane (``KeptMlp.parallel_at``:
CTRL's ``self.ffn = point_wise_feed_forward_network(config.n_embd, config.dff)``).

Emits ``self.<attr> = ParallelSequential(lambda: <expr>, quant_config=quant_config,
prefix=f"{prefix}.<attr>")`` and, before the layer class, the template's
``ParallelSequential`` (templates/mlp.py): it runs the source's expression on the meta
device, reads the two Linears' sizes and biases off what it built, and builds
``ColumnParallelLinear`` and ``RowParallelLinear`` in their places under the same indices,
the source's layers between them as they are. The layer's forward calls the block as before.

Preconditions: the attribute is assigned once in the layer's ``__init__``, outside any
block; otherwise the container stays as the source builds it (its Linears whole on every
rank, as ``carry_mlp`` proved it may).
"""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult
from hfrewrite.emit.templates_io import insert_before, template_class

NAME = "parallel_sequential"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    attrs = sorted({kept.parallel_at for kept in ctx.plan.kept_mlps if kept.parallel_at})
    layer = ctx.plan.decoder_layer.module_class
    if not attrs:
        return PassResult(module=module)
    cls = t.find_class(module, layer)
    init = t.find_method(cls, "__init__")
    body, rows = list(init.body.body), []
    for attr in attrs:
        sites = [i for i, s in enumerate(body) if t.self_attr_assigned(s) == attr]
        if len(sites) != 1:
            continue
        built = t.code(t.assigned_value(body[sites[0]]))
        new = t.stmt(
            f"self.{attr} = ParallelSequential(\n"
            f"    lambda: {built},\n"
            "    quant_config=quant_config,\n"
            f'    prefix=f"{{prefix}}.{attr}",\n'
            ")\n"
        )
        body[sites[0]] = new.with_changes(leading_lines=body[sites[0]].leading_lines)
        rows.append(
            FusionRow(layer, f"{attr} (nn.Sequential) -> ColumnParallelLinear, its act, RowParallelLinear")
        )
    if not rows:
        return PassResult(module=module)
    module = t.replace_class(module, layer, t.set_method(cls, t.with_body(init, body)))
    module = insert_before(module, layer, template_class("mlp.py", "ParallelSequential", {}, {}))
    return PassResult(
        module=module,
        imports=("ColumnParallelLinear", "QuantizationConfig", "RowParallelLinear"),
        fused=tuple(rows),
        matches=len(rows),
    )
