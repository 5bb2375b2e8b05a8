"""einops (``rearrange``, ``repeat`` in Hub custom code) on traced values."""

from __future__ import annotations


def register_einops_backend(proxy_class: type) -> None:
    """Lets einops run on ``proxy_class`` instances: its torch backend's ops (``reshape``,
    ``permute``...) called on the proxy are recorded like any other; shapes are concrete.
    Registered once per process."""
    try:
        from einops import _backends
    except ImportError:
        return

    class ValueProxyBackend(_backends.TorchBackend):
        framework_name = "hfrewrite.analyze.trace"

        def is_appropriate_type(self, tensor) -> bool:
            return isinstance(tensor, proxy_class)

    _backends._loaded_backends.setdefault(ValueProxyBackend.framework_name, ValueProxyBackend())
