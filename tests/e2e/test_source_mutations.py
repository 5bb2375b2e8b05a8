"""Source mutations: real modeling files edited the ways that fool a pattern matcher.

Each case copies an installed transformers modeling file, applies one edit, and makes
transformers build its causal LM from the edited copy. ``hfrewrite convert`` (with
convert-time validation on) must then either

* write a file: validation ran it in real vLLM against Hugging Face built from the edited
  source, and they agree; or
* refuse with the analysis's reason.

A refusal by the *validation* ("does not compute what Hugging Face does") fails the test:
it means the analysis alone accepted something it did not prove, i.e. with validation off
hfrewrite would have written a wrong file.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from hfrewrite import convert
from hfrewrite.cli import main
from hfrewrite.resolve import resolve

MISCOMPILE = "does not compute what Hugging Face does"

# (model type, [(old, new), ...], "converts" | "refused"): the outcome seen; either is
# sound, and the test says when it changes.
MUTATIONS: dict[str, tuple[str, list[tuple[str, str]], str]] = {
    # rotate_half interleaves under its usual name, tables still half-split: no rope vLLM has
    "interleaved-rotate-half": (
        "llama",
        [
            (
                (
                    "    x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
                    "    return torch.cat((-x2, x1), dim=-1)"
                ),
                "    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)",
            )
        ],
        "refused",
    ),
    # interleaved rotate_half and interleaved tables: GPT-J style, proven so
    "interleaved-rope-consistent": (
        "llama",
        [
            (
                (
                    "    x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
                    "    return torch.cat((-x2, x1), dim=-1)"
                ),
                "    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)",
            ),
            (
                "emb = torch.cat((freqs, freqs), dim=-1)",
                "emb = freqs.repeat_interleave(2, dim=-1)",
            ),
        ],
        "converts",
    ),
    # a (1 + weight) norm still called LlamaRMSNorm
    "one-plus-weight-rmsnorm": (
        "llama",
        [
            (
                "return self.weight * hidden_states.to(input_dtype)",
                "return (1.0 + self.weight) * hidden_states.to(input_dtype)",
            )
        ],
        "converts",
    ),
    # the cast before the weight multiply instead of after
    "norm-cast-order": (
        "llama",
        [
            (
                "return self.weight * hidden_states.to(input_dtype)",
                "return (self.weight * hidden_states).to(input_dtype)",
            )
        ],
        "converts",
    ),
    # the activation on up instead of gate
    "act-on-up": (
        "llama",
        [
            (
                "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",
                "self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))",
            )
        ],
        "converts",
    ),
    # an extra multiplier on the attention residual branch
    "residual-multiplier": (
        "llama",
        [
            (
                "        hidden_states = residual + hidden_states\n\n        # Fully Connected",
                "        hidden_states = residual + 0.5 * hidden_states\n\n        # Fully Connected",
            )
        ],
        "converts",
    ),
    # a scaled embedding in the base model's forward
    "scaled-embedding": (
        "llama",
        [
            (
                "inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)",
                "inputs_embeds: torch.Tensor = self.embed_tokens(input_ids) * 3.0",
            )
        ],
        "converts",
    ),
    # a final-logit soft cap after the lm_head
    "final-logit-softcap": (
        "llama",
        [
            (
                "logits = self.lm_head(hidden_states[:, slice_indices, :])",
                (
                    "logits = self.lm_head(hidden_states[:, slice_indices, :])\n"
                    "        logits = torch.tanh(logits / 3.0) * 3.0"
                ),
            )
        ],
        "converts",
    ),
    # rope on the first half of each head only, with no partial_rotary_factor in the config
    "partial-rotary-unannounced": (
        "llama",
        [
            (
                "    q_embed = (q * cos) + (rotate_half(q) * sin)\n    k_embed = (k * cos) + (rotate_half(k) * sin)",
                (
                    "    half = q.shape[-1] // 2\n"
                    "    cos, sin = cos[..., : half // 2].repeat(1, 1, 1, 2), sin[..., : half // 2].repeat(1, 1, 1, 2)\n"
                    "    q_embed = torch.cat(((q[..., :half] * cos) + (rotate_half(q[..., :half]) * sin), q[..., half:]), -1)\n"
                    "    k_embed = torch.cat(((k[..., :half] * cos) + (rotate_half(k[..., :half]) * sin), k[..., half:]), -1)"
                ),
            )
        ],
        "refused",
    ),
    # qwen3's q/k norms over all heads instead of per head
    "qk-norm-all-heads": (
        "qwen3",
        [
            (
                "self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)",
                "self.q_norm = Qwen3RMSNorm(config.num_attention_heads * self.head_dim, eps=config.rms_norm_eps)",
            ),
            (
                "self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)",
                "self.k_norm = Qwen3RMSNorm(config.num_key_value_heads * self.head_dim, eps=config.rms_norm_eps)",
            ),
            (
                "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
                "query_states = self.q_norm(self.q_proj(hidden_states)).view(hidden_shape).transpose(1, 2)",
            ),
            (
                "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
                "key_states = self.k_norm(self.k_proj(hidden_states)).view(hidden_shape).transpose(1, 2)",
            ),
        ],
        "converts",
    ),
    # a bias on k only
    "bias-on-k-only": (
        "llama",
        [
            (
                (
                    "self.k_proj = nn.Linear(\n            config.hidden_size, config.num_key_value_heads * self.head_dim, "
                    "bias=config.attention_bias\n        )"
                ),
                (
                    "self.k_proj = nn.Linear(\n            config.hidden_size, config.num_key_value_heads * self.head_dim, "
                    "bias=True\n        )"
                ),
            )
        ],
        "refused",
    ),
    # q split into heads dim-major ([d, heads] then transposed): the shape vLLM expects,
    # other values
    "q-split-dim-major": (
        "llama",
        [
            (
                "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
                (
                    "query_states = self.q_proj(hidden_states).view(*input_shape, self.head_dim, -1)"
                    ".transpose(-1, -2).transpose(1, 2)"
                ),
            )
        ],
        "refused",
    ),
    # o_proj reads the heads transposed against head_dim: the same shape, other values
    "swapped-o-proj-input": (
        "llama",
        [
            (
                "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
                "attn_output = attn_output.transpose(-1, -2).reshape(*input_shape, -1).contiguous()",
            )
        ],
        "refused",
    ),
    # Qwen3.5's q projection packs each head's q and output gate, q first: with the halves
    # read the other way round the head layout vLLM's split assumes is not the source's
    "packed-gate-first": (
        "qwen3_5",
        [("        query_states, gate = torch.chunk(", "        gate, query_states = torch.chunk(")],
        "refused",
    ),
    # the packed gate through silu, a gate no row of the table replays (sigmoid, softplus)
    "packed-gate-silu": (
        "qwen3_5",
        [
            (
                "attn_output = attn_output * torch.sigmoid(gate)",
                "attn_output = attn_output * torch.nn.functional.silu(gate)",
            )
        ],
        "refused",
    ),
    # the gated delta net's decay without its softplus: the replay of vLLM's formula differs
    "gated-delta-net-decay-without-softplus": (
        "qwen3_5",
        [
            (
                "g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)",
                "g = -self.A_log.float().exp() * (a.float() + self.dt_bias)",
            )
        ],
        "refused",
    ),
}


def mutated_module(model_type: str, edits: list[tuple[str, str]], tmp: Path):
    """The edited copy of ``model_type``'s modeling module, imported under its own name."""
    package = importlib.import_module(f"transformers.models.{model_type}")
    original = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    src = Path(original.__file__).read_text()
    for old, new in edits:
        assert src.count(old) == 1, f"edit not found exactly once in modeling_{model_type}.py: {old!r}"
        src = src.replace(old, new)
    src = re.sub(
        r"^from \.\.\.(\S*) import",
        lambda m: "from transformers" + (f".{m[1]}" if m[1] else "") + " import",
        src,
        flags=re.MULTILINE,
    )
    src = re.sub(
        r"^from \.\.(\w+) import",  # a sibling model's package (Qwen3.5's ..auto)
        r"from transformers.models.\1 import",
        src,
        flags=re.MULTILINE,
    )
    src = re.sub(
        r"^from \.(\w+) import",
        rf"from {package.__name__}.\1 import",
        src,
        flags=re.MULTILINE,
    )
    path = tmp / f"modeling_{model_type}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"hfrewrite_mutated_{model_type}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return package, module, path


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(MUTATIONS))
def test_mutated_source_converts_correctly_or_is_refused(case, tmp_path, monkeypatch, capsys):
    model_type, edits, expected = MUTATIONS[case]
    package, module, path = mutated_module(model_type, edits, tmp_path)
    for name in module.__all__:  # transformers' auto classes now build the edited classes
        monkeypatch.setattr(package, name, getattr(module, name), raising=False)
    resolved = dataclasses.replace(resolve(model_type), modeling_path=path)
    monkeypatch.setattr("hfrewrite.resolve.resolve", lambda *a, **k: resolved)
    generate = convert.generate
    monkeypatch.setattr(convert, "generate", lambda r: generate(resolved))

    code = main(["convert", model_type, "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    with capsys.disabled():
        print(f"\n[{case}] exit {code}: {(err or out.splitlines()[-2]).strip()}")
    assert MISCOMPILE not in err, f"the analysis accepted a source it did not prove:\n{err}"
    if code == 0:
        assert "validated in vLLM against Hugging Face" in out
        assert expected == "converts", f"expected a refusal, but it converted and validated:\n{out}"
    else:
        assert code == 2 and err.startswith("hfrewrite: error: ") and err.count("\n") == 1, err
        assert expected == "refused", f"expected a conversion:\n{err}"
        assert not (tmp_path / "out").exists()
