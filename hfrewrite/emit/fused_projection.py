"""Checkpoint-fused q/k/v projections (``W_pack``, ``c_attn``, ``query_key_value``) as one
``QKVParallelLinear``, and the statements that take the source's fused output apart rebound
to vLLM's ``q``, ``k``, ``v`` (the fuse_qkv pass's second form)."""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.fused_qkv import ITEM
from hfrewrite.analyze.qkv_layouts import QkvLayout
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pure_expressions import computes_only
from hfrewrite.emit.relayout import relayout
from hfrewrite.emit.shared_matchers import builds, nn_call
from hfrewrite.emit.torch_names import builds_a_class
from hfrewrite.errors import HfrewriteError

NAME = "fuse_qkv"


_OURS = ("q", "k", "v", "qkv")


def freed(name: str) -> str:
    """The name :func:`free_qkv_names` gives a source local named like vLLM's q/k/v/qkv."""
    return f"{name}_states"


def unfreed(text: str) -> str:
    """``text`` with the names :func:`freed` gives read as the names they freed."""
    return re.sub(rf"\b({'|'.join(_OURS)}){freed('')}\b", r"\1", text)


# The tensor-parallel head bookkeeping of vLLM's llama.py, after self.total_num_heads and
# self.total_num_kv_heads are bound (tp_size too).
HEAD_SHARDING = (
    "# Heads are sharded over tensor-parallel ranks; kv heads are replicated when\n"
    "# there are fewer of them than ranks.\n"
    "assert self.total_num_heads % tp_size == 0\n"
    "if self.total_num_kv_heads >= tp_size:\n"
    "    assert self.total_num_kv_heads % tp_size == 0\n"
    "else:\n"
    "    assert tp_size % self.total_num_kv_heads == 0\n"
    "self.num_heads = self.total_num_heads // tp_size\n"
    "self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)\n"
)


def free_qkv_names(forward: cst.FunctionDef, cls: str) -> cst.FunctionDef:
    """``forward`` with its own locals named q/k/v/qkv renamed ``<name>_states``, which
    frees those names for the split (custom code often names its locals so)."""
    used = t.names_used(forward)
    clash = sorted(t.plain_names(forward) & set(_OURS))  # (not GPT-1's keyword `k=True`)
    if not clash:
        return forward
    positional = {p.name.value for p in (*forward.params.posonly_params, *forward.params.params)}
    keyword_only = {p.name.value for p in forward.params.kwonly_params}
    assigned = {
        n for s in t.walk(forward.body) if isinstance(s, cst.AssignTarget) for n in t.root_names(s.target)
    }
    renamed = {n: freed(n) for n in clash}
    if set(clash) & keyword_only or not set(clash) <= assigned | positional or set(renamed.values()) & used:
        raise HfrewriteError(f"{cls}: {NAME}: forward already uses the names {'/'.join(clash)}")
    return _rename_positional(t.rename_locals(forward, renamed), renamed)


def _rename_positional(forward: cst.FunctionDef, renamed: dict[str, str]) -> cst.FunctionDef:
    """``forward`` with its positional parameters in ``renamed`` renamed (CTRL's
    ``forward(self, v, k, q, ...)``; its layer passes them by position). A caller passing
    one by keyword fails loudly in validation, never silently."""

    def param(p: cst.Param) -> cst.Param:
        name = renamed.get(p.name.value)
        return p if name is None else p.with_changes(name=cst.Name(name))

    params = forward.params
    return forward.with_changes(
        params=params.with_changes(
            posonly_params=[param(p) for p in params.posonly_params],
            params=[param(p) for p in params.params],
        )
    )


class _Slices(cst.CSTTransformer):
    """``x = <var>[..., :Q]`` / ``[..., Q:Q+K]`` / ``[..., Q+K:]`` -> ``x = q`` / ``k`` / ``v``.

    The analysis proved the projection is laid out [q; k; v] and sliced there; which
    statement takes which part follows from its slice's open ends."""

    def __init__(self, var: str) -> None:
        self.var, self.roles = var, []

    def leave_Subscript(self, original, updated):
        if not (isinstance(updated.value, cst.Name) and updated.value.value == self.var):
            return updated
        last = updated.slice[-1].slice
        if (
            len(updated.slice) != 2
            or not m.matches(updated.slice[0].slice, m.Index(value=m.Ellipsis()))
            or not isinstance(last, cst.Slice)
        ):
            return updated
        role = "q" if last.lower is None else "v" if last.upper is None else "k"
        self.roles.append(role)
        return cst.Name(role)


# What HEAD_SHARDING binds: the source setting one again after it (Falcon's total
# `self.num_kv_heads`) would undo the per-rank count.
_SHARDED = frozenset(
    {"num_heads", "num_kv_heads", "total_num_heads", "total_num_kv_heads", "q_size", "kv_size"}
)


def after_head_sharding(statements: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """The source's ``__init__`` statements after HEAD_SHARDING: less their assignments of
    what it binds, and sizing whole modules by the whole head counts (below)."""
    return [
        _TotalCounts.sizing(s)
        for s in statements
        if not (t.self_attr_assigned(s) in _SHARDED and computes_only(t.assigned_value(s)))
    ]


_TOTAL = {"num_heads": "total_num_heads", "num_kv_heads": "total_num_kv_heads"}


class _TotalCounts(cst.CSTTransformer):
    """After HEAD_SHARDING ``self.num_heads`` is the rank's count; a module the source builds
    from it (Persimmon's ``dense``, Laguna's ``g_proj``: a parallel linear shards it itself, a
    per-head norm divides by it) takes the whole count. Rewritten: the statements building a
    module (``self.x = Class(...)``, also under an ``if``) and the locals they read; an
    attribute kept for ``forward`` keeps the rank's count."""

    @classmethod
    def sizing(cls, statement: cst.BaseStatement) -> cst.BaseStatement:
        if isinstance(statement, cst.If):
            return statement.with_changes(
                body=statement.body.with_changes(body=[cls.sizing(s) for s in statement.body.body]),
                orelse=None if statement.orelse is None else cls.sizing(statement.orelse),
            )
        if isinstance(statement, cst.Else):
            return statement.with_changes(
                body=statement.body.with_changes(body=[cls.sizing(s) for s in statement.body.body])
            )
        if not isinstance(statement, cst.SimpleStatementLine) or not _builds_or_local(statement):
            return statement
        return statement.visit(cls())

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if m.matches(updated, m.Attribute(value=m.Name("self"))) and updated.attr.value in _TOTAL:
            return updated.with_changes(attr=cst.Name(_TOTAL[updated.attr.value]))
        return updated


def _builds_or_local(statement: cst.SimpleStatementLine) -> bool:
    """``self.x = Class(...)`` (``builds_a_class``), or an assignment to locals."""
    body = statement.body[0]
    if not isinstance(body, cst.Assign):
        return False
    if all(isinstance(target.target, cst.Name) for target in body.targets):
        return True
    callee = t.call_name(body.value) if isinstance(body.value, cst.Call) else None
    return callee is not None and builds_a_class(callee) and t.self_attr_assigned(statement) is not None


def rewrite_fused(
    cls: cst.ClassDef,
    attr: str,
    heads: str,
    kv_heads: str,
    layout: QkvLayout = QkvLayout.BLOCKS,
    unpack_lines: tuple[str, ...] = (),
) -> cst.ClassDef:
    """A checkpoint-fused ``self.<attr> = nn.Linear(H, (NQ + 2 * NKV) * head_dim)``."""
    per_head = layout is not QkvLayout.BLOCKS
    init = _fused_init(cls, attr, heads, kv_heads, layout.comment)
    source = t.find_method(cls, "forward")
    forward = free_qkv_names(source, cls.name.value)
    lines = tuple(_renamed(line, t.names_used(source) - t.names_used(forward)) for line in unpack_lines)
    return _fused_forward(cls, init, forward, attr, per_head, lines)


def _renamed(line: str, names: set[str]) -> str:
    """A source line as it reads once :func:`free_qkv_names` renamed ``names``."""
    for name in names:
        line = re.sub(rf"(?<![.\w]){name}\b", freed(name), line)
    return line


def _fused_init(cls: cst.ClassDef, attr: str, heads: str, kv_heads: str, comment: str) -> cst.FunctionDef:
    """``__init__`` with ``QKVParallelLinear`` and vLLM's per-rank head bookkeeping in place of
    the source's Linear, and without the source's later head counts."""
    name = cls.name.value
    init, body, where = t.init_assignments(cls, (attr,), NAME)
    call = t.assigned_value(body[where[attr]])
    if not builds(call, nn_call("Linear")):
        raise HfrewriteError(f"{name}: {NAME}: self.{attr} is not nn.Linear")
    size_in, size_out, bias = t.linear_args(call)
    # the head size, where the source names it otherwise (or binds it only later: OpenELM):
    # its proven share of the output
    head_dim = (
        ""
        if "head_dim" in {t.self_attr_assigned(s) for s in body[: where[attr]]}
        else (
            f"self.head_dim = ({t.code(size_out)}) // (self.total_num_heads + 2 * self.total_num_kv_heads)\n"
        )
    )
    fused = t.stmts(
        "tp_size = get_tensor_model_parallel_world_size()\n"
        f"self.total_num_heads = {heads}\n"
        f"self.total_num_kv_heads = {kv_heads}\n"
        f"{HEAD_SHARDING}"
        f"{head_dim}"
        "self.q_size = self.num_heads * self.head_dim\n"
        "self.kv_size = self.num_kv_heads * self.head_dim\n"
        f"# {comment}\n"
        f"self.{attr} = QKVParallelLinear(\n"
        f"    hidden_size={t.code(size_in)},\n"
        "    head_size=self.head_dim,\n"
        "    total_num_heads=self.total_num_heads,\n"
        "    total_num_kv_heads=self.total_num_kv_heads,\n"
        f"    bias={t.code(bias) if bias is not None else 'True'},\n"
        "    quant_config=quant_config,\n"
        f'    prefix=f"{{prefix}}.{attr}",\n'
        ")\n"
    )
    fused[0] = fused[0].with_changes(
        leading_lines=[*body[where[attr]].leading_lines, *fused[0].leading_lines]
    )
    at = where[attr]
    return t.with_body(init, [*body[:at], *fused, *after_head_sharding(body[at + 1 :])])


def _fused_forward(
    cls: cst.ClassDef,
    init: cst.FunctionDef,
    forward: cst.FunctionDef,
    attr: str,
    per_head: bool,
    unpack_lines: tuple[str, ...],
) -> cst.ClassDef:
    """``cls`` with ``init``, and its forward taking vLLM's ``q, k, v`` split of the layer's
    output where the source takes its lanes apart."""
    name = cls.name.value
    fwd_body = list(forward.body.body)
    at = next(
        (
            i
            for i, s in enumerate(fwd_body)
            if isinstance(s, cst.SimpleStatementLine)
            and isinstance(s.body[0], cst.Assign)
            and isinstance(s.body[0].targets[0].target, cst.Name)
            and _innermost_call(s.body[0].value, f"self.{attr}") is not None
        ),
        None,
    )
    if at is None and _roles_in_order(unpack_lines):  # one statement takes all three (a per-head
        # layout is reordered into [q; k; v] at load: multi-head gpt_bigcode's view-split chain)
        return _split_in_one(cls, init, forward, attr)
    if at is None:
        raise HfrewriteError(f"{name}: {NAME}: forward has no `x = self.{attr}(...)`")
    assign = fwd_body[at].body[0]
    var = assign.targets[0].target.value
    arg = t.code(_innermost_call(assign.value, f"self.{attr}").args[0].value)
    if not per_head and (split_at := _split_of(fwd_body[at + 1 :], var)) is not None:
        forward = _clamped_split(forward, fwd_body, at, at + 1 + split_at, var, attr, arg, name)
        return t.set_method(t.set_method(cls, init), forward)
    rest = _after_split(fwd_body[at + 1 :], var, per_head, unpack_lines, name)
    split = t.stmts(
        f"qkv, _ = self.{attr}({arg})\n"
        "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)\n"
    )
    forward = t.with_body(forward, [*fwd_body[:at], *split, *rest])
    return t.set_method(t.set_method(cls, init), forward)


def _after_split(
    rest: list[cst.BaseStatement], var: str, per_head: bool, unpack_lines: tuple[str, ...], name: str
) -> list[cst.BaseStatement]:
    """The statements after ``var = self.<attr>(x)``, reading vLLM's q, k, v for its lanes."""
    slicer = _Slices(var)
    if not (per_head or unpack_lines):
        rest = [s.visit(slicer) for s in rest]
    if unpack_lines and (per_head or sorted(slicer.roles) != ["k", "q", "v"]):
        rest = (
            _unchunk(rest, var, name)
            if _chunked_once(rest, var)
            else _bind_at_lines(rest, var, unpack_lines, name)
        )
    elif per_head:
        rest = _unchunk(rest, var, name)
    elif sorted(slicer.roles) != ["k", "q", "v"]:
        raise HfrewriteError(f"{name}: {NAME}: {var} is not sliced exactly into q, k and v")
    if var in t.names_used(cst.Module(rest)):
        raise HfrewriteError(f"{name}: {NAME}: {var} is used beyond its q/k/v split")
    return rest


def _split_in_one(
    cls: cst.ClassDef, init: cst.FunctionDef, forward: cst.FunctionDef, attr: str
) -> cst.ClassDef:
    """``a, b, c = self.<attr>(x).split(...)`` (or ``.chunk(3, ...)``), which the analysis
    proved are q, k and v in that order -> the split of vLLM's layer, then ``a, b, c = q, k, v``."""
    name = cls.name.value
    body, found = list(forward.body.body), []
    for i, s in enumerate(body):
        receiver = _split_in_three(s)
        call = _innermost_call(receiver, f"self.{attr}") if receiver is not None else None
        if call is not None:  # (after its own re-layouts: gpt_bigcode's `.unsqueeze(1)`)
            found.append((i, t.code(call.args[0].value), s.body[0]))
    if len(found) != 1 or attr in t.self_attrs_used(
        cst.Module(body[: found[0][0]] + body[found[0][0] + 1 :])
    ):
        raise HfrewriteError(f"{name}: {NAME}: self.{attr} is not called once, split into q, k and v")
    at, arg, small = found[0]
    split = t.stmts(
        f"qkv, _ = self.{attr}({arg})\n"
        "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)\n"
    )
    renamed = body[at].with_changes(body=[small.with_changes(value=t.expr("q, k, v"))])
    forward = t.with_body(forward, [*body[:at], *split, renamed, *body[at + 1 :]])
    return t.set_method(t.set_method(cls, init), forward)


def _split_in_three(statement: cst.BaseStatement) -> cst.BaseExpression | None:
    """``x`` of ``a, b, c = x.split(...)`` (or ``.chunk``), else None."""
    small = (
        statement.body[0]
        if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
        else None
    )
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
        return None
    target, value = small.targets[0].target, small.value
    if (
        isinstance(target, cst.Tuple)
        and len(target.elements) == 3
        and isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value in ("split", "chunk")
    ):
        return value.func.value
    return None


def _split_of(body: list[cst.BaseStatement], var: str) -> int | None:
    """Index of the one ``a, b, c = <var>.split(...)`` (or ``.chunk``) in ``body``, or None."""
    found = [
        i for i, s in enumerate(body) if (x := _split_in_three(s)) is not None and m.matches(x, m.Name(var))
    ]
    return found[0] if len(found) == 1 else None


def _clamped_split(
    forward: cst.FunctionDef,
    body: list[cst.BaseStatement],
    at: int,
    split_at: int,
    var: str,
    attr: str,
    arg: str,
    cls: str,
) -> cst.FunctionDef:
    """``<var> = self.<attr>(x)``, statements on ``<var>`` (dbrx's clip_qkv clamp, which the
    analysis proved elementwise), ``a, b, c = <var>.split(...)``: the projection and split
    become vLLM's, the statements between are carried with ``<var>`` named ``qkv``, but for
    those that only lay ``<var>`` out in heads (OpenELM's reshape and transpose before its
    split per head): the analysis proved the lanes they take apart are ``[q; k; v]``, which
    vLLM's split takes on its flat rows."""
    kept = [s for s in body[at + 1 : split_at] if not relayout(s, var)]
    between = list(t.rename_locals(t.with_body(forward, kept), {var: "qkv"}).body.body)
    rest = body[split_at + 1 :]
    if var in t.names_used(cst.Module(rest)):
        raise HfrewriteError(f"{cls}: {NAME}: {var} is used beyond its q/k/v split")
    split = body[split_at].body[0]
    new = [
        *t.stmts(f"qkv, _ = self.{attr}({arg})\n"),
        *between,
        *t.stmts("q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)\n"),
        body[split_at].with_changes(body=[split.with_changes(value=t.expr("q, k, v"))]),
    ]
    return t.with_body(forward, [*body[:at], *new, *rest])


def _innermost_call(node: cst.BaseExpression, func: str) -> cst.Call | None:
    """``self.p(x)`` in ``self.p(x)``, ``self.p(x).view(...).transpose(...)``..."""
    while isinstance(node, cst.Call):
        if t.call_name(node) == func:
            return node
        node = node.func.value if isinstance(node.func, cst.Attribute) else None
    return None


def _chunked_once(body: list[cst.BaseStatement], var: str) -> bool:
    try:
        _unchunk(body, var, "")
    except HfrewriteError:
        return False
    return True


def _bind_at_lines(
    body: list[cst.BaseStatement], var: str, lines: tuple[str, ...], cls: str
) -> list[cst.BaseStatement]:
    """The source's unpacking of ``<var>`` into q, k and v by layout alone (indexing, views,
    einops, splits), as the analysis proved it: the statement at each role's recorded line
    binds that role (``query_states = qkv_states[..., :groups, :]`` -> ``query_states = q``);
    re-layouts of ``<var>`` itself, and the names derived from it that only those lines
    read (CodeGen's ``qkv_split``, its ``query, value, key = torch.split(...)``), go; any
    other use of ``<var>`` is refused."""
    out, bound, derived = [], [], {var}
    wanted = _roles_at_lines(lines)
    for s in body:
        if not derived & t.names_used(s):
            out.append(s)
            continue
        small = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
        targets = _assigned_names(small)
        if not targets:
            raise HfrewriteError(f"{cls}: {NAME}: {var} is used other than to take q, k and v apart")
        text = " ".join(t.code(s).split())
        roles = next((r for line, r in wanted.items() if line in text), None)
        if roles is not None and sorted(roles) == list(range(len(targets))):
            bound += roles.values()
            derived -= set(targets)  # rebound: from here on they hold vLLM's lanes
            value = ", ".join(roles[i] for i in range(len(targets)))
            out.append(s.with_changes(body=[small.with_changes(value=t.expr(value))]))
            continue
        derived |= set(targets)  # a re-layout or a piece of <var>: it goes
    if sorted(bound) != ["k", "q", "v"]:
        raise HfrewriteError(f"{cls}: {NAME}: {var} is not taken apart once into q, k and v")
    if (left := derived & t.names_used(cst.Module(out))) - {var}:
        first = min(left - {var})
        raise HfrewriteError(f"{cls}: {NAME}: {first} reads {var} where no role's lane is taken")
    return out


def _roles_in_order(lines: tuple[str, ...]) -> bool:
    """No line recorded, or one line binding q, k and v as its first, second and third."""
    wanted = _roles_at_lines(lines)
    return not wanted or list(wanted.values()) == [{0: "q", 1: "k", 2: "v"}]


def _roles_at_lines(lines: tuple[str, ...]) -> dict[str, dict[int, str]]:
    """Each recorded line (whitespace normalised) -> the roles it binds, by the element of
    its target they are (0 for a single name; ``ITEM`` marks an element of a tuple)."""
    wanted: dict[str, dict[int, str]] = {}
    for line, role in zip(lines, "qkv"):
        if line:
            text, _, item = line.partition(ITEM)
            wanted.setdefault(" ".join(text.split()), {})[int(item) if item.isdigit() else 0] = role
    return wanted


def _assigned_names(small: cst.BaseSmallStatement | None) -> tuple[str, ...]:
    """The names ``a = ...`` or ``a, b, c = ...`` binds (empty for any other statement)."""
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
        return ()
    target = small.targets[0].target
    parts = target.elements if isinstance(target, cst.Tuple) else [target]
    names = [p.value if isinstance(p, cst.Element) else p for p in parts]
    return tuple(n.value for n in names) if all(isinstance(n, cst.Name) for n in names) else ()


def _unchunk(body: list[cst.BaseStatement], var: str, cls: str) -> list[cst.BaseStatement]:
    """``a, b, c = <var>.chunk(3, ...)`` (or a method of the module splitting ``<var>``) ->
    ``a, b, c = q, k, v``: the analysis proved the
    per-head lanes 0, 1, 2 are q, k and v, which the loader reorders into [q; k; v]."""
    out, found = [], 0
    for s in body:
        small = s.body[0] if isinstance(s, cst.SimpleStatementLine) else None
        target = small.targets[0].target if isinstance(small, cst.Assign) else None
        value = small.value if isinstance(small, cst.Assign) else None
        splits = isinstance(value, cst.Call) and (  # var.chunk(3, ...) or self._split_heads(var)
            m.matches(value.func, m.Attribute(value=m.Name(var), attr=m.Name("chunk")))
            or (
                m.matches(value.func, m.Attribute(value=m.Name("self")))
                and m.matches(value, m.Call(args=[m.Arg(m.Name(var))]))
            )
        )
        if isinstance(target, cst.Tuple) and len(target.elements) == 3 and splits:
            found += 1
            s = s.with_changes(body=[small.with_changes(value=t.expr("q, k, v"))])
        out.append(s)
    if found != 1:
        raise HfrewriteError(f"{cls}: {NAME}: {var} is not chunked once into q, k and v")
    return out
