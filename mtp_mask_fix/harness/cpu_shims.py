"""The smallest set of shims that lets Megatron-Bridge 0.6 import on this CPU-only Python 3.11 machine.

Each shim only acts when the real thing is missing, so on a GPU container (Python 3.12,
TransformerEngine installed) this module changes nothing. Nothing here enters the patch.
"""

import sys
import types
import typing


def install() -> None:
    """Apply every shim; idempotent. Must run before anything imports megatron.bridge."""
    _alias_typing_override()
    _stub_transformer_engine()


def _alias_typing_override() -> None:
    # megatron.training.models (megatron-core 0.19) does `from typing import override`, a 3.12 name.
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _stub_transformer_engine() -> None:
    # megatron/bridge/__init__.py imports every model, and peft/lora_layers.py needs
    # `transformer_engine.pytorch.ops.Sequential` at class-definition time. TransformerEngine needs
    # CUDA to install. Import megatron.core first so core records HAVE_TE = False, then stub only
    # the one attribute; version "0.0" makes core's version gates pick their non-TE paths.
    try:
        import transformer_engine  # noqa: F401

        return
    except ImportError:
        pass
    import megatron.core  # noqa: F401

    te = types.ModuleType("transformer_engine")
    te.__version__ = "0.0"
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_pytorch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))
    te.pytorch = te_pytorch
    sys.modules["transformer_engine"] = te
    sys.modules["transformer_engine.pytorch"] = te_pytorch


def pytest_configure(config):
    """Loaded as a pytest plugin (`-p mtp_mask_fix.harness.cpu_shims`, e.g. for upstream's own tests in a tree):
    the shims are in place before any test module imports megatron.bridge."""
    install()
