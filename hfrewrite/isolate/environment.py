"""The transformers 4.x overlays that isolated analyses run under.

An overlay is a directory of packages (``pip install --target``, no dependencies) holding
one transformers release and the ``huggingface_hub`` and ``tokenizers`` it requires; put
first on ``PYTHONPATH`` it shadows the installed ones while torch, numpy and hfrewrite stay
those of this environment. Overlays live under ``<cache>/transformers/<version>``; a
``.complete`` file marks one installed whole (an install goes to a temporary sibling and is
renamed into place).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hfrewrite.errors import HfrewriteError
from hfrewrite.progress import step

# The oldest release the analysis itself runs under (transformers' AttentionInterface and
# ``from_config(dtype=...)``), and the release used when the checkpoint names an older one.
OLDEST_SUPPORTED = (4, 56, 0)
NEWEST_4X = "4.57.3"
_VERSION = re.compile(r"^4\.(\d+)\.(\d+)$")
_DEPENDENCIES = ("huggingface-hub", "tokenizers")  # transformers checks both at import


def cache_root() -> Path:
    """``$HFREWRITE_CACHE``, else ``$XDG_CACHE_HOME/hfrewrite``, else ``~/.cache/hfrewrite``."""
    if os.environ.get("HFREWRITE_CACHE"):
        return Path(os.environ["HFREWRITE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hfrewrite"


def overlay_dir(version: str) -> Path:
    return cache_root() / "transformers" / version


def parse_version(version: str) -> tuple[int, int, int]:
    match = _VERSION.match(version.strip())
    if match is None:
        raise HfrewriteError(
            f"--analysis-transformers {version!r}: expected a 4.x release such as {NEWEST_4X}"
        )
    return (4, int(match[1]), int(match[2]))


def choose_version(config_data: dict, requested: str | None) -> tuple[str, str]:
    """(release, why): ``requested`` when given, else the checkpoint's ``transformers_version``
    when it is a 4.x release the analysis runs under, else the newest 4.x."""
    if requested:
        if parse_version(requested) < OLDEST_SUPPORTED:
            raise HfrewriteError(
                f"--analysis-transformers {requested}: the analysis runs under transformers "
                f"{'.'.join(map(str, OLDEST_SUPPORTED))} or newer"
            )
        return requested, "asked for"
    named = str(config_data.get("transformers_version") or "")
    if _VERSION.match(named) and parse_version(named) >= OLDEST_SUPPORTED:
        return named, "named by config.json"
    if named:
        return NEWEST_4X, f"config.json names {named}; the analysis needs 4.56 or newer"
    return NEWEST_4X, "the newest 4.x release"


def ensure_overlay(version: str) -> Path:
    """The installed overlay of ``version``, installing it from the package index first if
    the cache lacks it; offline (``HFREWRITE_OFFLINE=1``, or the index unreachable): one
    clear error naming the release and the command that installs it."""
    target = overlay_dir(version)
    if (target / ".complete").is_file():
        return target
    offline = (
        f"the analysis needs transformers {version}, which is not in the cache ({target}) and "
        f"cannot be installed offline: run `hfrewrite setup-analysis {version}` where the package "
        "index is reachable"
    )
    if os.environ.get("HFREWRITE_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise HfrewriteError(offline)
    try:
        with step(f"installing transformers {version} for the analysis into {target} (once)"):
            _install(version, target)
    except HfrewriteError as exc:
        raise HfrewriteError(f"{offline} ({exc})") from None
    return target


def _install(version: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
    try:
        _pip(tmp, f"transformers=={version}")
        specs = _dependency_specs(tmp)
        _pip(tmp, *(f"{name}{specs[name]}" for name in _DEPENDENCIES if name in specs))
        (tmp / ".complete").write_text(json.dumps({"transformers": version}) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pip(target: Path, *requirements: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
    done = subprocess.run([*command, *requirements], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.startswith("ERROR")]
        raise HfrewriteError(
            f"cannot install {' '.join(requirements)} for the analysis: "
            f"{lines[-1] if lines else 'pip exited with ' + str(done.returncode)}"
        )


def _dependency_specs(target: Path) -> dict[str, str]:
    """The version specifiers transformers checks at import, read from its own table."""
    table = (target / "transformers" / "dependency_versions_table.py").read_text()
    specs = {}
    for name in _DEPENDENCIES:
        match = re.search(rf'"{name}": "{name}([^"]*)"', table)
        if match:
            specs[name] = match[1]
    return specs
