"""The value-carrying tracer: traced graphs compute what the eager modules compute."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from torch import nn

from hfrewrite.analyze.shrink import shrink_config
from hfrewrite.analyze.trace import opaque_attention, trace, value

TYPES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    yield
    torch.set_num_threads(threads)


def decoder_layer_call(model_type: str):
    """Layer 0 of the shrunk model, and the (args, kwargs) the model calls it with."""
    small = shrink_config(transformers.AutoConfig.for_model(model_type))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(small).eval()
    layer, seen = model.model.layers[0], {}
    hook = layer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    with torch.no_grad():
        model(input_ids=torch.arange(10).reshape(2, 5), use_cache=False)
    hook.remove()
    return layer, seen["args"], seen["kwargs"]


@pytest.mark.parametrize("model_type", TYPES)
def test_decoder_layer_graph_equals_eager(model_type):
    layer, args, kwargs = decoder_layer_call(model_type)
    traced = trace(layer, args, kwargs)
    with torch.no_grad():
        eager = layer(*args, **kwargs)
        graph = traced.graph_module(*traced.inputs)
    assert torch.allclose(graph, eager)
    leaves = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert leaves[:2] == ["input_layernorm", "self_attn.q_proj"]
    assert {"self_attn.o_proj", "mlp.act_fn", "mlp.down_proj"} <= set(leaves)


def test_attention_is_one_leaf_with_concrete_values():
    layer, args, kwargs = decoder_layer_call("qwen3")
    traced = trace(layer, args, kwargs)
    (call,) = [n for n in traced.graph.nodes if n.target is opaque_attention]
    q, k, v = (value(a) for a in call.args[1:4])
    assert q.shape == k.shape == v.shape == (2, 4, 5, 32)  # qwen3 defaults to MHA
    assert call.kwargs["scaling"] == pytest.approx(32**-0.5)
    assert call.kwargs["sliding_window"] is None
    assert "self_attn" in [q for q, _ in call.meta["nn_module_stack"].values()]
    assert all("value" in n.meta for n in traced.graph.nodes if n.op != "output")


def passthrough(fn):
    """A signature-hiding decorator, like transformers' ``deprecate_kwarg``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class ShapeLogic(nn.Module):
    """Iterates shapes, branches on values, assigns items, builds a module inline."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @passthrough
    def forward(self, x, extra=None):
        batch, seq, _ = x.shape
        y = self.proj(x).view((*x.shape[:-1], -1, 4))
        if len(y) > 1 and y.shape[-1] == 4 and extra is None:
            y = y * 2
        for i in range(y.shape[2]):
            y[..., i, :] = y[..., i, :] + i
        return nn.SiLU()(y.reshape(batch, seq, -1))


def test_shape_logic_traces_where_symbolic_trace_fails():
    module, x = ShapeLogic(), torch.randn(2, 3, 8)
    with pytest.raises(torch.fx.proxy.TraceError, match="cannot be iterated"):
        torch.fx.symbolic_trace(module)
    traced = trace(module, (x,))
    assert torch.allclose(traced.graph_module(*traced.inputs), module(x))
    targets = [n.target for n in traced.graph.nodes]
    assert "proj" in targets and "x" in targets
    proj = next(n for n in traced.graph.nodes if n.target == "proj")
    assert value(proj).shape == (2, 3, 8)


class _SumIntoZeros(nn.Module):
    """A buffer built from sizes alone, updated in place, then read: Mixtral 4.36's expert sum."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        rows, width = x.shape
        out = torch.zeros((rows, width), dtype=x.dtype)
        out.index_add_(0, torch.arange(rows), self.proj(x))
        return out.reshape(rows, 2, 2)


def test_a_buffer_built_from_sizes_stays_in_the_graph_through_its_in_place_update():
    module = _SumIntoZeros()
    x = torch.randn(3, 4)
    traced = trace(module, (x,))
    (output,) = [n for n in traced.graph.nodes if n.op == "output"]
    result = output.args[0]
    assert result.op == "call_method" and result.target == "reshape"
    updated = result.args[0]  # later reads of the buffer read its in-place update
    assert updated.op == "call_method" and updated.target == "index_add_"
    assert updated.args[0].op == "call_function"  # recorded, not baked in as a constant
    assert updated.args[0].target is torch.zeros  # the real factory: the tracing patch is undone
    assert not value(updated.args[0]).any()  # the buffer's own value: zeros, from before the update
    with torch.no_grad():
        assert torch.equal(value(result), module(x))


class _AddsInPlace(nn.Module):
    """Llama-4's MoE: ``out = shared(x); out.add_(routed); return out``."""

    def __init__(self):
        super().__init__()
        self.shared, self.routed = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        out = self.shared(x)
        out.add_(self.routed(x))
        return out


def test_an_in_place_op_is_what_later_reads_of_its_tensor_read():
    x = torch.randn(3, 4)
    traced = trace(_AddsInPlace(), (x,))
    (output,) = [n for n in traced.graph.nodes if n.op == "output"]
    returned = output.args[0]
    assert returned.target == "add_"  # not the shared Linear's node: the routed part is seen
    shared = next(n for n in traced.graph.nodes if n.target == "shared")
    module = traced.module
    with torch.no_grad():
        assert torch.allclose(value(shared), module.shared(x))  # its value from before the add
        assert torch.allclose(value(returned), module(x))
