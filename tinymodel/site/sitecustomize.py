"""CPU shims for this machine only (Python 3.11, no TransformerEngine, no CUDA), loaded by every Python process of the
test environment through the `.pth` file that `./run` writes into its site-packages, so that pytest, its sessions, the
verify probe and every worker rank get the same shims without asking for them. Nothing here enters the patch or the
tool.

Each shim acts only when the real thing is missing, so with Python >= 3.12 and TransformerEngine installed it does
nothing.
"""

import importlib.util
import sys
import types
import typing


def _alias_typing_override() -> None:
    # megatron.training.models (megatron-core 0.19) does `from typing import override`, a 3.12 name.
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _stub_transformer_engine() -> None:
    # megatron/bridge/__init__.py imports every model, and peft/lora_layers.py needs
    # `transformer_engine.pytorch.ops.Sequential` at class-definition time. TransformerEngine needs CUDA to install.
    # megatron.core is imported first, so that core records HAVE_TE = False; then only that one attribute is stubbed;
    # version "0.0" makes core's version gates pick their non-TE paths.
    import megatron.core  # noqa: F401

    te = types.ModuleType("transformer_engine")
    te.__version__ = "0.0"
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_pytorch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))
    # Before 0.6, lora_layers.py also subclasses te.Linear, te.GroupedLinear, ... at import: any class name is a stub.
    te_pytorch.__getattr__ = _stub_class
    te.pytorch = te_pytorch
    sys.modules["transformer_engine"] = te
    sys.modules["transformer_engine.pytorch"] = te_pytorch


def _stub_class(name: str) -> type:
    if not name[:1].isupper():
        raise AttributeError(f"module 'transformer_engine.pytorch' has no attribute {name!r}")
    return type(name, (), {})


class _StubBeforeBridge:  # a meta path finder (not importlib.abc's: that import costs every process 25 ms)
    """Stubs TransformerEngine right before the first import of megatron.bridge runs, not at start-up and not when a
    process only looks it up (`importlib.util.find_spec`, as `mtp-mask-fix check` does): a process that never
    imports Megatron-Bridge (git helpers, the tool itself) pays nothing."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.bridge":
            return None
        others = (finder for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec"))
        spec = next((found for finder in others if (found := finder.find_spec(name, path, target))), None)
        if spec is not None and spec.loader is not None:
            spec.loader = _StubThenLoad(spec.loader)
        return spec


class _StubThenLoad:  # a loader
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _StubBeforeBridge)]
        _stub_transformer_engine()
        module.__loader__ = module.__spec__.loader = self.real  # as if the hook had never been there
        self.real.exec_module(module)


def install() -> None:
    """Idempotent; a no-op where TransformerEngine is installed."""
    _alias_typing_override()
    if importlib.util.find_spec("transformer_engine") is None and not any(
        isinstance(finder, _StubBeforeBridge) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _StubBeforeBridge())


install()
