"""Convert into a vLLM source tree: write the model module and register it in vLLM's registry.

``hfrewrite convert MODEL --vllm-tree PATH`` writes the generated file as
``PATH/vllm/model_executor/models/hfrewrite_<model_type>.py`` (the ``hfrewrite_`` prefix keeps
vLLM's own ``llama.py`` etc. intact) and maps the model's architectures to its causal-LM class
in the ``_TEXT_GENERATION_MODELS`` table of ``PATH/vllm/model_executor/models/registry.py``
(edited by ``hfrewrite.deliver.registry_table``, which says what it changes and refuses).
A module counts as hfrewrite's when its file has an ``hfrewrite-source`` header (vLLM's
own ``llama`` does not): only such entries are remapped without ``force``.

An attention-free model (Mamba-2 layers alone) also gets vLLM's Mamba config hook for each
architecture in ``PATH/vllm/model_executor/models/config.py`` (``hfrewrite.deliver.config_hooks``):
vLLM sizes such models' state blocks there and lists only its own.

Nothing is written until every check has passed; the module is written before the registry.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from hfrewrite.deliver.config_hooks import CONFIG_HOOKS, add_mamba_hooks, attention_free_classes, listed
from hfrewrite.deliver.registry_table import REGISTRY, Target, read_tables, register
from hfrewrite.emit.output import parse_header, write_atomic
from hfrewrite.errors import HfrewriteError

MODELS_DIR = REGISTRY.parent
MODULE_PREFIX = "hfrewrite_"


@dataclass(frozen=True)
class TreeResult:
    module_path: Path
    module_status: str  # "written" or "unchanged"
    registry_path: Path
    registry_status: str  # "written" or "unchanged"
    registered: tuple[tuple[str, Target], ...]  # (architecture, target) in table order
    replaced: tuple[tuple[str, str, Target], ...]  # (table, architecture, old target)
    hooks: tuple[Path, str] | None = None  # config.py and its status, for an attention-free model


def models_dir(tree: Path) -> Path:
    """``tree/vllm/model_executor/models``, after checking ``tree`` is a vLLM source tree."""
    if not (Path(tree) / REGISTRY).is_file():
        raise HfrewriteError(f"{tree}: not a vLLM source tree (no {REGISTRY.as_posix()})")
    return Path(tree) / MODELS_DIR


def module_name(model_type: str) -> str:
    """The tree module for a model type: ``hfrewrite_llama`` (never one of vLLM's names)."""
    return MODULE_PREFIX + re.sub(r"\W", "_", model_type)


def causal_lm_class(text: str, preferred: tuple[str, ...] = ()) -> str:
    """The vLLM model class of a generated file: the top-level class defining both
    ``compute_logits`` and ``load_weights`` (vLLM's model interface)."""
    found = [
        node.name
        for node in ast.parse(text).body
        if isinstance(node, ast.ClassDef)
        and {"compute_logits", "load_weights"}
        <= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    ]
    for name in preferred:
        if name in found:
            return name
    if len(found) != 1:
        raise HfrewriteError(f"expected one vLLM model class in the generated file, found {found or 'none'}")
    return found[0]


def architectures(config, class_name: str) -> tuple[str, ...]:
    """The architecture names to register: the config's ``architectures`` (what checkpoints of
    this model say in config.json), else the generated class's own name."""
    names = tuple(getattr(config, "architectures", None) or ())
    return names or (class_name,)


def install(
    tree: Path,
    generated_text: str,
    model_type: str,
    archs: tuple[str, ...],
    class_name: str,
    force: bool,
) -> TreeResult:
    """Write the module into ``tree`` and register ``archs`` -> ``class_name`` in it."""
    models = models_dir(tree)
    module = module_name(model_type)
    module_path = models / f"{module}.py"
    registry_path = Path(tree) / REGISTRY
    old = _read(registry_path)
    # All refusals happen here, before anything is written.
    new, replaced = register(old, {a: (module, class_name) for a in archs}, _owned_by(tree, module), force)
    hooks_path = Path(tree) / CONFIG_HOOKS
    hooks = (
        _read(hooks_path)
        if class_name in attention_free_classes(generated_text) and hooks_path.is_file()
        else ""
    )
    new_hooks = add_mamba_hooks(hooks, archs) if hooks else ""
    module_status = write_atomic(module_path, generated_text, force=force)
    registry_status = "unchanged"
    if new != old:
        registry_status = write_atomic(registry_path, new, force=True)
    hooks_status = "unchanged"
    if new_hooks != hooks:  # an attention-free model's architectures: vLLM's Mamba config hook
        hooks_status = write_atomic(hooks_path, new_hooks, force=True)
    return TreeResult(
        module_path=module_path,
        module_status=module_status,
        registry_path=registry_path,
        registry_status=registry_status,
        registered=tuple((a, (module, class_name)) for a in archs),
        replaced=replaced,
        hooks=(hooks_path, hooks_status) if hooks else None,
    )


def _owned_by(tree: Path, new_module: str):
    """``owned(module) -> bool``: whether a registry module name is a file hfrewrite generated
    (or the module about to be written)."""

    def owned(module: str) -> bool:
        if module == new_module:
            return True
        path = _module_file(tree, module)
        return path is not None and parse_header(_read(path)) is not None

    return owned


def _module_file(tree: Path, module: str) -> Path | None:
    """The file of a registry module name (``llama`` or ``vllm.models.deepseek_v32``)."""
    rel = Path(*module.split(".")) if module.startswith("vllm.") else MODELS_DIR / module
    for candidate in (
        Path(tree) / rel.with_suffix(".py"),
        Path(tree) / rel / "__init__.py",
    ):
        if candidate.is_file():
            return candidate
    return None


def registry_problems(tree: Path) -> tuple[str, ...]:
    """Registry entries of generated modules that would fail in vLLM: the module is missing
    or does not define the class, or the class is attention-free and ``config.py`` gives its
    architecture no Mamba config hook. (``hfrewrite check --vllm-tree`` reports them.)"""
    problems = []
    hooks_path = Path(tree) / CONFIG_HOOKS
    hooked = listed(_read(hooks_path)) if hooks_path.is_file() else None
    for table, entries in read_tables(_read(Path(tree) / REGISTRY)).items():
        for arch, target in entries.items():
            if target is None:
                continue
            module, cls = target
            path = _module_file(tree, module)
            if path is None:
                if module.startswith(MODULE_PREFIX):
                    problems.append(
                        f"{table} maps {arch} to {module}.{cls}, but there is no "
                        f"{(MODELS_DIR / module).as_posix()}.py"
                    )
                continue
            text = _read(path)
            if parse_header(text) is None:
                continue  # vLLM's own module
            if cls not in _classes(text, path):
                problems.append(f"{table} maps {arch} to {module}.{cls}, but {path} defines no class {cls}")
            elif hooked is not None and arch not in hooked and cls in attention_free_classes(text):
                problems.append(
                    f"{arch} ({module}.{cls}) is attention-free, but {CONFIG_HOOKS.as_posix()} gives it no "
                    f"Mamba config hook in MODELS_CONFIG_MAP; rerun `hfrewrite convert MODEL --vllm-tree {tree}`"
                )
    return tuple(problems)


def _classes(text: str, path: Path) -> set[str]:
    try:
        body = ast.parse(text).body
    except SyntaxError as exc:
        raise HfrewriteError(f"{path} does not parse: {exc.msg} at line {exc.lineno}") from None
    return {node.name for node in body if isinstance(node, ast.ClassDef)}


def _read(path: Path) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HfrewriteError(f"{path}: cannot read: {exc}") from None
