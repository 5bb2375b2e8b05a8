"""strip_hf_runtime: Transformers runtime removed by reachability."""

from harness import assert_rewrites, rewrite
from hfrewrite.passes import strip_hf_runtime
from plans import llama_like

BEFORE_HF_RUNTIME_REMOVED = """\
# Copyright header kept
import torch
from torch import nn

from ...modeling_layers import GradientCheckpointingLayer
from ...utils import auto_docstring
from .configuration_llama import LlamaConfig

logger = logging.get_logger(__name__)


def rotate_half(x):
    return x


class LlamaRotaryEmbedding(nn.Module):
    pass


class LlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.is_causal = True
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.mlp = nn.Linear(4, 4)

    def forward(self, x):
        return self.mlp(x)


@auto_docstring
class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__(config)
        self.config = config
        self.layer = LlamaDecoderLayer(config)


class LlamaForSequenceClassification(GenericForSequenceClassification, LlamaPreTrainedModel): ...


__all__ = ["LlamaForCausalLM", "LlamaForSequenceClassification"]
"""

AFTER_HF_RUNTIME_REMOVED = """\
# Copyright header kept
import torch
from torch import nn
from transformers import LlamaConfig


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.mlp = nn.Linear(4, 4)

    def forward(self, x):
        return self.mlp(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = LlamaDecoderLayer(config)
"""


def test_hf_runtime_removed():
    assert_rewrites(strip_hf_runtime, BEFORE_HF_RUNTIME_REMOVED, AFTER_HF_RUNTIME_REMOVED, llama_like())


UNCHANGED_CLEAN_MODULE = """\
import torch
from torch import nn


class LlamaForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
"""


def test_leaves_clean_module_unchanged():
    assert_rewrites(strip_hf_runtime, UNCHANGED_CLEAN_MODULE, UNCHANGED_CLEAN_MODULE, llama_like())


KEEPS_ASSIGNMENTS_OUTSIDE_INIT = """\
import torch
from torch import nn


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.unused = config.hidden_size
        self.mlp = nn.Linear(4, 4)

    def forward(self, x):
        self.last_input = x
        return self.mlp(x)
"""


def test_unread_attribute_is_dropped_from_init_only():
    # `self.unused` goes (built in __init__, never read); forward's own state stays
    after = rewrite(strip_hf_runtime, KEEPS_ASSIGNMENTS_OUTSIDE_INIT, llama_like())
    assert after == KEEPS_ASSIGNMENTS_OUTSIDE_INIT.replace("        self.unused = config.hidden_size\n", "")


def test_attributes_read_in_assignment_targets_are_kept():
    source = KEEPS_ASSIGNMENTS_OUTSIDE_INIT.replace(
        "        self.mlp = nn.Linear(4, 4)\n",
        "        self.mlp = nn.Linear(4, 4)\n        self.slot = 0\n",
    ).replace("        self.last_input = x\n", "        self.buffer[self.slot] = x\n")
    assert rewrite(strip_hf_runtime, source, llama_like()) == source.replace(
        "        self.unused = config.hidden_size\n", ""
    )


def test_state_assigned_outside_init_stays_after_other_dunder_methods():
    # a method named before `__init__` in sort order must not count as leaving `__init__`
    source = KEEPS_ASSIGNMENTS_OUTSIDE_INIT.replace(
        "    def forward(self, x):\n",
        "    def __getitem__(self, i):\n        return self.mlp\n\n    def forward(self, x):\n",
    )
    assert rewrite(strip_hf_runtime, source, llama_like()) == source.replace(
        "        self.unused = config.hidden_size\n", ""
    )


def test_a_class_that_also_names_nn_module_gets_it_once():
    source = BEFORE_HF_RUNTIME_REMOVED.replace(
        "class LlamaDecoderLayer(GradientCheckpointingLayer):",
        "class LlamaDecoderLayer(GradientCheckpointingLayer, nn.Module):",
    )
    assert_rewrites(strip_hf_runtime, source, AFTER_HF_RUNTIME_REMOVED, llama_like())


def test_relative_imports_sharing_a_line_are_each_carried():
    source = BEFORE_HF_RUNTIME_REMOVED.replace(
        "from .configuration_llama import LlamaConfig\n",
        "from .configuration_llama import LlamaConfig; from ...activations import ACT2FN\n",
    ).replace("        return self.mlp(x)\n", '        return ACT2FN["silu"](self.mlp(x))\n')
    after = rewrite(strip_hf_runtime, source, llama_like())
    assert "from transformers.activations import ACT2FN\n" in after
    assert "from transformers import LlamaConfig\n" in after


LEGACY_SETUPS = """\
import torch
from torch import nn
from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask
from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
from transformers.utils.import_utils import is_torch_fx_available

if is_torch_fx_available():
    if not is_torch_greater_or_equal_than_1_13:
        import torch.fx

    _prepare_4d_causal_attention_mask = torch.fx.wrap(_prepare_4d_causal_attention_mask)

ALL_LAYERNORM_LAYERS.append(LlamaRMSNorm)
ALL_LAYERNORM_LAYERS.append(nn.LayerNorm)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = nn.LayerNorm(4)
"""


def test_setups_and_registrations_of_what_the_file_no_longer_has_go():
    out = rewrite(strip_hf_runtime, LEGACY_SETUPS, llama_like())
    assert "is_torch_fx_available()" not in out and "torch.fx.wrap" not in out
    assert "LlamaRMSNorm" not in out  # the class was replaced: its registration goes too
    assert "ALL_LAYERNORM_LAYERS.append(nn.LayerNorm)" in out  # names that still exist: kept


def test_a_setup_binding_a_name_the_file_reads_stays():
    source = (
        LEGACY_SETUPS + "\n    def forward(self, x):\n        return _prepare_4d_causal_attention_mask(x)\n"
    )
    out = rewrite(strip_hf_runtime, source, llama_like())
    assert "_prepare_4d_causal_attention_mask = torch.fx.wrap(" in out


UNUSED_METHODS = """\
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn_func = self.core_attn

    def forward(self, x):
        return x

    def extra_repr(self):
        return "kept: torch calls it"

    def rope_attn(self, q):
        return self.attn_func(q)

    def core_attn(self, q):
        return self.repeat_kv(q)

    def repeat_kv(self, q):
        return q

    @property
    def decorated(self):
        return 1


class LlamaForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.attn = LlamaAttention(vllm_config.model_config.hf_config)

    def forward(self, x):
        return self.attn(x)

    def get_expert_mapping(self):
        return []
"""


def test_methods_the_rewritten_forward_left_unused_go():
    """ERNIE-4.5's rope_attn -> attn_func -> core_attn -> repeat_kv chain goes link by link;
    torch's hooks (extra_repr), decorated methods and the model class's methods stay."""
    after = rewrite(strip_hf_runtime, UNUSED_METHODS, llama_like())
    for gone in ("def rope_attn", "def core_attn", "def repeat_kv", "self.attn_func"):
        assert gone not in after, gone
    for kept in (
        "def extra_repr",
        "def decorated",
        "def get_expert_mapping",
        "def forward(self, x):\n        return x",
    ):
        assert kept in after, kept


def test_a_transient_buffer_attribute_nothing_reads_goes():
    """gpt_bigcode's base model keeps a ``[max_positions, max_positions]`` causal mask as
    ``self.bias = nn.Buffer(..., persistent=False)`` that the template forward never reads
    (64 MiB at 8192 positions); a persistent one may be in the checkpoint and stays."""
    source = KEEPS_ASSIGNMENTS_OUTSIDE_INIT.replace(
        "        self.mlp = nn.Linear(4, 4)\n",
        "        self.mlp = nn.Linear(4, 4)\n"
        "        self.bias = nn.Buffer(torch.tril(torch.ones((8, 8))), persistent=False)\n"
        "        self.kept = nn.Buffer(torch.ones(8), persistent=True)\n",
    )
    assert rewrite(strip_hf_runtime, source, llama_like()) == source.replace(
        "        self.unused = config.hidden_size\n", ""
    ).replace("        self.bias = nn.Buffer(torch.tril(torch.ones((8, 8))), persistent=False)\n", "")


def test_output_recorders_of_the_base_model_go():
    """XGLMModel's `_can_record_outputs`: only transformers' runtime reads it, and the class
    it names (the attention) must not stay referenced by it."""
    before = """\
from torch import nn
from ...utils.output_capturing import OutputRecorder


class LlamaModel(nn.Module):
    _can_record_outputs = {"attentions": OutputRecorder(nn.Module, index=1)}

    def __init__(self, config):
        super().__init__()
        self.config = config


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)

    def forward(self, x):
        return self.model(x)
"""
    after = rewrite(strip_hf_runtime, before, llama_like())
    assert "_can_record_outputs" not in after and "OutputRecorder" not in after
    assert "class LlamaModel(nn.Module):\n    def __init__" in after
