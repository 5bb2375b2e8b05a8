"""``nn.Linear`` subclasses of custom code (Falcon-RW's ``Linear``, whose forward spells
``input @ self.weight.T + self.bias``), proven on values to compute ``nn.Linear``'s function.

The tracer keeps every ``nn.Linear`` subclass opaque (Phi-MoE's router is one), but only a
proven class counts as a projection the passes may replace. A proven class that also keeps
``nn.Linear``'s own constructor is named in the plan (``ModelPlan.linear_classes``), and the
file builds it as ``nn.Linear`` before the passes replace it like any other projection.
"""

from __future__ import annotations

import torch
from torch import nn

# (class, has a bias) -> its forward computes F.linear(x, weight, bias) on the replay
_PROVEN: dict[tuple[type, bool], bool] = {}


def is_linear(module: nn.Module) -> bool:
    """``module`` computes ``nn.Linear``'s function: ``nn.Linear`` itself, or a subclass
    that ``prove_linear_classes`` proved (an unproven subclass is not a linear)."""
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is nn.Linear.forward:
        return True
    return _PROVEN.get((type(module), module.bias is not None), False)


def prove_linear_classes(model: nn.Module) -> tuple[str, ...]:
    """Replay each ``nn.Linear`` subclass with a forward of its own found in ``model`` (once
    per class and bias) against ``F.linear``; the names of the proven classes whose every
    instance is proven and whose constructor is ``nn.Linear``'s."""
    classes: dict[type, bool] = {}
    for module in model.modules():
        cls = type(module)
        if not isinstance(module, nn.Linear) or cls is nn.Linear or cls.forward is nn.Linear.forward:
            continue
        key = (cls, module.bias is not None)
        if key not in _PROVEN:
            _PROVEN[key] = _replays_linear(module)
        classes[cls] = classes.get(cls, True) and _PROVEN[key]
    return tuple(
        sorted(
            cls.__name__ for cls, proven in classes.items() if proven and cls.__init__ is nn.Linear.__init__
        )
    )


def _replays_linear(module: nn.Linear) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, module.in_features, generator=generator, dtype=module.weight.dtype)
    try:
        with torch.no_grad():
            out = module(x)
            want = nn.functional.linear(x, module.weight, module.bias)
    except Exception:  # noqa: BLE001 - the subclass's own forward failed on a plain input: not proven
        return False
    return (
        torch.is_tensor(out) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    )
