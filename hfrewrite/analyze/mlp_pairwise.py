"""Gated MLPs whose activation vLLM has no ``*AndMul`` for, sharded with the source's code.

Pattern: ``down(f(gate(x), up(x)))`` for two Linears on one input, or ``down(f(p(x)))`` for
one Linear whose output ``f`` reads as ``[gate; up]`` halves (MiniMax-M3's clamped SwiGLU:
``gate_up.chunk(2)``, clamps, ``(up + 1) * gate * sigmoid(alpha * gate)``; a ReLU-gated
llama). When ``f`` computes output lane ``i`` from gate lane ``i`` and up lane ``i`` alone,
each tensor-parallel rank can run the source's ``f`` on its columns of gate and up
(``ColumnParallelLinear`` each, or ``MergedColumnParallelLinear`` over the halves) and
``down`` sums the ranks' parts by rows. That is form ``MlpForm.PAIRWISE``.

Proof, on the traced values: ``f`` is replayed node by node from the projections' outputs
(it reads nothing else: no other input, no module with weights), nothing else reads what
it computes, and for each block of columns at 2 and 4 ranks the replay on that block of
gate and up equals that block of the traced output.
"""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.analyze.plan import LinearFact, MlpPlan
from hfrewrite.analyze.trace import Traced, value

_RANKS = (2, 4)  # the column blocks each check replays
OWN_ACT = "the source's own activation"  # MlpPlan.activation where the source's act stays


def pairwise_separate(
    traced: Traced, path: str, cls: str, linears: list[Node], down: Node, reader: Node | None = None
) -> MlpPlan | None:
    """``down(f(gate(x), up(x)))`` with ``f`` lane-wise per gate/up pair; else None.
    ``reader``: what reads ``f``'s value where not ``down`` (a norm inside: analyze/mlp.py)."""
    gate, up = [n for n in linears if n is not down]
    reader = reader or down
    if gate.args[0] is not up.args[0] or value(gate).shape != value(up).shape:
        return None
    fn = function_of(traced, (gate, up), reader.args[0])
    if fn is None or not _read_only_by_down(fn.nodes, (gate, up), reader):
        return None
    g, u = value(gate), value(up)
    if not lanewise(lambda cols: fn(g[..., cols], u[..., cols]), value(reader.args[0]), g.shape[-1]):
        return None
    g_fact, u_fact, d = (traced.linear_fact(n, path) for n in (gate, up, down))
    return MlpPlan(cls, g_fact, u_fact, d, "", OWN_ACT, form=MlpForm.PAIRWISE)


def pairwise_fused(traced: Traced, path: str, cls: str, linears: list[Node], down: Node) -> MlpPlan | None:
    """``down(f(p(x)))`` with ``f`` lane-wise per pair of ``p``'s halves; else None."""
    (proj,) = [n for n in linears if n is not down]
    fn = function_of(traced, (proj,), down.args[0])
    whole = value(proj)
    half = whole.shape[-1] // 2
    if fn is None or whole.shape[-1] % 2 or not _read_only_by_down(fn.nodes, (proj,), down):
        return None
    out = value(down.args[0])
    if out.shape[-1] != half:
        return None

    def on_columns(cols: slice) -> torch.Tensor:  # the rank's [gate block; up block]
        return fn(torch.cat([whole[..., :half][..., cols], whole[..., half:][..., cols]], dim=-1))

    if not lanewise(on_columns, out, half):
        return None
    fact = traced.linear_fact(proj, path)
    fact = LinearFact(fact.attr, fact.in_features, half, fact.bias)
    d = traced.linear_fact(down, path)
    return MlpPlan(cls, fact, fact, d, "", OWN_ACT, fused_gate_up=True, form=MlpForm.PAIRWISE)


def lanewise(replay, out: torch.Tensor, width: int) -> bool:
    """Each block of ``width`` columns at every rank count of ``_RANKS`` replays to that block
    of ``out``."""
    counts = [n for n in _RANKS if width % n == 0]
    if not counts or not torch.is_tensor(out) or out.shape[-1] != width:
        return False
    with torch.no_grad():
        for n in counts:
            size = width // n
            for start in range(0, width, size):
                cols = slice(start, start + size)
                got = replay(cols)
                if not (torch.is_tensor(got) and got.shape == out[..., cols].shape):
                    return False
                if not torch.allclose(got, out[..., cols], rtol=1e-5, atol=1e-6):
                    return False
    return True


def _read_only_by_down(between: list[Node], starts: tuple[Node, ...], down: Node) -> bool:
    """Nothing but ``f`` and ``down`` reads the projections or what ``f`` computes: a rank
    holds only its columns of them. A value nobody reads (an unused half) does not count;
    an in-place op among them would, through the replay, which leaves it out."""
    inside = set(between) | {down}
    return all({u for u in n.users if u.users} <= inside for n in (*starts, *between))


class _Replay:
    """``end`` computed from ``starts`` by the traced nodes between, node by node."""

    def __init__(self, traced: Traced, starts: tuple[Node, ...], nodes: list[Node], end: Node) -> None:
        self.traced, self.starts, self.nodes, self.end = traced, starts, nodes, end

    def __call__(self, *inputs: torch.Tensor):
        env = {s: x.clone() for s, x in zip(self.starts, inputs, strict=True)}
        for n in self.nodes:
            if n.op == "get_attr":
                env[n] = value(n)
                continue
            args = map_arg(n.args, env.__getitem__)
            kwargs = map_arg(n.kwargs, env.__getitem__)
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_module":
                env[n] = self.traced.submodule(n)(*args, **kwargs)
            else:
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        return env[self.end]


def function_of(traced: Traced, starts: tuple[Node, ...], end: Node) -> _Replay | None:
    """``end`` as a function of ``starts`` alone (every node between reads only ``starts``,
    nodes between and constants; a module between holds no weights), replayed node by
    node; None when it reads anything else or no start."""
    between, todo, reached = {end}, [end], set()
    while todo:  # back from end, stopping at the starts
        for a in todo.pop().all_input_nodes:
            if a in starts:
                reached.add(a)
            elif a not in between:
                between.add(a)
                todo.append(a)
    if reached != set(starts):
        return None
    for n in between:
        if n.op not in ("call_function", "call_method", "get_attr", "call_module"):
            return None
        if n.op == "get_attr" and n.all_input_nodes:
            return None
        if n.op == "call_module" and any(True for _ in traced.submodule(n).parameters()):
            return None
    return _Replay(traced, starts, [n for n in traced.graph.nodes if n in between], end)
