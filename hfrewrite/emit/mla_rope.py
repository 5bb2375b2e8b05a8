"""The rope of a latent attention in the emitted file: what ``get_rope`` is given, the guards
refusing rope types the replay did not prove, and the rope's call in the forward."""

from __future__ import annotations

from hfrewrite.analyze.plan import MlaPlan

# What get_rope is given, per proven rope: a "yarn" config runs as vLLM's deepseek_yarn (YaRN
# with the ratio of the two mscale factors on cos/sin, which transformers computes for it).
# Any other proven rope (default, linear, llama3, longrope) is given as the config holds it.
_ROPE_PARAMETERS = {"deepseek_yarn": '{{**{p}, "rope_type": "deepseek_yarn"}}'}
_ROPE_TYPES = {"deepseek_yarn": "yarn"}  # the config's rope_type of a proven kind, where it differs


# A transformers 4.x config keeps a scaled rope's parameters in rope_scaling, its type
# under "type": they join the base transformers 5 standardises into rope_parameters, and
# the rope's code reads that local.
LEGACY_ROPE = (
    '# This transformers 4.x config keeps a scaled rope in rope_scaling (its type under "type").\n'
    "rope_parameters = {**config.rope_parameters, **(config.rope_scaling or {})}\n"
    'rope_parameters["rope_type"] = rope_parameters.pop("type", rope_parameters["rope_type"])\n'
)


def rope_params(plan: MlaPlan) -> str:
    """The expression holding the rope parameters in ``__init__``."""
    return "rope_parameters" if plan.rope_source == "rope_scaling" else "config.rope_parameters"


def _yarn_guard(name: str, p: str, when: str = "") -> str:
    """Refuse the YaRN knobs the replay did not prove (vLLM's deepseek_yarn ignores
    transformers' ``attention_factor`` and ``truncate=False``), where ``when`` holds;
    ``p``: the rope parameters."""
    knobs = f'{p}.get("attention_factor") is not None or not {p}.get("truncate", True)'
    return (
        f"if {f'{when} and ({knobs})' if when else knobs}:\n"
        f"    raise NotImplementedError(\"hfrewrite: {name}: vLLM's deepseek_yarn rope has no attention_factor "
        'and always truncates")\n'
    )


def rope_guard(plan: MlaPlan, name: str) -> str:
    """Refuse the rope types the replay did not prove; with both proven, the YaRN knobs."""
    kinds, p = plan.rope_kinds or (plan.rope_kind,), rope_params(plan)
    proven = " or ".join(repr(_ROPE_TYPES.get(k, k)) for k in kinds)
    names = tuple(_ROPE_TYPES.get(k, k) for k in kinds)
    test = f'{p}.get("rope_type", "default") ' + (
        f'!= "{names[0]}"' if len(names) == 1 else f"not in {names!r}".replace("'", '"')
    )
    out = (
        f"if {test}:\n"
        f'    raise NotImplementedError("hfrewrite: {name} was converted for rope_type {proven}: '
        'convert this config to prove its rope")\n'
    )
    if "deepseek_yarn" not in kinds:
        return out
    if len(kinds) == 1:
        return out + _yarn_guard(name, p)
    return out + _yarn_guard(name, p, f'{p}.get("rope_type", "default") == "yarn"')


def rope_parameters(plan: MlaPlan) -> str:
    """What ``get_rope`` is given: with both ropes proven, a "yarn" config as vLLM's
    deepseek_yarn, any other as it is."""
    kinds, p = plan.rope_kinds or (plan.rope_kind,), rope_params(plan)
    if len(kinds) == 1:
        return _ROPE_PARAMETERS.get(kinds[0], "{p}").format(p=p)
    return (
        f'{{**{p}, "rope_type": "deepseek_yarn"}}\n'
        f'        if {p}.get("rope_type", "default") == "yarn"\n'
        f"        else {p}"
    )


# The rope in the forward, per proven rope; k_pe leaves as [tokens, 1, rope].
ROPE_CALL = {
    "default": (
        "# Rope on contiguous [tokens, heads * rope] copies: vLLM's CPU rotary kernel\n"
        "# misreads strided and 3-D views.\n"
        "q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(q.shape[0], -1), k_pe.contiguous())\n"
        "q = torch.cat([q_nope, q_pe.view(q.shape[0], self.num_local_heads, {rope})], dim=-1)\n"
        "k_pe = k_pe.unsqueeze(1)\n"
    ),
    # vLLM's deepseek_yarn rope computes out of place, in PyTorch, on [tokens, heads, rope].
    "deepseek_yarn": (
        "q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))\n"
        "q = torch.cat([q_nope, q_pe], dim=-1)\n"
    ),
}
