"""Test-only: mamba_ssm's and fla's Triton kernels on CPU tensors under Triton's interpreter.

Triton picks the interpreter when a ``@triton.jit`` decorator runs (triton's own
``tl.cumsum`` & co. at its import, the kernels at their packages' import), so :func:`activate`
must run first thing in a fresh process (the tests' worker, :mod:`tests.kernels.wiring.cases`).
The four things the interpreter lacks on a CPU-only
torch build, found when this was first tried (issue 28):

1. every ``triton.autotune`` keeps its first config: autotuning benchmarks each config through a GPU
   driver the interpreter does not have (one config computes the same result as any other);
2. ``torch.cuda.device(None)`` (what the kernels' ``with torch.cuda.device(x.device.index)``
   passes for a CPU tensor) is a no-op;
3. ``torch.cuda.get_device_properties(...)`` answers for a CPU device (``multi_processor_count``,
   used to size grids);
4. ``tl.range`` hands its loop variable to the kernel body as a Triton tensor, as compiled code
   does (fla calls ``.to()`` on it; the interpreter's own ``range`` yields Python ints).

mamba_ssm's ``__init__`` imports its CUDA extension (absent here), so ``mamba_ssm`` is
registered as a bare package and only its Triton submodules are imported.

:data:`LAUNCHES` logs the name of every kernel launched (interpreted, or compiled on a GPU), so
a test can tell that the Triton kernel ran rather than a silent fallback. bf16 is not tested
under the interpreter: it computes bf16 arithmetic wrongly (it operates on the bit patterns).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

from composer.kernels import probe

PACKAGES = ("mamba_ssm", "fla")
"""The kernel packages whose Triton kernels the tests run."""
KERNEL_MODULES = ("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated",
                  "fla.ops.gated_delta_rule", "fla.ops.kda")
CPU_SMS = 4
"""``multi_processor_count`` of the CPU "device" (sizes a few grids; any value is correct)."""

LAUNCHES: list[str] = []
"""Every Triton kernel launched since the last :func:`clear` (by function name)."""


def missing() -> str | None:
    """Why the interpreted kernels cannot run here (a package absent), else ``None``."""
    for name in ("triton", "numpy", "einops", *PACKAGES):
        if importlib.util.find_spec(name) is None:
            return (f"{name} is not installed (pip install --no-deps triton==3.9.0 numpy "
                    "einops fla-core==0.6.0, and mamba-ssm: docs/kernels.md)")
    return None


def clear() -> None:
    LAUNCHES.clear()


def _own(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PACKAGES)


def _one_config(init):
    """Item 1, on ``Autotuner.__init__`` (so that subclasses, e.g. fla's caching autotuner, keep
    one config too)."""
    def first_only(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.configs = self.configs[:1]
    return first_only


def _cuda_device(original):
    def device(index):
        if index is None or (isinstance(index, torch.device) and index.type != "cuda"):
            return contextlib.nullcontext()
        return original(index)
    return device


def _device_properties(original):
    def properties(device=None):
        if isinstance(device, torch.device) and device.type == "cuda" or isinstance(device, int):
            return original(device)
        return types.SimpleNamespace(multi_processor_count=CPU_SMS, name="triton-interpreter",
                                     gcnArchName="", major=9, minor=0)
    return properties


def _tensor_range(interpreter):
    """Item 4: a kernel body's ``range`` and ``tl.range`` yield Triton scalars. The kernel's own
    rewritten copy gets ``range`` in a copy of its globals (the module's host code keeps the
    builtin); ``tl.range`` is set where the interpreter patches ``triton.language``."""
    def tensor_range(*args, **kwargs):
        for i in builtins.range(*args):
            yield interpreter._implicit_cvt(i)

    rewrite_ast = interpreter.FunctionRewriter.rewrite_ast

    def rewrite_with_tensor_range(self):
        fn = self.fn
        scope = {**fn.__globals__, "range": tensor_range}
        self.fn = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                     fn.__closure__)
        try:
            return rewrite_ast(self)
        finally:
            self.fn = fn

    patch_lang_core = interpreter._patch_lang_core

    def lang_core_with_tensor_range(lang, scope):
        patch_lang_core(lang, scope)
        scope.set_attr(lang, "range", lambda arg1, arg2=None, step=None, **_: tensor_range(
            *((0, arg1) if arg2 is None else (arg1, arg2)), step or 1))
    return rewrite_with_tensor_range, lang_core_with_tensor_range


def _logging(run):
    def logged(self, *args, **kwargs):
        LAUNCHES.append(getattr(self, "__name__", None) or self.fn.__name__)
        return run(self, *args, **kwargs)
    return logged


def log_launches(mp: pytest.MonkeyPatch) -> None:
    """Record compiled launches (a real GPU): every ``JITFunction.run``."""
    from triton.runtime.jit import JITFunction
    mp.setattr(JITFunction, "run", _logging(JITFunction.run))


def compiled() -> None:
    """On a real GPU: the launch log, and mamba_ssm as a bare package when its ``__init__``
    does not import (a build without its CUDA extension: the Triton kernels need none)."""
    mp = pytest.MonkeyPatch()
    log_launches(mp)
    try:
        importlib.import_module("mamba_ssm")
    except Exception:
        sys.modules.pop("mamba_ssm", None)
        _bare_package(mp, "mamba_ssm")
    probe.reset()


def _bare_package(mp: pytest.MonkeyPatch, name: str) -> None:
    """``name`` in ``sys.modules`` as a package whose ``__init__`` did not run."""
    spec = importlib.util.find_spec(name)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    mp.setitem(sys.modules, name, module)


def activate() -> None:
    """Turn this process into an interpreted "GPU" for the kernel packages (module docstring).
    Call before anything imports triton: the interpreter is chosen when ``@triton.jit`` runs,
    triton's own ``tl.cumsum`` & co. included, so a process that imported triton already cannot
    switch (the tests run in a subprocess for that reason). Nothing is undone."""
    if "triton" in sys.modules:
        raise RuntimeError("shim.activate() must run before triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "device", _cuda_device(torch.cuda.device))
    mp.setattr(torch.cuda, "get_device_properties",
               _device_properties(torch.cuda.get_device_properties))
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner
    mp.setattr(Autotuner, "__init__", _one_config(Autotuner.__init__))
    rewrite_ast, patch_lang_core = _tensor_range(interpreter)
    mp.setattr(interpreter.FunctionRewriter, "rewrite_ast", rewrite_ast)
    mp.setattr(interpreter, "_patch_lang_core", patch_lang_core)
    mp.setattr(interpreter.InterpretedFunction, "run",
               _logging(interpreter.InterpretedFunction.run))
    _bare_package(mp, "mamba_ssm")
    for name in KERNEL_MODULES:
        importlib.import_module(name)
    probe.reset()
