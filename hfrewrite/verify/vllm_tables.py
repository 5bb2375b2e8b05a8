"""vLLM's tables a generated class needs an entry in while it runs: transformers' config
registry (the config shims a Hub model's file carries) and vLLM's per-architecture config
hooks (an attention-free model's Mamba hook)."""

from __future__ import annotations


def attention_free_hook(architecture: str, model_cls: type) -> bool:
    """Give an attention-free class (Mamba-2 layers alone) vLLM's Mamba config hook where
    vLLM lists none for its architecture (it lists its own Mamba models'): without it the
    engine sizes no Mamba state block. Whether one was added."""
    from vllm.model_executor.models.config import MambaModelConfig

    hooks = config_hooks()
    if not getattr(model_cls, "is_attention_free", False) or architecture in hooks:
        return False
    hooks[architecture] = MambaModelConfig
    return True


def config_hooks() -> dict:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    return MODELS_CONFIG_MAP


def config_shims(module) -> dict[str, type]:
    """model type -> class of the config shims a generated module defines (the Hub
    repository's configuration class, carried for vLLM's transformers: emit/config_shim.py)."""
    from hfrewrite.emit.config_shim import SHIM_NOTE

    if module is None:
        return {}
    return {
        cls.model_type: cls
        for cls in vars(module).values()
        if isinstance(cls, type) and cls.__module__ == module.__name__ and SHIM_NOTE in (cls.__doc__ or "")
    }


def config_registry() -> dict:
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    return _CONFIG_REGISTRY
