"""Resolve Hub custom code (``auto_map`` + ``--trust-remote-code``): the repository's own
configuration class and modeling file, as transformers loads them, are the source.

Custom code often targets older transformers releases; when it does not import under the
installed one, the error says which class failed and why.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from hfrewrite.errors import HfrewriteError
from hfrewrite.resolve import ResolvedModel, _transformers_version


def build_custom(
    model_id: str, kind: str, revision: str | None, model_type: str, data: dict
) -> ResolvedModel:
    """The repository's config (built by its own class) and its causal LM's source file."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    reference = data["auto_map"]["AutoModelForCausalLM"]
    where = str(Path(model_id).expanduser()) if kind == "dir" else model_id
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=True, revision=revision)
        model_class = get_class_from_dynamic_module(reference, where, revision=revision)
    except Exception as exc:  # noqa: BLE001 - any failure of foreign code is reported as one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise HfrewriteError(
            f"{model_id}: the repository's code ({reference}) does not load under transformers "
            f"{_transformers_version()}: {type(exc).__name__}: {first}"
        ) from None
    source = inspect.getsourcefile(model_class)
    if source is None or not Path(source).is_file():
        raise HfrewriteError(f"{model_id}: no source file for {reference}")
    return ResolvedModel(
        model_id=model_id,
        source_kind=kind,
        revision=revision,
        model_type=model_type,
        config=config,
        modeling_path=Path(source),
        modeling_module=model_class.__module__,
        transformers_version=_transformers_version(),
        trust_remote_code=True,
        custom_code=True,
    )
