"""The `hfrewrite` command: argument parsing and printing only.

``convert`` resolves a model, generates its vLLM file and writes ``<out>/<model_type>.py``,
or into a vLLM source tree (``--vllm-tree``: hfrewrite.deliver.vllm_tree) or a plugin package
(``--plugin``: hfrewrite.deliver.plugin); ``check`` regenerates generated files and diffs them;
``verify`` runs the generated file in real vLLM (hfrewrite.verify.command). Bad input raises
HfrewriteError, printed as one line ``hfrewrite: error: ...`` on stderr with exit code 2
and nothing written; anything else is a bug and keeps its traceback (exit code 1).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import warnings
from pathlib import Path

from hfrewrite import __version__
from hfrewrite.errors import CannotBuild, HfrewriteError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _quiet_libraries()
    signal.signal(signal.SIGTERM, _interrupt)  # unwind like Ctrl-C: temporary files are removed
    signal.signal(signal.SIGINT, _interrupt)
    _INTERRUPTED.clear()
    try:
        if args.list_passes:
            return _list_passes()
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return args.run(args)
    except HfrewriteError as exc:
        if _INTERRUPTED:  # the interrupt surfaced through code that reports failures as refusals
            print("hfrewrite: error: interrupted", file=sys.stderr)
            return 130
        message = " ".join(str(exc).split())  # always exactly one line
        print(f"hfrewrite: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; writes are atomic, so nothing is half-written
        print("hfrewrite: error: interrupted", file=sys.stderr)
        return 130


# Set once Ctrl-C or SIGTERM arrives: torch re-raises an exception raised inside one of its
# calls as a RuntimeError, which the analysis may report as a refusal; it is still an interrupt
_INTERRUPTED: set[int] = set()


def _interrupt(signum, frame) -> None:
    _INTERRUPTED.add(signum)
    raise KeyboardInterrupt


def _quiet_libraries() -> None:
    """Keep stderr for hfrewrite's own messages: torch's "Triton not available" notice
    (triton is removed on CPU machines) and transformers' fallback-kernel warnings, emitted
    while hfrewrite builds models for tracing, are noise to a user of the CLI."""
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # the modeling code's own warnings while it is built and traced (codegen's deprecated
    # indexing): an error stays the one line the CLI promises
    for library in ("transformers", "torch"):
        warnings.filterwarnings("ignore", module=library)


class _OneLineErrors(argparse.ArgumentParser):
    """Usage errors as the one line every other bad input gets (exit 2), not usage + error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="hfrewrite",
        description="Rewrite a Hugging Face Transformers modeling file into a vLLM model file.",
    )
    parser.add_argument("--version", action="version", version=f"hfrewrite {__version__}")
    parser.add_argument(
        "--list-passes",
        action="store_true",
        help="list the rewrite passes in pipeline order",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineErrors)

    p = sub.add_parser("convert", help="write <DIR>/<model_type>.py for a model")
    p.add_argument("model", metavar="MODEL", help="local directory, Hub id or model type")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "-o",
        "--output-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="output directory (default: ./out)",
    )
    where.add_argument(
        "--vllm-tree",
        type=Path,
        metavar="PATH",
        help="vLLM source checkout: write vllm/model_executor/models/hfrewrite_<type>.py "
        "and register it in registry.py",
    )
    where.add_argument(
        "--plugin",
        type=Path,
        metavar="DIR",
        help="write (or extend) an installable vLLM plugin package in DIR",
    )
    p.add_argument(
        "--plugin-name",
        metavar="NAME",
        help="Python package name of the plugin (default: DIR's name)",
    )
    p.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accept configs with auto_map: the repository's own modeling code is built and run "
        "to analyze it (as transformers runs it)",
    )
    p.add_argument(
        "--analysis-transformers",
        metavar="VERSION",
        help="with --trust-remote-code: analyse the repository's code under this transformers 4.x "
        "release (installed once into the user's cache; default: when its code does not build "
        "under the installed transformers, the release config.json names, else the newest 4.x)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite a different existing file; with --vllm-tree, also remap "
        "architectures mapped to modules hfrewrite did not generate; with --plugin, "
        "also replace package files hfrewrite did not write",
    )
    p.add_argument("--explain", action="store_true", help="also list what was not fused and why")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip convert-time validation (running the file in vLLM against HF "
        "on a tiny random checkpoint before writing it)",
    )
    p.add_argument(
        "--configs",
        type=Path,
        metavar="DIR",
        help="also validate the file on each released config.json under DIR (same model type; "
        "sizes as released, shrunk for the run): one file must serve them all",
    )
    p.set_defaults(run=_convert)

    p = sub.add_parser("check", help="regenerate generated files and diff them")
    p.add_argument("paths", nargs="*", type=Path, metavar="PATH", help="files or directories")
    p.add_argument(
        "--vllm-tree",
        type=Path,
        metavar="PATH",
        help="vLLM source checkout: check its generated models and their registry entries",
    )
    p.add_argument("--fix", action="store_true", help="rewrite the files that differ")
    p.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="regenerate in N worker processes (default: the core count); the report "
        "is the same as with -j 1",
    )
    p.set_defaults(run=_check)

    p = sub.add_parser("verify", help="run the generated file in real vLLM against HF")
    p.add_argument(
        "model_type",
        metavar="MODEL_TYPE|CHECKPOINT_DIR",
        help="a model type (tiny random checkpoints, vLLM native compared too) or a "
        "checkpoint directory (its own weights, against Hugging Face)",
    )
    p.add_argument(
        "--generated",
        type=Path,
        metavar="FILE",
        help="generated file to verify (default: generate it now)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="with CHECKPOINT_DIR: the dtype both sides compute in (default float32; bfloat16 for a "
        "file generated now whose state layers vLLM computes in no other)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="with CHECKPOINT_DIR: greedy tokens per prompt (default 16)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="with CHECKPOINT_DIR: run the checkpoint's own modeling code (auto_map) in Hugging "
        "Face and vLLM, and convert from it when --generated is not given",
    )
    p.set_defaults(run=_verify)

    p = sub.add_parser(
        "setup-analysis",
        help="install a transformers 4.x release for analysing Hub custom code (into the user's cache)",
    )
    p.add_argument("version", metavar="VERSION", help="e.g. 4.57.3")
    p.set_defaults(run=_setup_analysis)
    return parser


def _setup_analysis(args: argparse.Namespace) -> int:
    from hfrewrite.isolate.environment import ensure_overlay, parse_version

    parse_version(args.version)
    print(ensure_overlay(args.version))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from hfrewrite.resolve import relative_to_file, resolve

    if args.plugin_name is not None and args.plugin is None:
        raise HfrewriteError("--plugin-name needs --plugin DIR")
    if args.vllm_tree is not None:
        from hfrewrite.deliver.vllm_tree import models_dir

        models_dir(args.vllm_tree)  # not a vLLM tree: fail before the slow part
    if args.plugin is not None:
        _check_destination(args.plugin, "--plugin")
    elif args.vllm_tree is None:
        _check_destination(args.output_dir or Path("out"), "-o")
    if args.analysis_transformers is not None and not args.trust_remote_code:
        raise HfrewriteError("--analysis-transformers analyses Hub custom code: it needs --trust-remote-code")
    from hfrewrite.progress import step

    with step(f"resolving {args.model}"):  # (loads transformers: the first seconds)
        resolved = relative_to_file(
            resolve(args.model, args.revision, args.trust_remote_code, args.analysis_transformers),
            _destination(args),
        )
    _refuse_a_file_in_the_way(args, resolved)
    more = ()  # released configs the file must serve too (before the slow part)
    if args.configs is not None:
        if args.no_verify:
            raise HfrewriteError("--configs validates the file on each config: it cannot go with --no-verify")
        from hfrewrite.config_matrix import load_configs

        more = load_configs(args.configs, resolved.model_type)
    with step("loading torch"):
        from hfrewrite import convert  # after resolve: bad input fails before torch loads

    generated = convert.generate(resolved)
    if args.no_verify:
        validated = "not validated (--no-verify)"
    else:
        from hfrewrite.verify.validate import validate

        try:
            with step("validating in vLLM against Hugging Face (tiny random checkpoints)"):
                validated = validate(resolved, generated, more).line()
        except CannotBuild:  # the repository's code builds here but does not run its checkpoint
            if not resolved.custom_code or generated.isolated is not None:
                raise
            resolved = convert.isolated(resolved)
            generated = convert.generate(resolved)
            with step("validating in vLLM against Hugging Face (tiny random checkpoints)"):
                validated = validate(resolved, generated, more).line()
    written = _write(args, resolved, generated)

    # Grouped by module class (classes in order of first appearance, rows in pass order).
    classes = list(dict.fromkeys(r.module_class for r in generated.fused))
    rows = sorted(
        ((r.module_class, r.fused) for r in generated.fused),
        key=lambda row: classes.index(row[0]),
    )
    print(_table(("module class", "fused"), rows) if rows else "nothing fused")
    if args.explain:
        rows = [(n.module_class, n.pattern, n.reason) for n in generated.declined]
        print()
        print(_table(("module class", "declined", "reason"), rows) if rows else "nothing declined")
    print()
    print(validated)
    print("\n".join(written))
    return 0


def _refuse_a_file_in_the_way(args: argparse.Namespace, resolved) -> None:
    """Before the slow part: the -o target exists, and the file about to be written would
    differ from it for sure (not hfrewrite's, or generated from another model), without
    --force. (A file hfrewrite generated from this model is compared once regenerated.)"""
    if args.force or args.vllm_tree is not None or args.plugin is not None:
        return
    out = (args.output_dir or Path("out")) / f"{resolved.model_type}.py"
    if not out.is_file():
        return
    from hfrewrite.emit.output import parse_header, record_for

    record, model = parse_header(out.read_text(errors="replace")), record_for(resolved).model
    if record is None:
        raise HfrewriteError(f"{out} exists and is not a file hfrewrite wrote; use --force to overwrite it")
    if record.model != model:
        raise HfrewriteError(
            f"{out} exists, generated from {record.model}, not {model}; use --force to overwrite it"
        )


def _destination(args: argparse.Namespace) -> Path:
    """The directory the generated model file goes to."""
    if args.plugin is not None:
        from hfrewrite.deliver.plugin import package_name

        return Path(args.plugin) / package_name(args.plugin, args.plugin_name)
    if args.vllm_tree is not None:
        from hfrewrite.deliver.vllm_tree import models_dir

        return models_dir(args.vllm_tree)
    return args.output_dir or Path("out")


def _check_destination(directory: Path, option: str) -> None:
    """Fail before the slow part when ``directory`` cannot receive a file: it is a file,
    lies under one, or cannot be written."""
    path = Path(directory)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        raise HfrewriteError(f"{option} {directory}: {where}; give a directory")
    try:  # a probe, not os.access: root passes access checks on read-only places
        with tempfile.TemporaryFile(dir=existing, prefix=".hfrewrite-probe-"):
            pass
    except OSError as exc:
        raise HfrewriteError(f"{option} {directory}: cannot write in {existing} ({exc.strerror})") from None


def _write(args: argparse.Namespace, resolved, generated) -> list[str]:
    """Write the generated file where the options say; the lines that report it."""
    from hfrewrite.emit.output import write_atomic

    def done(status: str, path: Path) -> str:
        return f"{'wrote' if status == 'written' else 'unchanged'} {path}"

    if args.vllm_tree is None and args.plugin is None:
        out = (args.output_dir or Path("out")) / generated.filename
        return [done(write_atomic(out, generated.text, force=args.force), out)]
    from hfrewrite.deliver.vllm_tree import architectures, causal_lm_class

    named = tuple(getattr(resolved.config, "architectures", None) or ())
    cls = causal_lm_class(generated.text, preferred=named)
    archs = architectures(resolved.config, cls)
    if args.vllm_tree is not None:
        from hfrewrite.deliver.vllm_tree import install

        tree = install(args.vllm_tree, generated.text, resolved.model_type, archs, cls, args.force)
        lines = [done(tree.module_status, tree.module_path)]
        for arch, (module, name) in tree.registered:
            lines.append(f"registered {arch} -> {module}.{name}")
        for table, arch, (module, name) in tree.replaced:
            lines.append(f"  {arch} was {module}.{name} in {table}")
        lines.append(done(tree.registry_status, tree.registry_path))
        if tree.hooks is not None:  # an attention-free model: vLLM's Mamba config hook
            lines.append(done(tree.hooks[1], tree.hooks[0]))
        return lines
    from hfrewrite.deliver.plugin import install

    plugin = install(
        args.plugin,
        generated.text,
        resolved.model_type,
        archs,
        cls,
        args.plugin_name,
        args.force,
    )
    lines = [done(status, path) for path, status in plugin.written]
    lines += [f"registers {arch} -> {target}" for arch, target in plugin.registered]
    lines.append(f"install with: pip install {args.plugin}")
    return lines


def _check(args: argparse.Namespace) -> int:
    from hfrewrite.deliver.check import check_paths

    if not args.paths and args.vllm_tree is None:
        raise HfrewriteError("give PATH... or --vllm-tree PATH")
    report = check_paths(args.paths, fix=args.fix, vllm_tree=args.vllm_tree, jobs=args.jobs)
    sys.stdout.write(report.format())
    return report.exit_code


def _verify(args: argparse.Namespace) -> int:
    # Imported lazily: verification pulls in vLLM.
    checkpoint = (Path(args.model_type) / "config.json").is_file()
    verify = importlib.import_module(
        "hfrewrite.verify.checkpoint" if checkpoint else "hfrewrite.verify.command"
    )
    return int(verify.main(args) or 0)


def _list_passes() -> int:
    # The pass registry is hfrewrite.emit.pipeline.PASSES (the lead's); imported lazily.
    if importlib.util.find_spec("hfrewrite.emit.pipeline") is None:
        raise HfrewriteError("the pass registry is not available yet (hfrewrite/emit/pipeline.py)")
    passes = importlib.import_module("hfrewrite.emit.pipeline").PASSES
    entries = passes.items() if isinstance(passes, dict) else ((None, p) for p in passes)
    rows = []
    for i, (key, p) in enumerate(entries, 1):
        name = key or getattr(p, "NAME", None) or getattr(p, "name", None)
        name = name or getattr(p, "__name__", str(p)).rsplit(".", 1)[-1]
        doc = "" if isinstance(p, str) else getattr(p, "summary", None) or p.__doc__ or ""
        rows.append((str(i), str(name), doc.strip().split("\n")[0]))
    print(_table(("#", "pass", "what it does"), rows))
    return 0


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns, the last one unpadded."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = []
    for row in [head, *rows]:
        cells = [c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
