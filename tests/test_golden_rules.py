"""What every checked-in generated file must look like, rule by rule (issue: output a vLLM
reviewer would merge). `test_check` proves the goldens are what hfrewrite makes now; these
prove what that is."""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import transformers

from hfrewrite.emit.output import MODULAR_NOTE

GOLDEN = sorted((Path(__file__).parent.parent / "golden").glob("*.py"))
TRANSFORMERS = Path(transformers.__file__).parent


@pytest.fixture(params=GOLDEN, ids=lambda p: p.stem)
def golden(request) -> tuple[str, ast.Module]:
    text = request.param.read_text()
    return text, ast.parse(text)


def test_there_are_goldens():
    assert len(GOLDEN) >= 40


def test_make_golden_regenerates_every_golden():
    """`make golden` converts exactly the types whose files golden/ holds."""
    makefile = (Path(__file__).parent.parent / "Makefile").read_text()
    listed = []
    for name in ("GOLDEN_TYPES", "GOLDEN_CONFIGS"):
        found = re.search(rf"^{name} := (.*?)(?<!\\)\n", makefile, re.DOTALL | re.MULTILINE).group(1)
        listed += found.replace("\\", " ").split()
    assert sorted(listed) == sorted(p.stem for p in GOLDEN)


def test_starts_with_spdx_and_the_source_it_was_adapted_from(golden):
    lines = golden[0].splitlines()
    assert lines[0] == "# SPDX-License-Identifier: Apache-2.0"  # vLLM's SPDX check, both lines
    assert lines[1] == "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project"
    adapted = re.fullmatch(  # (the version on a line of its own where the path is long)
        r"# Adapted from transformers/(models/\w+/modeling_\w+\.py)(?: |\n#   )\(transformers (\S+)\)",
        "\n".join(lines[2:4]) if lines[3].startswith("#   (") else lines[2],
    )
    assert adapted, lines[2:4]
    assert (TRANSFORMERS / adapted[1]).is_file()
    assert adapted[2] == transformers.__version__


def test_keeps_the_source_license_and_drops_the_modular_banner(golden):
    text = golden[0]
    assert "automatically generated from src/transformers" not in text
    assert "\U0001f6a8" not in text
    source = (TRANSFORMERS / re.search(r"# Adapted from transformers/(\S+)", text)[1]).read_text()
    notice = [
        line
        for line in source.splitlines()[:40]
        if line.startswith("# Copyright") or "Licensed under" in line
    ]
    words = " ".join(line.strip("# ") for line in text.splitlines() if line.startswith("#")).split()
    kept = " ".join(words)  # the notice as words: fitted to vLLM's width, lines may break anew
    assert all(" ".join(line.strip("# ").split()) in kept for line in notice)


def test_no_modular_diff_notes(golden):
    comments = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(golden[0]).readline)
        if t.type == tokenize.COMMENT
    ]
    assert not [c for c in comments if MODULAR_NOTE.fullmatch(c)]


def _interface_functions(tree: ast.Module) -> set[int]:
    """Functions whose signature someone else fixes: ``forward``/``backward`` of an autograd
    Function (``apply``), and methods handed to vLLM as ``custom_routing_function``."""
    fixed = set()
    routed = {
        kw.value.attr
        for kw in ast.walk(tree)
        if isinstance(kw, ast.keyword)
        and kw.arg == "custom_routing_function"
        and isinstance(kw.value, ast.Attribute)
    }
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        autograd = any(ast.unparse(b).endswith("autograd.Function") for b in cls.bases)
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and (
                fn.name in routed or (autograd and fn.name in ("forward", "backward"))
            ):
                fixed.add(id(fn))
    return fixed


def _attention_free(tree: ast.Module) -> bool:
    """A model of vLLM's attention-free contract (``IsAttentionFree``: Mamba-2 layers alone):
    vLLM hands it ``positions`` as any model, and nothing in it has a use for them."""
    return any(
        isinstance(base, ast.Name) and base.id == "IsAttentionFree"
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for base in cls.bases
    )


def _layer_forwards(tree: ast.Module) -> set[int]:
    """``forward`` of the decoder-layer classes ``make_layers`` builds through a table of
    classes (Jamba's ``ALL_DECODER_LAYER_TYPES``) or a test choosing one: the base model calls every layer alike, with
    vLLM's ``positions``, which a layer of another mixer has no use for."""
    tables = {
        target.id: {v.id for v in node.value.values if isinstance(v, ast.Name)}
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    lambdas = [
        lam.body
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("make_layers")
        for lam in call.args
        if isinstance(lam, ast.Lambda)
    ]
    built = {
        name
        for body in lambdas
        if isinstance(body, ast.Call)
        and isinstance(body.func, ast.Subscript)
        and isinstance(body.func.value, ast.Name)
        for name in tables.get(body.func.value.id, ())
    }
    # or chosen by a test (OLMo-hybrid's `A(...) if config.layer_types[i] == ... else B(...)`)
    built |= {
        branch.func.id
        for body in lambdas
        if isinstance(body, ast.IfExp)
        for branch in (body.body, body.orelse)
        if isinstance(branch, ast.Call) and isinstance(branch.func, ast.Name)
    }
    return {
        id(fn)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef) and cls.name in built
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and fn.name == "forward"
    }


def _alibi_forwards(tree: ast.Module) -> set[int]:
    """``forward`` of vLLM attention classes without rope: built with ALiBi
    (``alibi_slopes=``), or for learned absolute positions (added to the embeddings). The
    layer hands them vLLM's ``positions`` like any attention; they have no use for them."""
    return {
        id(fn)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        and "self.attn = Attention(" in (text := ast.unparse(cls))
        and ("alibi_slopes=" in text or "self.rotary_emb" not in text)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and fn.name == "forward"
    }


def test_defines_no_unused_parameter(golden):
    tree = golden[1]
    fixed, alibi = _interface_functions(tree), _alibi_forwards(tree) | _layer_forwards(tree)
    unused = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and id(n) not in fixed):
        args = fn.args
        params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        read = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | (
            {"positions"} if id(fn) in alibi or _attention_free(tree) else set()
        )
        unused += [
            f"{fn.name}({p}) line {fn.lineno}" for p in params if p not in ("self", "cls") and p not in read
        ]
    assert not unused


def test_every_config_parameter_is_typed(golden):
    untyped = [
        f"{fn.name} line {fn.lineno}"
        for fn in ast.walk(golden[1])
        if isinstance(fn, ast.FunctionDef)
        for a in (*fn.args.args, *fn.args.kwonlyargs)
        if a.arg == "config" and a.annotation is None
    ]
    assert not untyped


def test_tensor_parallel_size_read_once_per_function(golden):
    for fn in (n for n in ast.walk(golden[1]) if isinstance(n, ast.FunctionDef)):
        calls = [
            c
            for c in ast.walk(fn)
            if isinstance(c, ast.Call) and ast.unparse(c.func) == "get_tensor_model_parallel_world_size"
        ]
        assert len(calls) <= 1, f"{fn.name} line {fn.lineno}"


def test_no_source_comment_on_rewritten_qk_norms(golden):
    """The q/k norm constructions stay; the source's comments on them describe its own
    forward layout, which vLLM attention replaced."""
    lines = golden[0].splitlines()
    stale = [line for line in lines if re.match(r"\s*self\.[qk]_(layer)?norm = .*#", line)]
    assert not stale


def _is_guard(node: ast.stmt) -> bool:
    """``if ...: raise NotImplementedError("hfrewrite: ...")``."""
    return (
        isinstance(node, ast.If)
        and len(node.body) == 1
        and isinstance(node.body[0], ast.Raise)
        and "hfrewrite:" in ast.unparse(node.body[0])
    )


def _builds_a_layer(node: ast.stmt) -> bool:
    """A statement that constructs a module (a call to a capitalised class, ``nn.X`` or a vLLM layer)."""
    return any(
        isinstance(n, ast.Call) and (ast.unparse(n.func).split(".")[-1][:1].isupper())
        for n in ast.walk(node)
        if not isinstance(node, ast.If) or not _is_guard(node)
    )


def test_config_guards_come_before_any_layer_is_built(golden):
    """A config the file refuses is refused with hfrewrite's message, never by a layer that
    cannot be built for it first (a TypeError from vLLM's linear layer)."""
    _, tree = golden
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "__init__"):
            continue
        first_layer = next(
            (i for i, s in enumerate(fn.body) if _builds_a_layer(s) and not _is_guard(s)), None
        )
        for i, s in enumerate(fn.body):
            reads_self = (
                any(isinstance(n, ast.Name) and n.id == "self" for n in ast.walk(s.test))
                if _is_guard(s)
                else True
            )
            if not reads_self and first_layer is not None:
                assert i < first_layer, (
                    f"{ast.unparse(s.test)} is guarded after a layer is built (line {s.lineno})"
                )


VLLM_RUFF = Path(__file__).parent / "data" / "vllm_ruff.toml"


@pytest.mark.parametrize("check", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_goldens_pass_vllms_own_ruff_rules(check):
    """What vLLM's pre-commit runs on a model file: its ruff rules, width and import order."""
    ruff = Path(sys.executable).parent / "ruff"
    cmd = [str(ruff), *check, "--no-cache", "--config", str(VLLM_RUFF), *map(str, GOLDEN)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_eagle3_collection_only_where_a_draft_can_run(golden):
    """A base model collects hidden states for an EAGLE-3 draft exactly where its causal LM
    declares SupportsEagle3: no collection code a draft could never read."""
    text, _ = golden
    declared = "SupportsEagle3" in text
    assert ("EagleModelMixin" in text) == declared
    assert ("_maybe_add_hidden_state" in text) == declared
    assert ("aux_hidden_states" in text) == declared
