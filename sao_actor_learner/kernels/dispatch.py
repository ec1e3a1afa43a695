"""Which implementation a kernel call runs: backend="auto" | "triton" | "torch".

- "torch":  the PyTorch reference, on any device.
- "triton": the Triton kernels. They need CUDA tensors, or Triton's CPU interpreter
            (TRITON_INTERPRET=1 in the environment before the first Triton kernel is built:
            slow, meant for tests). Anything else fails here with a message saying what to set.
- "auto":   Triton when every tensor is on CUDA, Triton is installed and the interpreter is off;
            the torch reference otherwise (CPU tensors, float64, no Triton). "auto" never picks
            the interpreter: it is far slower than the reference (it is meant for tests).

Nothing here imports triton: `importlib.util.find_spec` looks for it without importing it, and
the kernel modules (`_triton_*.py`) are imported by `load_triton_module` only when the Triton
backend actually runs, so this package imports where Triton is missing.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Iterable, Optional

import torch

BACKENDS = ("auto", "triton", "torch")
_TRUE = ("1", "true", "on", "yes")


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_importable() -> bool:
    """True when the `triton` package is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError, AttributeError):  # blocked or broken installs
        return False


def triton_available(device: Optional[torch.device | str] = None) -> bool:
    """True when backend="triton" can run on `device` (default: CUDA if present, else CPU).

    That is: triton is installed, and either the device is a visible CUDA device or
    TRITON_INTERPRET=1 is set (the interpreter runs on any device's tensors), and triton was not
    already imported under the other interpreter setting (see `triton_mode_problem`).
    """
    if not triton_importable() or triton_mode_problem() is not None:
        return False
    if interpreter_enabled():
        return True
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def resolve_backend(backend: str, op: str, tensors: Iterable[Optional[torch.Tensor]],
                    triton_dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)) -> str:
    """Returns "triton" or "torch" for a call of `op` on `tensors`, or raises saying what to change.

    `triton_dtypes`: floating dtypes the Triton kernel computes in; "auto" runs the reference for
    any other floating dtype (float64 stays exact), "triton" refuses it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r}: must be one of {BACKENDS} "
                         "('auto' picks Triton on CUDA tensors and the torch reference elsewhere)")
    if backend == "torch":
        return "torch"
    tensors = [t for t in tensors if t is not None]
    devices = sorted({t.device.type for t in tensors})
    float_dtypes = sorted({str(t.dtype) for t in tensors
                           if t.is_floating_point() and t.dtype not in triton_dtypes})
    if backend == "auto":
        if (devices == ["cuda"] and not float_dtypes and triton_importable()
                and not interpreter_enabled() and triton_mode_problem() is None):
            return "triton"
        return "torch"
    # backend == "triton": fail clearly rather than fall back silently.
    if not triton_importable():
        raise RuntimeError(
            f"{op}: backend='triton' but the triton package is not installed. Install it "
            "(`pip install triton==3.7.1`, the version torch 2.13 is built against) or pass "
            "backend='torch' (or 'auto', which falls back to the torch reference).")
    if float_dtypes:
        raise TypeError(f"{op}: backend='triton' computes in float32 from "
                        f"{[str(d) for d in triton_dtypes]} inputs, got {float_dtypes}; "
                        "use backend='torch' (or 'auto') for these dtypes.")
    if not interpreter_enabled() and devices != ["cuda"]:
        why = ("no CUDA device is visible" if not torch.cuda.is_available()
               else f"the tensors are on {devices}")
        raise RuntimeError(
            f"{op}: backend='triton' cannot run here: {why}. Triton kernels need CUDA tensors, "
            "or Triton's CPU interpreter: set TRITON_INTERPRET=1 in the environment before the "
            "first Triton kernel is built (slow; for tests). Otherwise pass backend='torch', or "
            "backend='auto' to use Triton only on CUDA tensors.")
    return "triton"


def triton_mode_problem() -> Optional[str]:
    """Why Triton kernels cannot run in this process's interpreter setting, or None.

    Triton fixes interpreted-or-compiled when `triton.language` is first imported (its own
    helpers such as tl.zeros are built then), so TRITON_INTERPRET must be set before anything
    imports triton. Does not import triton: if it is not imported yet, there is no problem.
    """
    lang = sys.modules.get("triton.language")
    if lang is None or not hasattr(lang, "zeros"):
        return None
    built = type(lang.zeros).__name__ == "InterpretedFunction"
    if built == interpreter_enabled():
        return None
    return (f"triton was imported with its interpreter {'on' if built else 'off'} and "
            f"TRITON_INTERPRET is {'on' if interpreter_enabled() else 'off'} now. Set "
            "TRITON_INTERPRET=1 in the environment before anything imports triton (in the shell, "
            "or at the very top of the program or test module) and do not change it afterwards.")


def load_triton_module(name: str) -> ModuleType:
    """Imports `sao_actor_learner.kernels.<name>` (a module that imports triton at its top).

    Checks that triton, the module's kernels and the environment agree on TRITON_INTERPRET:
    Triton decides interpreted-or-compiled at import and decoration time, not at launch.
    """
    problem = triton_mode_problem()
    if problem is None:
        mod = importlib.import_module(f"{__package__}.{name}")
        problem = triton_mode_problem()
        built = getattr(mod, "INTERPRETED", None)
        if problem is None and built is not None and built != interpreter_enabled():
            problem = (f"the Triton kernels of {name} were built with TRITON_INTERPRET "
                       f"{'on' if built else 'off'} and it is "
                       f"{'on' if interpreter_enabled() else 'off'} now. Set it once, in the "
                       "environment, before triton is imported, and do not change it afterwards.")
    if problem is not None:
        raise RuntimeError(problem)
    return mod
