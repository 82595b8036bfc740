"""Where a per-layer call's host time goes, part by part (GPU machine).

For the fetch_kv, paged (one split) and MLA calls of bench_host_cost.py, after
a step's first call: ``ours`` (the whole call), ``kernelcall`` (the
KernelCall alone, with the call's tensors), the compiled kernel's launcher
``CompiledKernel.run`` handed the tensors (``run_tensors``) or their pointers
(``run_ints``, with the stream read per call or once), KernelCall's per-call
check (``guard``: ``KernelCall.pointers``; before 964ab4b, ``KernelCall.guard``),
the current stream, ``torch.compiler.is_compiling`` and the launch-hook check;
on Triton 3.8+ also the C launch function under ``run`` (``c_launch_ints``,
which KernelCall does not call), and torch's Inductor static launcher
(``StaticallyLaunchedCudaKernel``) handed the same compiled function and the
pointers, through its ``run`` (``static_run_ints``) and its C function alone
(``static_c_ints``), after checking that it writes exactly what the compiled
kernel's own launcher writes.  Host µs per call, 300 calls, median of 9
rounds, beside one torch op.  Not a pytest suite: a diagnostic, logged in
``results/logs/*-relaunch-breakdown*.log`` (the logs of 1206e54 and 964ab4b
came from a first draft of this file: the same parts, timed the same way).

Run: ``PYTHONPATH=$T:vllm_overlay:tests/without_vllm:. python3 benchmarks/relaunch_breakdown.py``
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import triton

from benchmarks import bench_host_cost
from vllm.v1.attention.ops import triton_launch

CALLS, ROUNDS = 300, 9


def host_us(fns: dict) -> dict:
    """Host µs per call of each function: ``CALLS`` calls with no sync
    inside, median of ``ROUNDS`` rounds interleaved across the functions."""
    samples: dict = {name: [] for name in fns}
    for fn in fns.values():
        fn()
        fn()
    torch.cuda.synchronize()
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            samples[name].append((time.perf_counter() - start) / CALLS * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in samples.items()}


@dataclass
class Launch:
    """One KernelCall of a call, with the tensors it was given and the
    launcher's arguments (tensors, and the same with pointers)."""

    call: triton_launch.KernelCall
    tensors: dict
    args: tuple
    pointers: tuple

    def run(self, args: tuple, stream: int | None = None) -> None:
        relaunch, grid = self.call._relaunch, self.call.grid
        if stream is None:
            stream = relaunch.current_stream(relaunch.current_device())
        relaunch.run(grid[0], grid[1], grid[2], stream, relaunch.function,
                     relaunch.packed_metadata, None, None, None, *args)


def launches_of(call) -> list[Launch]:
    """The KernelCalls one (warmed-up) call of ``call`` makes."""
    seen = []
    original = triton_launch.KernelCall.__call__

    def recording(self, **tensors):
        seen.append((self, tensors))
        return original(self, **tensors)

    triton_launch.KernelCall.__call__ = recording
    try:
        call()
    finally:
        triton_launch.KernelCall.__call__ = original
    launches = []
    for kernel_call, tensors in seen:
        args = kernel_call._relaunch.order((*kernel_call._relaunch.fixed, *tensors.values()))
        pointers = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        launches.append(Launch(kernel_call, tensors, args, pointers))
    return launches


def compiled_kernel(call: triton_launch.KernelCall):
    """The CompiledKernel a KernelCall relaunches, from its JITFunction's
    per-device kernel cache (Triton 3.x), by its loaded function."""
    function = call._relaunch.function
    for kernel_cache, *_ in call.kernel.device_caches.values():
        for compiled in kernel_cache.values():
            if compiled.function == function:
                return compiled
    raise LookupError("the relaunched kernel is not in its JITFunction's cache")


class Static:
    """torch's Inductor static launcher for a launch's compiled kernel, on the
    function Triton loaded; the launch's pointers less the constexprs."""

    def __init__(self, lc: Launch) -> None:
        from torch._inductor.runtime.static_triton_launcher import (
            StaticallyLaunchedCudaKernel,
        )

        compiled = compiled_kernel(lc.call)
        compiled._cubin_path = None  # (inductor's file; the function is loaded)
        self.kernel = StaticallyLaunchedCudaKernel(compiled)
        self.kernel.function = compiled.function
        signature = list(compiled.src.signature.values())
        constexprs = set(self.kernel.full_constexprs)
        self.args = tuple(
            p for i, p in enumerate(lc.pointers)
            if signature[i] != "constexpr" and i not in constexprs
        )
        self.grid = lc.call.grid
        # What StaticallyLaunchedCudaKernel.run appends (scratch pointers).
        extra = "OO" if torch.version.hip else "O" * (
            self.kernel.has_global_scratch + self.kernel.has_profile_scratch)
        self.c_args = (*self.args, *[None] * len(extra))
        self.c_tys = self.kernel.arg_tys + extra

    def run(self, stream: int) -> None:
        self.kernel.run(*self.grid, stream, *self.args)

    def c_launch(self, stream: int) -> None:
        k = self.kernel
        k.C_impl._launch_kernel(k.function, *self.grid, k.num_warps, k.shared,
                                self.c_tys, self.c_args, stream)


def same_writes(lc: Launch, static: Static, stream: int) -> bool:
    """Whether the static launcher leaves every tensor of the launch exactly as
    the compiled kernel's own launcher does, from the same starting state, in
    which the outputs (``*out*``, ``*lse*``, per call or fixed for the step,
    e.g. the split partials) hold a value no kernel writes."""
    named = {**lc.call.fixed, **lc.tensors}
    named = {n: t for n, t in named.items() if isinstance(t, torch.Tensor)}
    tensors = list(named.values())
    for name, t in named.items():
        if "out" in name or "lse" in name:
            t.fill_(7)
    before = [t.clone() for t in tensors]
    lc.run(lc.pointers, stream)
    torch.cuda.synchronize()
    expected = [t.clone() for t in tensors]
    for t, b in zip(tensors, before):
        t.copy_(b)
    static.run(stream)
    torch.cuda.synchronize()
    same = all(torch.equal(t, e) for t, e in zip(tensors, expected))
    return same and not all(torch.equal(b, e) for b, e in zip(before, expected))


def parts(call, launches: list[Launch], x: torch.Tensor) -> dict:
    first = launches[0].call._relaunch
    streams = [first.current_stream(first.current_device()) for _ in launches]
    fns = {
        "torch_op": lambda: x.add_(1),
        "ours": call,
        "kernelcall": lambda: [lc.call(**lc.tensors) for lc in launches],
        "run_tensors": lambda: [lc.run(lc.args) for lc in launches],
        "run_ints": lambda: [lc.run(lc.pointers) for lc in launches],
        "run_ints_fixed_stream": lambda: [
            lc.run(lc.pointers, s) for lc, s in zip(launches, streams)
        ],
        "guard": lambda: [lc.call.pointers(lc.tensors) for lc in launches],
        "stream": lambda: first.current_stream(first.current_device()),
        "is_compiling": torch.compiler.is_compiling,
        "hooks": triton_launch._launch_hooks_set,
    }
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version >= (3, 8):  # the C function under CudaLauncher.__call__

        def c_launch():
            for lc, stream in zip(launches, streams):
                relaunch, grid, run = lc.call._relaunch, lc.call.grid, lc.call._relaunch.run
                run.launch(grid[0], grid[1], grid[2], stream, relaunch.function,
                           run.launch_cooperative_grid, run.launch_pdl,
                           relaunch.packed_metadata, None, None, None, None, None,
                           run.arg_annotations, run.kernel_signature, lc.pointers)

        fns["c_launch_ints"] = c_launch
    try:
        statics = [Static(lc) for lc in launches]
        same = [same_writes(lc, st, s) for lc, st, s in zip(launches, statics, streams)]
        print(f"  static launcher: args={[len(st.c_args) for st in statics]} "
              f"tys={[st.c_tys for st in statics]} same writes={same}", flush=True)
        fns["static_run_ints"] = lambda: [st.run(s) for st, s in zip(statics, streams)]
        fns["static_c_ints"] = lambda: [st.c_launch(s) for st, s in zip(statics, streams)]
    except Exception as exc:  # noqa: BLE001 (a diagnostic: say why, time the rest)
        print(f"  static launcher: {type(exc).__name__}: {exc}", flush=True)
    return fns


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("relaunch_breakdown: needs a GPU")
    print("triton", triton.__version__, "torch", torch.__version__, flush=True)
    x = torch.zeros(16, device="cuda")
    fa = bench_host_cost.fa_calls("cuda", None)
    mla = bench_host_cost.mla_calls("cuda", None)
    entries = {
        "fetch_kv": fa["fetch_kv"](),
        "paged_1split": fa["paged"](64)[0](),
        "paged_splits": fa["paged"](16384)[0](),
        "mla_decode": mla["decode"](),
        "mla_prefill": mla["prefill"](),
    }
    for name, call in entries.items():
        call()  # the step's first layer: checks, KernelCall, compile
        call()
        launches = launches_of(call)
        num_args = [len(lc.args) for lc in launches]
        num_tensors = [sum(isinstance(a, torch.Tensor) for a in lc.args) for lc in launches]
        print(f"== {name}: launches={len(launches)} args={num_args} tensor_args={num_tensors}")
        times = host_us(parts(call, launches, x))
        for part, us in times.items():
            print(f"  {part:24s} {us:7.2f} us  {us / times['torch_op']:5.2f}x")


if __name__ == "__main__":
    main()
