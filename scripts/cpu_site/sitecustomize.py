"""The CPU tier's engine on x86 without triton-cpu: upstream's standalone CPU model runner.

scripts/cpu_engine.py copies this file beside the ``vllm`` package of every tree it exports,
so each Python process on that tree imports it at start-up; vLLM's files are unchanged.
On x86, vLLM 0.34.0's ``CpuPlatform.check_and_update_config`` refuses to start without
triton-cpu, and ``uses_standalone_cpu_model_runner()`` is false.  When ``vllm.platforms.cpu``
is imported, this module lets the refusal's (first) ``get_cpu_architecture()`` call see
"not x86", and with ``SERIES_CPU_STANDALONE_RUNNER=1`` (the engine processes; not
``make test-upstream``) picks the standalone runner when Triton is absent, as upstream's
tests do.  With a Triton vLLM accepts nothing changes; trees without the runner are left alone.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from pathlib import Path

TARGET = "vllm.platforms.cpu"
REFUSAL = "vLLM on x86 CPUs requires Triton (triton-cpu)."


def _install(module) -> None:
    import inspect

    platform = getattr(module, "CpuPlatform", None)
    if platform is None or not hasattr(platform, "uses_standalone_cpu_model_runner"):
        return  # a tree from before the standalone runner (0.33.0): nothing to do
    check = platform.check_and_update_config.__func__
    source = inspect.getsource(check)
    first = source.index("get_cpu_architecture()")
    guard = source[source.rindex("\n", 0, first):source.index("\n", first)]
    if "HAS_TRITON" not in guard or REFUSAL not in source[first:].split("\n", 2)[1]:
        raise RuntimeError(
            "scripts/cpu_site/sitecustomize.py: the first get_cpu_architecture() call of "
            "CpuPlatform.check_and_update_config is no longer the x86 refusal; revisit this shim")
    arch_enum = type(platform.get_cpu_architecture())

    def uses_standalone_cpu_model_runner(cls) -> bool:
        from vllm.triton_utils import HAS_TRITON

        return not HAS_TRITON

    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.triton_utils import HAS_TRITON

        if HAS_TRITON:
            return check(cls, vllm_config)
        own = "get_cpu_architecture" in platform.__dict__
        saved = platform.__dict__.get("get_cpu_architecture")
        real = platform.get_cpu_architecture

        def get_cpu_architecture(klass):
            # Only the refusal's call (the method's first) sees "not x86"; then the real one.
            if own:
                platform.get_cpu_architecture = saved
            else:
                del platform.get_cpu_architecture
            return arch_enum.OTHER

        platform.get_cpu_architecture = classmethod(get_cpu_architecture)
        try:
            check(cls, vllm_config)
        finally:
            if platform.__dict__.get("get_cpu_architecture") is not saved:
                if own:
                    platform.get_cpu_architecture = saved
                else:
                    del platform.get_cpu_architecture
        assert platform.get_cpu_architecture() == real()

    # The runner's C++ ops: upstream builds them into _C for non-x86 CPUs only, so
    # scripts/cpu_engine.py compiles them from the tree's csrc/cpu and links them here.
    ops = Path(__file__).with_name("_standalone_cpu_ops.so")
    if ops.is_file():
        import torch

        torch.ops.load_library(str(ops))
    if os.environ.get("SERIES_CPU_STANDALONE_RUNNER") == "1":
        platform.uses_standalone_cpu_model_runner = classmethod(uses_standalone_cpu_model_runner)
    platform.check_and_update_config = classmethod(check_and_update_config)


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _install(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
