"""Resolve a model id to its config and the installed modeling source it is rewritten from.

A model id is, in this order: an existing local directory holding ``config.json``; a bare
model type known to transformers (``llama``), built from the config class defaults; or a
Hugging Face Hub id (``org/name``) whose ``config.json`` comes from the local cache, or the
Hub when the cache lacks it. A config whose ``auto_map`` names its own
``AutoModelForCausalLM`` (Hub custom code) is refused unless ``--trust-remote-code`` is
given; with it, the repository's own modeling file is the source (``custom_code``), never
transformers' class of the same type name.

Transformers and huggingface_hub are imported lazily so that ``hfrewrite --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrewrite.errors import HfrewriteError


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model came from, its config, and the modeling source to rewrite."""

    model_id: str  # as the user gave it (never made absolute: it is recorded in headers)
    source_kind: str  # "dir", "type" or "hub"
    revision: str | None  # Hub revision as given; None for dirs and types
    model_type: str  # e.g. "llama"
    config: Any  # transformers.PretrainedConfig
    modeling_path: Path  # installed transformers/models/<type>/modeling_<type>.py
    modeling_module: str  # e.g. "transformers.models.llama.modeling_llama"
    transformers_version: str
    trust_remote_code: bool = False  # recorded so `check` re-resolves the same way
    # The source is the repository's own code (auto_map), loaded with trust_remote_code.
    custom_code: bool = False
    # model_id is a directory path relative to the generated file's directory (so that
    # `check` finds it from any working directory)
    relative_to_file: bool = False
    # The transformers 4.x release asked for with --analysis-transformers (recorded)
    analysis_transformers: str | None = None
    # The repository's code does not build under the installed transformers: its analysis,
    # run under the release it was written for (hfrewrite/isolate/)
    isolated: Any = None
    # How this process reaches custom code: the directory made absolute, or the Hub id
    location: str = ""


def relative_to_file(resolved: ResolvedModel, directory: Path) -> ResolvedModel:
    """``resolved`` recording a relative local directory relative to ``directory`` (where
    the generated file goes) instead of the working directory; other sources unchanged."""
    if resolved.source_kind != "dir" or Path(resolved.model_id).expanduser().is_absolute():
        return resolved
    where = os.path.relpath(Path(resolved.model_id).resolve(), Path(directory).resolve())
    return dataclasses.replace(resolved, model_id=Path(where).as_posix(), relative_to_file=True)


def resolve(
    model_id: str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    analysis_transformers: str | None = None,
    isolate: bool = False,
) -> ResolvedModel:
    """Resolve ``model_id``; bad input raises HfrewriteError with a one-line message.
    ``analysis_transformers``: analyse Hub custom code under that transformers 4.x release;
    ``isolate``: under the release it names (its code does not build here)."""
    if not model_id.strip():
        raise HfrewriteError("empty model id")
    path = Path(model_id).expanduser()
    if path.is_dir():
        _no_revision(model_id, revision, "a local directory")
        data = _read_config(path / "config.json", model_id, missing=f"no config.json in {model_id}")
        kind = "dir"
    elif path.exists():
        raise HfrewriteError(f"{model_id}: is a file; give the directory holding config.json")
    elif _is_known_type(model_id):
        _no_revision(model_id, revision, "a model type")
        return _build(model_id, "type", None, model_id, None, trust_remote_code)
    elif _looks_like_path(model_id):
        raise HfrewriteError(f"{model_id}: no such directory")
    else:
        config_file = _hub_config(model_id, revision)
        data = _read_config(config_file, model_id, missing=f"no config.json in {model_id}")
        kind = "hub"
    model_type = _model_type(data, model_id, trust_remote_code)
    if _custom_model_class(data) is not None:
        return _build_custom(model_id, kind, revision, model_type, data, analysis_transformers, isolate)
    if analysis_transformers:
        raise HfrewriteError(
            f"{model_id}: --analysis-transformers applies to Hub custom code (auto_map); "
            "this model is transformers' own"
        )
    return _build(model_id, kind, revision, model_type, data, trust_remote_code)


def _custom_model_class(data: dict) -> str | None:
    """The ``auto_map`` reference of the repository's own causal LM class, if any."""
    auto_map = data.get("auto_map")
    return auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None


def _no_revision(model_id: str, revision: str | None, what: str) -> None:
    if revision is not None:
        raise HfrewriteError(f"{model_id}: --revision applies to Hub ids, not to {what}")


def _looks_like_path(model_id: str) -> bool:
    """True for strings that can only mean a local path (Hub ids are `name` or `org/name`)."""
    return model_id.startswith((".", "/", "~")) or model_id.count("/") > 1 or "\\" in model_id


def _is_known_type(name: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return name in CONFIG_MAPPING


def _read_config(file: Path, model_id: str, missing: str) -> dict:
    """Parse config.json into a dict, with one-line errors for missing or malformed files."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HfrewriteError(missing) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HfrewriteError(f"{model_id}: cannot read config.json: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HfrewriteError(
            f"{model_id}: config.json is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    if not isinstance(data, dict):
        raise HfrewriteError(f"{model_id}: config.json must hold a JSON object, not {type(data).__name__}")
    return data


def _model_type(data: dict, model_id: str, trust_remote_code: bool) -> str:
    """The config's model_type, after the custom-code and known-type checks."""
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HfrewriteError(f"{model_id}: config.json has no model_type")
    known = _is_known_type(model_type)
    if "auto_map" in data:
        if not trust_remote_code:
            native = (
                f" (transformers has its own {model_type!r}: to convert that instead, remove auto_map "
                "from config.json)"
                if known
                else ""
            )
            raise HfrewriteError(
                f"{model_id}: config.json uses Hub custom code (auto_map); refusing without "
                f"--trust-remote-code{native}"
            )
        if not known and _custom_model_class(data) is None:
            raise HfrewriteError(
                f"{model_id}: model type {model_type!r} exists only as Hub custom code and its "
                "auto_map names no AutoModelForCausalLM"
            )
    elif not known:
        raise HfrewriteError(
            f"{model_id}: unknown model type {model_type!r} (not in transformers {_transformers_version()})"
        )
    return model_type


# Fields a bare model type's default config lacks although its modeling code reads them,
# set as every Hub config of the type sets them: transformers 5.19's DbrxAttention reads
# attn_config.rope_theta (no default) and clamps q/k/v with clip_qkv (None cannot clamp).
BARE_TYPE_FIELDS = {"dbrx": {"attn_config": {"rope_theta": 500000, "clip_qkv": 8}}}


def _build(
    model_id: str,
    kind: str,
    revision: str | None,
    model_type: str,
    data: dict | None,
    trust_remote_code: bool,
) -> ResolvedModel:
    """Build the config with the installed config class (never Hub code) and locate the source."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    modeling_module, modeling_path = _installed_source(model_id, model_type)
    try:
        if data is None:
            config = AutoConfig.for_model(model_type, **BARE_TYPE_FIELDS.get(model_type, {}))
        else:
            config = CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as exc:  # noqa: BLE001 - the config class's own validation, any kind
        first = (str(exc).strip().splitlines() or [""])[0]
        raise HfrewriteError(
            f"{model_id}: invalid {model_type} config: {type(exc).__name__}: {first}"
        ) from None
    return ResolvedModel(
        model_id=model_id,
        source_kind=kind,
        revision=revision,
        model_type=model_type,
        config=config,
        modeling_path=modeling_path,
        modeling_module=modeling_module,
        transformers_version=_transformers_version(),
        trust_remote_code=trust_remote_code,
    )


def _installed_source(model_id: str, model_type: str) -> tuple[str, Path]:
    """The module and file of the type's installed modeling source: ``modeling_<type>.py``
    in its folder, else the file defining the causal LM transformers maps the type to
    (``gpt-sw3`` is GPT-2's class; ``data2vec-text`` lives in ``modeling_data2vec_text.py``)."""
    import importlib.util

    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    module = model_type_to_module_name(model_type)
    path = _transformers_root() / "models" / module / f"modeling_{module}.py"
    if path.is_file():
        return f"transformers.models.{module}.modeling_{module}", path
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name:
        import transformers

        defining = getattr(getattr(transformers, class_name, None), "__module__", "")
        spec = importlib.util.find_spec(defining) if defining.startswith("transformers.") else None
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            return defining, Path(spec.origin)
    raise HfrewriteError(
        f"{model_id}: model type {model_type!r} has no installed modeling file "
        f"transformers/models/{module}/modeling_{module}.py and no causal LM class of its own; "
        "hfrewrite rewrites only those"
    )


def _build_custom(
    model_id: str,
    kind: str,
    revision: str | None,
    model_type: str,
    data: dict,
    requested: str | None,
    isolate: bool = False,
) -> ResolvedModel:
    """The repository's config (built by its own class) and its causal LM's source file;
    where its code does not load under the installed transformers (or a release is asked
    for), both come from an analysis under the release it was written for."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    reference = _custom_model_class(data)
    where = str(Path(model_id).expanduser()) if kind == "dir" else model_id
    if requested or isolate:
        return isolated_resolution(model_id, kind, revision, model_type, data, requested)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=True, revision=revision)
        model_class = get_class_from_dynamic_module(reference, where, revision=revision)
    except OSError as exc:  # a file the repository lacks: no transformers release helps
        first = (str(exc).strip().splitlines() or [""])[0]
        raise HfrewriteError(
            f"{model_id}: the repository's code ({reference}) does not load under transformers "
            f"{_transformers_version()}: {type(exc).__name__}: {first}"
        ) from None
    except Exception:  # noqa: BLE001 - foreign code written for another release
        return isolated_resolution(model_id, kind, revision, model_type, data, None)
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
        location=str(Path(where).resolve()) if kind == "dir" else where,
    )


def isolated_resolution(
    model_id: str, kind: str, revision: str | None, model_type: str, data: dict, requested: str | None
) -> ResolvedModel:
    """Hub custom code resolved and analysed under a transformers 4.x overlay; its config
    here is the repository's values on transformers' base class."""

    from hfrewrite.isolate.analysis import analyze_isolated

    where = str(Path(model_id).expanduser()) if kind == "dir" else model_id
    isolated = analyze_isolated(where, revision, data, requested)
    return ResolvedModel(
        model_id=model_id,
        source_kind=kind,
        revision=revision,
        model_type=model_type,
        config=_base_config(isolated.config_data),
        modeling_path=isolated.modeling_path,
        modeling_module=isolated.modeling_module,
        transformers_version=isolated.version,
        trust_remote_code=True,
        custom_code=True,
        analysis_transformers=requested,
        isolated=isolated,
        location=str(Path(where).resolve()) if kind == "dir" else where,
    )


def _base_config(data: dict):
    """The repository's values on transformers' base config class. ``rope_scaling`` is set
    last: transformers 5 reads it with the other fields (a YaRN config's positions) at hand."""
    from transformers import PretrainedConfig

    data = dict(data)
    rope_scaling = data.pop("rope_scaling", None)
    config = PretrainedConfig.from_dict(data)
    if rope_scaling is not None:
        config.rope_scaling = rope_scaling
    return config


def _transformers_root() -> Path:
    import transformers

    return Path(transformers.__file__).parent


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _hub_config(model_id: str, revision: str | None) -> Path:
    """config.json of a Hub repo: the local cache first, then the Hub unless offline."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{model_id}@{revision}" if revision else model_id
    try:
        return Path(hf_hub_download(model_id, "config.json", revision=revision, local_files_only=True))
    except HFValidationError:
        raise HfrewriteError(
            f"{model_id}: not a local directory, a model type known to transformers "
            f"{_transformers_version()}, or a valid Hub id"
        ) from None
    except (LocalEntryNotFoundError, EntryNotFoundError, OSError):
        pass  # not cached: try the Hub below
    offline = constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in {
        "1",
        "ON",
        "YES",
        "TRUE",
    }
    unreachable = (
        f"{at}: not a local directory or a model type known to transformers "
        f"{_transformers_version()}, and not in the local Hugging Face cache"
    )
    if offline:
        raise HfrewriteError(f"{unreachable}, and the Hub is unreachable (HF_HUB_OFFLINE is set)")
    # Fail fast, not after the client's retries.
    if (why := _hub_unreachable()) is not None:
        raise HfrewriteError(f"{unreachable}, and the Hub is unreachable ({why})")
    try:
        return Path(hf_hub_download(model_id, "config.json", revision=revision))
    # LocalEntryNotFoundError (an EntryNotFoundError): the connection failed.
    except LocalEntryNotFoundError as exc:
        raise HfrewriteError(f"{unreachable}, and the Hub is unreachable ({type(exc).__name__})") from None
    except GatedRepoError:
        raise HfrewriteError(f"{at}: gated on the Hub; log in with `hf auth login` first") from None
    except RepositoryNotFoundError:
        raise HfrewriteError(
            f"{at}: not a local directory, a model type known to transformers "
            f"{_transformers_version()}, or a Hub repository"
        ) from None
    except RevisionNotFoundError:
        raise HfrewriteError(f"{at}: revision {revision!r} not found on the Hub") from None
    except EntryNotFoundError:
        raise HfrewriteError(f"{at}: the Hub repository has no config.json") from None
    except (HfHubHTTPError, OSError) as exc:
        raise HfrewriteError(f"{unreachable}, and the Hub is unreachable ({type(exc).__name__})") from None


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hub endpoint cannot be reached (one TCP connect), or None."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or type(exc).__name__}"
