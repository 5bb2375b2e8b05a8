"""Test inputs for verification: tiny random-weight checkpoints, the default prompts that
fit them, and vLLM's own model files as stand-ins for generated ones.

Nothing here imports vLLM; ``write_vllm_standin`` only reads its source.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

# Token ids < 500 of varied lengths (1 to 40); fits the default vocab (512) and
# max_model_len (128) with 16 new tokens.
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (7,),
    (5, 6, 7, 8, 9),
    (100, 200, 300, 400, 17, 42, 250, 3, 99, 480, 11, 12, 13),
    tuple((i * 37 + 11) % 497 + 3 for i in range(40)),
)

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the CPU attention backend needs head_dim >= 32
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


def make_tiny_checkpoint(model_type: str, out_dir: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random-weight float32 HF checkpoint (safetensors, no tokenizer).

    ``config_overrides`` go to ``AutoConfig.for_model`` on top of ``TINY_DEFAULTS``,
    e.g. ``tie_word_embeddings=True``, ``attention_bias=True``, ``head_dim=64``,
    ``rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}``.
    Init is widened so greedy decoding does not collapse into repeats: matrices and
    biases ~ N(0, 0.2), 1-D weights (norms) ~ N(1, 0.2).
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    from hfrewrite.analyze.shrink import same_as_hidden

    # (the lazy mapping's .get does not import the class: index it)
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None  # noqa: SIM401
    defaults = {  # not what a config class computes (Falcon's head_dim is a property)
        k: v for k, v in TINY_DEFAULTS.items() if not _read_only(config_class, k)
    }
    config = AutoConfig.for_model(model_type, **{**defaults, **config_overrides})
    # widths the default config keeps equal to hidden_size stay equal (OPT's word_embed_proj_dim)
    for name in same_as_hidden(AutoConfig.for_model(model_type), {**defaults, **config_overrides}):
        setattr(config, name, config.hidden_size)
    rotary = getattr(config, "rotary_dim", None)  # GPT-J, CodeGen: a width in lanes (64 by default)
    if isinstance(rotary, int) and "rotary_dim" not in config_overrides:
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        config.rotary_dim = max(2, head // 8 * 2)  # a quarter of the head, as in GPT-J-6B
    pad = getattr(config, "pad_token_id", None)
    # a real model's pad id, past the tiny vocab
    if isinstance(pad, int) and pad >= config.vocab_size:
        config.pad_token_id = None
    return save_random_checkpoint(config, out_dir, seed)


def _read_only(config_class: Any, name: str) -> bool:
    attr = getattr(config_class, name, None)
    return isinstance(attr, property) and attr.fset is None


def save_random_checkpoint(config: Any, out_dir: Path, seed: int = 0) -> Path:
    """Build ``config``'s causal LM with ``make_tiny_checkpoint``'s widened random init
    (float32) and save it to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfrewrite.analyze.composite import composite_class, text_part

    torch.manual_seed(seed)
    # Hub custom code the user trusted: save_pretrained copies its files next to the weights
    remote = bool(getattr(config, "auto_map", None))
    if text_part(config) is not None:  # a multimodal checkpoint, the text model the file loads
        model = composite_class(config)._from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=remote)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            if param.ndim >= 2 or name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(1.0, 0.2)
        for name, buffer in model.named_buffers():  # a router's score-correction bias
            if name.endswith("bias") and buffer.is_floating_point() and name in model.state_dict():
                buffer.normal_(0.0, 0.2)
    model.config.architectures = [type(model).__name__]
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    _plain_infinities(out_dir / "config.json")
    if remote:
        _copy_custom_code(model, out_dir)
    return out_dir


def _plain_infinities(path: Path) -> None:
    """``config.json`` with the infinities transformers 5.19 writes as ``{"__float__":
    "Infinity"}`` (and reads back as that dict, which its config classes reject: Bamba's
    ``time_step_limit``) written as the bare ``Infinity`` of released configs."""
    text = path.read_text()
    if '"__float__"' not in text:
        return

    def plain(obj: dict) -> object:
        return float(obj["__float__"]) if set(obj) == {"__float__"} else obj

    path.write_text(json.dumps(json.loads(text, object_hook=plain), indent=2, sort_keys=True) + "\n")


def _copy_custom_code(model: Any, out_dir: Path) -> None:
    """The repository's code beside the weights where ``save_pretrained`` left it out:
    transformers 4.57 registers custom code for saving only when no library class has the
    config class's name (DeepSeek-V3's Hub ``DeepseekV3Config`` has one)."""
    import inspect
    import shutil

    for cls in (type(model), type(model.config)):
        source = Path(inspect.getfile(cls))
        for py in sorted(source.parent.glob("*.py")):
            if py.name != "__init__.py" and not (out_dir / py.name).exists():
                shutil.copy(py, out_dir / py.name)


def runs_custom_code(ckpt: Path) -> bool:
    """Whether the checkpoint's config names Hub custom code (``auto_map``): loading it in
    Hugging Face and in vLLM takes ``trust_remote_code``, which its conversion was given."""
    return "auto_map" in json.loads((Path(ckpt) / "config.json").read_text())


def checkpoint_architecture(ckpt: Path) -> str:
    """The first entry of ``architectures`` in the checkpoint's config.json."""
    return json.loads((Path(ckpt) / "config.json").read_text())["architectures"][0]


def uses_latent_attention(ckpt: Path | str) -> bool:
    """The checkpoint's config sets ``kv_lora_rank`` (DeepSeek-style latent attention, which
    vLLM runs with its MLA backends); False without a config.json."""
    path = Path(ckpt) / "config.json"
    return path.is_file() and json.loads(path.read_text()).get("kv_lora_rank") is not None


def write_vllm_standin(dst: Path, name: str = "llama", replace: dict[str, str] | None = None) -> Path:
    """Write vLLM's own ``vllm/model_executor/models/<name>.py`` to ``dst``, relative
    imports made absolute, as a stand-in for a generated file (a known-good reference).

    ``replace`` maps exact source snippets (each must occur once) to substitutes, to
    make deliberately broken variants. Reads vLLM's source without importing vLLM.
    """
    spec = importlib.util.find_spec("vllm.model_executor.models")
    src = (Path(spec.submodule_search_locations[0]) / f"{name}.py").read_text()
    src = re.sub(
        r"^(\s*)from \.(\w+) import",
        r"\1from vllm.model_executor.models.\2 import",
        src,
        flags=re.MULTILINE,
    )
    for old, new in (replace or {}).items():
        if src.count(old) != 1:
            raise ValueError(f"snippet not exactly once in vLLM's {name}.py: {old!r}")
        src = src.replace(old, new)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(src)
    return dst
