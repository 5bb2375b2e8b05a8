"""One conversion: resolved model -> analysis plan -> rewrite passes -> emitted text."""

from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import torch
import transformers

from hfrewrite.analyze.composite import composite_plan, text_causal_lm, text_part, with_text
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.analyze.shrink import shrink_config
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit import output as emit
from hfrewrite.emit.config_shim import shim_statements, with_shim
from hfrewrite.emit.local_modules import inline_local_imports
from hfrewrite.emit.name_clashes import avoid_vllm_names
from hfrewrite.emit.pass_api import FusionRow, PassContext
from hfrewrite.emit.pipeline import run_passes
from hfrewrite.emit.relative_imports import relative_imports
from hfrewrite.emit.torch_names import torch_nn_as_nn
from hfrewrite.errors import CannotBuild, HfrewriteError
from hfrewrite.progress import step
from hfrewrite.resolve import resolve


@dataclass(frozen=True)
class Generated:
    filename: str  # "<model_type>.py"
    text: str  # the final file: header + formatted source
    fused: tuple[FusionRow, ...]
    declined: tuple[NoMatch, ...]
    # (description, config) of the sibling configs whose branches the analysis proved
    sibling_configs: tuple[tuple[str, object], ...] = ()
    # Hub custom code analysed under another transformers release (isolate.analysis)
    isolated: object = None
    # the dtype vLLM runs the file in when validating it: bfloat16 where a layer of vLLM's
    # computes in no other on CPU (its gated delta net's kernel); then the layers' child
    # holding that layer, and the sibling configs that build none (validated in float32)
    vllm_dtype: str = "float32"
    state_layer: str = ""
    float32_siblings: tuple[str, ...] = ()
    attention_layer_type: str = ""  # the layer_types entry of attention layers ("": none)


ATTENTION_EVERYWHERE = "the config with attention in every layer (vLLM in float32: no gated delta net built)"


def reduced_precision(config, plan) -> dict:
    """The sibling configs and, where vLLM computes a state layer of the file in bfloat16
    only, that dtype, the layer, and a sibling config with attention in every layer, which
    builds none and so validates in float32 (verify/state_layers.py)."""
    mixer = plan.mixer
    if mixer is None or mixer.vllm_dtype == "float32":
        return {"sibling_configs": plan.sibling_configs}
    siblings = plan.sibling_configs
    if mixer.attention_layer_type:
        siblings += ((ATTENTION_EVERYWHERE, with_layer_types(config, mixer.attention_layer_type)),)
    return {
        "sibling_configs": siblings,
        "vllm_dtype": mixer.vllm_dtype,
        "state_layer": mixer.attr,
        "float32_siblings": (ATTENTION_EVERYWHERE,) if mixer.attention_layer_type else (),
        "attention_layer_type": mixer.attention_layer_type,
    }


def with_layer_types(config, kind: str):
    """A copy of ``config`` (of its text part, for a multimodal one) with ``kind`` in every
    entry of its ``layer_types``."""
    text = text_part(config)
    target = copy.deepcopy(text if text is not None else config)
    target.layer_types = [kind] * len(target.layer_types)
    return with_text(config, target) if text is not None else target


def generate(resolved) -> Generated:
    """The generated vLLM file for a resolved model; nothing is written here."""
    resolved, plan = _plan(resolved)
    try:
        module = cst.parse_module(resolved.modeling_path.read_text(encoding="utf-8"))
    except (OSError, cst.ParserSyntaxError) as exc:
        raise HfrewriteError(f"cannot read {resolved.modeling_path}: {exc}") from None
    if getattr(resolved, "custom_code", False):
        try:
            module = inline_local_imports(module, resolved.modeling_path.parent)
        except HfrewriteError as exc:
            raise HfrewriteError(f"{resolved.model_id}: {exc}") from None
        _defined_in_file(plan, module, resolved.modeling_path.name)
        module, plan = avoid_vllm_names(module, plan)
        module = torch_nn_as_nn(module, plan.linear_classes, plan.transposed_linear_classes)
    else:  # transformers' own: Conv1D (the GPT-2 family), cwm's `torch.nn.Linear`, FalconLinear
        module, plan = avoid_vllm_names(module, plan)  # (GPT-1's classes Attention and MLP)
        module = torch_nn_as_nn(
            module, plan.linear_classes, plan.transposed_linear_classes, constructors_only=True
        )
    shim, helpers = [], frozenset()
    if resolved.isolated is not None:  # its configuration class is written for transformers 4
        iso = resolved.isolated
        from_config = frozenset(relative_imports(module)[1])  # what the modeling file imports of it
        shim = shim_statements(
            iso.config_path, iso.config_class, resolved.model_type, plan.vllm_sizes, from_config
        )
        helpers = frozenset(n for s in shim for n in t.bound_names(s)) & from_config - {iso.config_class}
    with step(f"rewriting {resolved.modeling_path.name}"):
        result = run_passes(
            module,
            PassContext(
                plan=plan,
                modeling_file=resolved.modeling_path.name,
                custom_code=getattr(resolved, "custom_code", False),
                shim_helpers=helpers,
            ),
        )
    module = result.module
    if shim:
        module = with_shim(module, shim)
    with step("formatting"):
        text = emit.render(resolved, module.code)
    return Generated(
        filename=f"{resolved.model_type}.py",
        text=text,
        fused=result.fused,
        declined=result.declined,
        isolated=resolved.isolated,
        **reduced_precision(resolved.config, plan),
    )


def _plan(resolved):
    """(resolved, plan): the analysis of the resolved config; Hub custom code whose classes
    do not build or run under the installed transformers is resolved again and analysed
    under the release it was written for."""
    if resolved.isolated is not None:
        return resolved, resolved.isolated.plan
    text = None if resolved.custom_code else text_part(resolved.config)
    if text is not None:  # a multimodal checkpoint: its text model
        return _composite(resolved, text)
    try:
        with step("building and tracing a shrunk copy, proving replacements"):
            return resolved, analyze(resolved.config)
    except CannotBuild as e:
        if not resolved.custom_code:
            if "cannot build" not in str(e):  # the shrunk model built, and its example run failed
                raise
            raise CannotBuild(f"{e} ({_whose_limit(resolved)})") from e
    resolved = isolated(resolved)
    return resolved, resolved.isolated.plan


def _composite(resolved, text):
    """(resolved, plan) of the text model nested in a multimodal config: its own modeling
    source analysed, and where the multimodal checkpoint keeps it (analyze/composite.py)."""
    text_lm = text_causal_lm(text)
    source = Path(sys.modules[text_lm.__module__].__file__)
    resolved = dataclasses.replace(resolved, modeling_path=source, modeling_module=text_lm.__module__)
    with step("building and tracing a shrunk copy of the text model, proving replacements"):
        try:
            plan = analyze(text)
        except CannotBuild as e:
            if "cannot build" not in str(e):  # the shrunk model built, and its example run failed
                raise
            raise CannotBuild(f"{e} ({_whose_limit(resolved)})") from e
        layout = composite_plan(resolved.config, shrink_config(text))
    if isinstance(layout, NoMatch):
        raise HfrewriteError(f"{resolved.model_type}: {layout}")
    return resolved, dataclasses.replace(plan, composite=layout)


def _whose_limit(resolved) -> str:
    """Why the traced model does not build: the config itself (transformers builds no model
    from it either), or hfrewrite's shrunk copy of it."""
    if _builds(resolved.config):
        return "the config itself builds: the shrunk copy the analysis traces does not, a limit of hfrewrite"
    if resolved.source_kind == "type":
        return (
            f"transformers {resolved.transformers_version}'s default {resolved.model_type} config "
            "builds no model: convert a checkpoint's directory or config.json"
        )
    return "transformers builds no model from this config either"


def _builds(config) -> bool:
    """Whether transformers builds ``config``'s causal LM as it is (on the meta device: no
    memory for the weights of a full-size default config)."""
    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 (whatever the model's own code raises: it does not build)
        return False
    return True


def isolated(resolved):
    """``resolved`` (Hub custom code) resolved and analysed again under the transformers
    release its repository was written for."""
    again = resolve(resolved.location, resolved.revision, True, isolate=True)
    return dataclasses.replace(resolved, **_isolated_fields(again))


def _isolated_fields(again) -> dict:
    names = ("config", "modeling_path", "modeling_module", "transformers_version", "isolated")
    return {name: getattr(again, name) for name in names}


def _defined_in_file(plan, module: cst.Module, filename: str) -> None:
    """Custom code whose model classes live in other files (a subclass of transformers'
    own classes) cannot be rewritten from the repository's file: say which class is missing."""
    defined = {node.name.value for node in module.body if isinstance(node, cst.ClassDef)}
    needed = [plan.architecture, plan.base_model_class, plan.decoder_layer.module_class]
    needed += [p.module_class for p in (plan.attention, plan.mlp, plan.moe) if p is not None]
    missing = [name for name in needed if name not in defined]
    if missing:
        raise HfrewriteError(
            f"{plan.model_type}: {missing[0]} is not defined in the repository's {filename} (it comes "
            "from another module): custom code is converted only from the file that defines its classes"
        )


# ``generate`` as defined here (tests may replace the module attribute; `check` then stays
# in-process, where the replacement is seen).
PIPELINE = generate
