"""What the file does to v around vLLM's attention beyond the split: the config number the
source multiplies v by (analyze/path_scale.py), and v heads narrower than q's and k's
(MiMo-V2-Flash's), padded with zeros to their size for vLLM's attention, which has one head
size, and cut back from its output: zero lanes of v give zero lanes of the output, and the
scores read q and k alone."""

from __future__ import annotations

from hfrewrite.analyze.plan import AttentionPlan

V_HEAD_SIZE = "self.v_head_size"  # where fuse_qkv binds the v head size

_PADDED = """\
# v heads are narrower than q's and k's: zero-padded for vLLM's attention,
# which has one head size, and the padding cut from its output.
v = torch.nn.functional.pad(v.view(-1, self.num_kv_heads, {v}), (0, {head_dim} - {v}))
v = v.view(-1, self.num_kv_heads * {head_dim})
"""

_CUT = """\
attn_output = attn_output.view(-1, self.num_heads, {head_dim})[..., : {v}]
attn_output = attn_output.reshape(-1, self.num_heads * {v})
"""


def before_attention(att: AttentionPlan, head_dim: str) -> str:
    """v's lines before ``self.attn(q, k, v)`` (``head_dim``: where the file holds the q/k head
    size vLLM's attention is built with)."""
    lines = "".join(
        f"v = v * {expr}  # as the source scales v\n" for role, expr in att.path_scales if role == "v"
    )
    return lines + (_PADDED.format(v=V_HEAD_SIZE, head_dim=head_dim) if att.v_head_dim else "")


def after_attention(att: AttentionPlan, head_dim: str) -> str:
    """The attention output's lines right after ``self.attn(q, k, v)``."""
    return _CUT.format(v=V_HEAD_SIZE, head_dim=head_dim) if att.v_head_dim else ""


def key_scaled(att: AttentionPlan, scaling: str) -> str:
    """The attention's scale times the number the source multiplies k by: every score is."""
    for role, expr in att.path_scales:
        if role == "k":
            scaling = expr if scaling in ("1", "1.0") else f"{expr} * {scaling}"
    return scaling
