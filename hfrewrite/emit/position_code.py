"""What the attention rewrite writes for positions: vLLM's rope (``get_rope`` or the
template's reversed rotary embedding), or ALiBi's slopes; and which of the source's methods
only built its own rotary module."""

from __future__ import annotations

import libcst as cst

from hfrewrite.analyze.plan import AttentionPlan
from hfrewrite.analyze.rope_styles import RopeLayers, RopeTurn
from hfrewrite.emit import cst_tools as t


def rotary_builders(cls: cst.ClassDef) -> set[str]:
    """``self.<method>()`` for each method of ``cls`` whose only effect is assigning
    ``self.rotary_emb`` (and attributes nothing else reads: StableLM's ``rotary_ndims``):
    the source's rope set-up, replaced by vLLM's."""
    found = set()
    for member in cls.body.body:
        if not isinstance(member, cst.FunctionDef) or member.name.value in ("__init__", "forward"):
            continue
        if len(member.params.params) != 1:
            continue
        assigned = {
            t.self_attr_assigned(n) for n in t.walk(member) if isinstance(n, cst.SimpleStatementLine)
        } - {None}
        effects = [
            n for n in t.walk(member) if isinstance(n, cst.Expr) and not isinstance(n.value, cst.SimpleString)
        ]
        others = [m for m in cls.body.body if m is not member]
        read_elsewhere = set().union(set(), *(t.self_attrs_used(m) for m in others))
        if "rotary_emb" in assigned and not (assigned - {"rotary_emb"}) & read_elsewhere and not effects:
            # the rewritten class still builds vLLM's own rotary_emb after the call
            found.add(f"self.{member.name.value}()")
    return found


# ALiBi (analysis: analyze/alibi.py): this rank's heads' slopes, the standard ones times the
# proven factor; vLLM's Attention adds the bias
ALIBI_INIT = """\
head_start = get_tensor_model_parallel_rank() * self.num_heads
alibi_slopes = alibi_slopes_of(self.total_num_heads) * {factor}
alibi_slopes = alibi_slopes[head_start : head_start + self.num_heads].tolist()
"""

ALIBI_SLOPES = """\
def alibi_slopes_of(total_num_heads: int) -> torch.Tensor:
    # The ALiBi paper's per-head slopes, as BLOOM and Baichuan compute them
    closest = 2 ** math.floor(math.log2(total_num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base), torch.arange(1, 1 + closest))
    if closest != total_num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, total_num_heads - closest)
        extra = torch.pow(torch.tensor(extra_base), torch.arange(1, 1 + 2 * remaining, 2))
        slopes = torch.cat([slopes, extra])
    return slopes
"""


# a hand-written attention's mask buffer read as vLLM's per-layer window (analyze/mask_window.py)
CAUSAL_WINDOW = """\
def causal_window(mask: torch.Tensor) -> int | None:
    # The keys a boolean causal mask [..., n, n] lets each query attend to, as vLLM's
    # sliding window: None for the whole causal triangle, w for the band of the last w.
    allowed = mask.reshape(mask.shape[-2:])
    n = allowed.shape[-1]
    window = int(allowed[-1].sum())
    causal = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()
    band = causal if window >= n else causal & ~causal.tril(-window)
    if not torch.equal(allowed, band):
        raise ValueError("hfrewrite: the attention mask is not a causal band of keys")
    return None if window >= n else window
"""


# a rope whose base the source's rotary module computes (analyze/rope_table.py, which runs
# this very text): the base read off the module's table for the real config, at load
SOURCE_ROPE_THETA = """\
_rope_thetas: dict = {}  # read once per rotary class, state, call and length


def source_rope_theta(rotary: nn.Module, call, length: int, rotary_dim: int):
    # The base of the default (neox) rope whose cos/sin table the source's rotary
    # module builds, read off that table; it must be the same rope's table at
    # every length vLLM may run, up to `length` positions.
    state = [(k, repr(v)) for k, v in sorted(vars(rotary).items()) if k[0] != "_"]
    key = (type(rotary), call.__code__, length, rotary_dim, repr(state))
    if key not in _rope_thetas:
        _rope_thetas[key] = _read_rope_theta(rotary, call, length, rotary_dim)
    return _rope_thetas[key]


def _read_rope_theta(rotary: nn.Module, call, length: int, rotary_dim: int):
    def table(n: int) -> torch.Tensor:
        with torch.no_grad():
            cos, sin = call(rotary.eval(), n)[:2]
        rows = [t.double().reshape(t.shape[0], -1)[:n, :rotary_dim] for t in (cos, sin)]
        if rows[0].shape != (n, rotary_dim):
            raise ValueError(f"hfrewrite: the source's rope table has no {n} rows")
        return torch.stack(rows)

    full, last = table(length), rotary_dim // 2 - 1
    # lane 1 at position 1, then the slowest lane where it has turned by about 1
    theta = math.atan2(full[1, 1, 1], full[0, 1, 1]) ** (-rotary_dim / 2)
    at = max(1, min(length - 1, int(theta ** (2 * last / rotary_dim))))
    angle = math.atan2(full[1, at, last], full[0, at, last]) / at
    theta = angle ** (-rotary_dim / (2 * last))
    lanes = torch.arange(0, rotary_dim, 2, dtype=torch.float64)
    steps = torch.arange(length, dtype=torch.float64)
    angles = torch.outer(steps, theta ** (-lanes / rotary_dim)).repeat(1, 2)
    want = torch.stack((angles.cos(), angles.sin()))
    bits = range(length.bit_length())
    lengths = {1, 2, 3} | {2**k + e for k in bits for e in (-1, 0, 1)}
    shorter = [n for n in sorted(lengths) if 0 < n < length]
    if not torch.allclose(full, want, atol=1e-3) or any(
        not torch.allclose(table(n), full[:, :n], atol=1e-3) for n in shorter
    ):
        raise ValueError(
            "hfrewrite: the source's rotary table is not one default rope at every "
            f"length up to {length}: this file cannot serve it"
        )
    return theta
"""


# Why an attention with no rope is refused where no other part gives the model the order
NO_POSITIONS = (
    "no rotary embedding on q and k, and no position table whose rows are added to the tokens' "
    "proven: the file would see no order"
)


def rope_init(att: AttentionPlan, head_dim: str, rope_parameters: str) -> str:
    """``self.rotary_emb = ...``: ``get_rope``, or (rope turning by -theta) the template's
    ``ReversedRotaryEmbedding`` built from the same parameters ``get_rope`` reads; at the
    layer's own base where a per-layer list holds it (none where that is 0)."""
    if att.rope_base_field is None:
        return _rope_init(att, head_dim, rope_parameters)
    built = _rope_init(att, head_dim, f'{{**{rope_parameters}, "rope_theta": rope_theta}}')
    code = f"rope_theta = config.{att.rope_base_field}[layer_idx]  # this layer's own base\n"
    if att.rope_layers is not RopeLayers.SOME:
        return code + built
    indented = "".join(f"    {line}\n" for line in built.splitlines())
    return (
        code
        + "# no rope (NoPE) where the layer's base is 0, as in the source\n"
        + (f"self.rotary_emb = None\nif rope_theta:\n{indented}")
    )


def _rope_init(att: AttentionPlan, head_dim: str, rope_parameters: str) -> str:
    if att.rope_turn is RopeTurn.FORWARD:
        return (
            "self.rotary_emb = get_rope(\n"
            f"    {head_dim},\n"
            f"    max_position=config.{att.max_position_field},\n"
            f"    rope_parameters={rope_parameters},\n"
            f"    is_neox_style={att.rope_style.is_neox},\n"
            ")\n"
        )
    rotary_dim = (
        head_dim
        if att.rotary_dim == att.head_dim
        else (f'int({head_dim} * {rope_parameters}.get("partial_rotary_factor", 1.0))')
    )
    return (
        "self.rotary_emb = ReversedRotaryEmbedding(\n"
        f"    {head_dim},\n"
        f"    rotary_dim={rotary_dim},\n"
        f"    max_position_embeddings=config.{att.max_position_field},\n"
        f'    base={rope_parameters}["rope_theta"],\n'
        f"    is_neox_style={att.rope_style.is_neox},\n"
        "    dtype=torch.get_default_dtype(),\n"
        ")\n"
    )
