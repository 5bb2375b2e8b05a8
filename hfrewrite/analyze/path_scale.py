"""k or v multiplied by a number of the config on its way to the attention, after its head
split (Falcon-H1's ``k_proj(x).view(...).transpose(1, 2) * self.key_multiplier``, MiMo-V2-Flash's
``v_proj(x).view(...).transpose(1, 2) * self.v_scale``).

A number times k scales every score ``q . k`` by it, which vLLM's ``Attention`` computes at its
scale times that number (the rope turns each pair of lanes, which a number commutes with); a
number times v scales the attention's output, so the file multiplies vLLM's v after the split.
The product is found on the traced path between the projection and the rope's input (or the
attention's), its one operand a Python number the source's own expression on that line gives
(``self.key_multiplier``, read from ``self`` alone so ``__init__`` can read it too); the head
split is then proven on the values divided by it (head_layout.py).
"""

from __future__ import annotations

from torch.fx import Node

from hfrewrite.analyze.dataflow import path_nodes
from hfrewrite.analyze.fused_qkv import forward_code, source_line
from hfrewrite.analyze.q_prescale import MUL, factor_of
from hfrewrite.analyze.trace import Traced

ROLES = ("k", "v")


def path_scales(
    traced: Traced, path: str, scope: set[Node], stops: dict[str, Node], feeders: dict[str, Node]
) -> dict[str, tuple[Node, float, str]]:
    """Role -> (the product node, the number, the source's expression for it) for k and v
    where one product by a number lies between the projection and ``stops[role]`` (the rope's
    input, or the attention's), inclusive."""
    code = forward_code(traced, path)
    found = {}
    for role in ROLES:
        nodes = [*path_nodes(stops[role], feeders[role], scope), stops[role]]
        products = [n for n in nodes if _number_product(n)]
        if len(products) != 1:
            continue
        (product,) = products
        proven = factor_of(product, source_line(product, code), traced.module.get_submodule(path))
        if proven is not None:
            found[role] = (product, *proven)
    return found


def _number_product(node: Node) -> bool:
    """``x * number`` (either order), ``x`` a traced value."""
    if node.op not in ("call_function", "call_method") or node.target not in MUL:
        return False
    numbers = [a for a in node.args if isinstance(a, int | float) and not isinstance(a, bool)]
    return len(node.args) == 2 and len(numbers) == 1 and any(isinstance(a, Node) for a in node.args)
