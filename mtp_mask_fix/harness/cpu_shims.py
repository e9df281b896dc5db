"""The smallest set of shims that lets Megatron-Bridge 0.6 import on this CPU-only Python 3.11 machine.

Each shim only acts when the real thing is missing, so on a GPU container (Python 3.12,
TransformerEngine installed) this module changes nothing. Nothing here enters the patch.
"""

import importlib.abc
import importlib.util
import os
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


GPT_STEP_MODULE = "megatron.bridge.training.gpt_step"


def gpt_step_under_test() -> str | None:
    """The gpt_step.py that MTP_FIX_GPT_STEP selects (None: leave the import as is).

    unset        this repo's generated view, src/megatron/bridge/training/gpt_step.py (base + patch)
    a file path  that file (the red/green check points it at the unpatched base)
    "installed"  whatever `megatron.bridge` is importable (the gate puts a whole tree on PYTHONPATH)
    """
    from mtp_mask_fix.patch import VIEW

    choice = os.environ.get("MTP_FIX_GPT_STEP", "")
    if choice == "installed":
        return None
    return choice or str(VIEW)


class _GptStepRedirect(importlib.abc.MetaPathFinder):
    """Loads megatron.bridge.training.gpt_step from one chosen file; every other module as installed."""

    def __init__(self, path: str):
        self.path = path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != GPT_STEP_MODULE:
            return None
        if not os.path.isfile(self.path):
            # Never fall back to the installed module: a test would then silently run the wrong code.
            raise ImportError(f"gpt_step.py under test not found: {self.path} (run ./run setup)")
        return importlib.util.spec_from_file_location(fullname, self.path)


def select_gpt_step(path: str | None) -> None:
    """Make `import megatron.bridge.training.gpt_step` load `path` (None: leave the import as is)."""
    if path is None:
        return
    if GPT_STEP_MODULE in sys.modules:
        raise RuntimeError(f"{GPT_STEP_MODULE} was imported before the harness could select {path}")
    sys.meta_path.insert(0, _GptStepRedirect(path))
