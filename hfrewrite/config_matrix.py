"""``convert --configs DIR``: released configs a generated file must also serve.

Each ``*.json`` under DIR is a checkpoint's ``config.json`` as released (sizes kept); it is
built with the installed configuration class of the converted model type, as vLLM builds it,
and validation runs the file on a shrunk copy of it (every switch kept). Fields that describe
the checkpoint's weights or its loading rather than the architecture are dropped first:
``quantization_config`` (the tiny checkpoint is float32), ``auto_map`` (the matrix proves the
installed source, not a repository's copy of it).
"""

from __future__ import annotations

import json
from pathlib import Path

from hfrewrite.errors import HfrewriteError

NOT_ARCHITECTURE = ("quantization_config", "auto_map", "_name_or_path")


def load_configs(directory: Path, model_type: str) -> tuple[tuple[str, object], ...]:
    """(file name, config) for each ``*.json`` under ``directory`` (sorted); one-line errors
    for a missing directory, an unreadable file or another model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    directory = Path(directory)
    if not directory.is_dir():
        raise HfrewriteError(f"--configs {directory}: no such directory")
    files = sorted(directory.rglob("*.json"))
    if not files:
        raise HfrewriteError(f"--configs {directory}: no *.json config files in it")
    out = []
    for file in files:
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HfrewriteError(f"--configs: {file}: not a readable JSON config ({exc})") from None
        if not isinstance(data, dict) or data.get("model_type") != model_type:
            found = data.get("model_type") if isinstance(data, dict) else None
            raise HfrewriteError(
                f"--configs: {file}: model_type {found!r}, the converted model is {model_type!r}"
            )
        for key in NOT_ARCHITECTURE:
            data.pop(key, None)
        try:
            config = CONFIG_MAPPING[model_type].from_dict(data)
        except (ValueError, TypeError, KeyError) as exc:
            raise HfrewriteError(f"--configs: {file}: invalid {model_type} config: {exc}") from None
        out.append((file.stem, config))
    return tuple(out)
