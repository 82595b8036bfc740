"""triton_launch.KernelCall: when it relaunches a compiled kernel, when it goes
through ``kernel[grid]``, and what its per-call guard keys on.

A stand-in JITFunction records every ``kernel[grid](**kwargs)`` and returns a
stand-in CompiledKernel whose launcher records what it is handed; the
relaunch must hand it every parameter in order (constexprs and ``None``
pointers included), as ``JITFunction.run`` does, with the tensors' pointers
in place of the tensors.
"""

import types

import pytest
import torch
import triton
from vllm.v1.attention.ops import triton_launch
from vllm.v1.attention.ops.triton_launch import KernelCall, RelaunchSupport

NAMES = ["x_ptr", "y_ptr", "s_ptr", "n", "stride", "BLOCK"]
STREAM = 7
SUPPORTED = RelaunchSupport(relaunch=True, amd_buffer_bound=False)


class _Compiled:
    """Records what its launcher (``run``) is handed: the grid, the stream,
    the launch hooks and the kernel's arguments."""

    function = "function handle"
    packed_metadata = "packed metadata"

    def __init__(self):
        self.calls = []

    def run(
        self, gx, gy, gz, stream, function, packed, launch_metadata, enter, leave, *args
    ):
        assert (function, packed) == (self.function, self.packed_metadata)
        self.calls.append(((gx, gy, gz), stream, enter, args))


class _FakeJIT:
    arg_names = NAMES
    params = [
        types.SimpleNamespace(
            name=n,
            is_constexpr=n == "BLOCK",
            do_not_specialize=n == "n",
            do_not_specialize_on_alignment=n == "y_ptr",
        )
        for n in NAMES
    ]

    def __init__(self):
        self.launches = []
        self.compiled = []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launches.append((grid, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]

        return launch


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(triton.runtime, "JITFunction", _FakeJIT, raising=False)
    monkeypatch.setattr(triton_launch, "relaunch_supported", lambda: SUPPORTED)
    driver = types.SimpleNamespace(
        active=types.SimpleNamespace(
            get_current_device=lambda: 0, get_current_stream=lambda device: STREAM
        )
    )
    monkeypatch.setattr(triton.runtime, "driver", driver, raising=False)
    return _FakeJIT()


def _call(kernel, n=5, **fixed):
    fixed = dict(s_ptr=None, n=n, stride=16, BLOCK=64, num_warps=4) | fixed
    return KernelCall(kernel, (7, 3), **fixed)


def test_first_call_compiles_then_relaunches_with_every_parameter(jit):
    x, y = torch.zeros(64), torch.zeros(64)
    call = _call(jit)
    call(x_ptr=x, y_ptr=y)
    assert len(jit.launches) == 1
    grid, kwargs = jit.launches[0]
    assert grid == (7, 3, 1) and kwargs["num_warps"] == 4 and kwargs["s_ptr"] is None
    call(x_ptr=x, y_ptr=y)
    assert len(jit.launches) == 1
    ((grid, stream, hook, args),) = jit.compiled[0].calls
    assert grid == (7, 3, 1)  # three dimensions: CompiledKernel[grid] reads grid[2]
    assert stream == STREAM and hook is None  # no hook set: none handed on
    assert args == (x.data_ptr(), y.data_ptr(), None, 5, 16, 64)


def test_a_launch_hook_set_goes_through_kernel_grid(jit):
    x, y = torch.zeros(64), torch.zeros(64)
    call = _call(jit)
    call(x_ptr=x, y_ptr=y)
    hooks = triton.knobs.runtime.launch_enter_hook
    seen = []
    hooks.add(seen.append)
    try:
        call(x_ptr=x, y_ptr=y)  # JITFunction.run, which calls the hooks
    finally:
        hooks.remove(seen.append)
    assert len(jit.launches) == 2 and jit.launches[1][1]["x_ptr"] is x
    assert jit.compiled[0].calls == [] and jit.compiled[1].calls == []
    call(x_ptr=x, y_ptr=y)  # no hook: the first call's kernel, relaunched
    ((_, _, hook, args),) = jit.compiled[0].calls
    assert hook is None and args[:2] == (x.data_ptr(), y.data_ptr())
    assert len(jit.launches) == 2


def test_another_keyword_order_is_only_a_miss(jit):
    x, y = torch.zeros(64), torch.zeros(64)
    call = _call(jit)
    call(x_ptr=x, y_ptr=y)
    call(y_ptr=y, x_ptr=x)
    assert len(jit.launches) == 2 and jit.launches[1][1]["x_ptr"] is x


def test_a_misaligned_pointer_goes_through_kernel_grid_then_the_aligned_relaunch(jit):
    x, y = torch.zeros(64), torch.zeros(64)
    call = _call(jit)
    call(x_ptr=x, y_ptr=y)
    call(x_ptr=x[1:], y_ptr=y)  # Triton specialises x_ptr on 16-byte alignment
    call(x_ptr=x, y_ptr=y[1:])  # y_ptr: do_not_specialize_on_alignment
    call(x_ptr=x, y_ptr=y)
    assert len(jit.launches) == 2 and jit.launches[1][1]["x_ptr"].data_ptr() & 15
    assert [c[3][:2] for c in jit.compiled[0].calls] == [
        (x.data_ptr(), y[1:].data_ptr()),
        (x.data_ptr(), y.data_ptr()),
    ]


def test_each_kernel_call_compiles_through_kernel_grid_once(jit):
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):  # a step's KernelCall, built anew the next step
        call = _call(jit)
        call(x_ptr=x, y_ptr=y)
        call(x_ptr=x, y_ptr=y)
    assert len(jit.launches) == 2
    assert [len(c.calls) for c in jit.compiled] == [1, 1]


def test_a_fixed_tensor_is_relaunched_as_its_pointer(jit):
    x, y, s = torch.zeros(64), torch.zeros(64), torch.zeros(4)
    call = _call(jit, s_ptr=s)
    call(x_ptr=x, y_ptr=y)
    call(x_ptr=y, y_ptr=x)
    ((_, _, _, args),) = jit.compiled[0].calls
    assert args == (y.data_ptr(), x.data_ptr(), s.data_ptr(), 5, 16, 64)


def test_a_misaligned_first_call_is_not_kept(jit):
    x, y = torch.zeros(64), torch.zeros(64)
    call = _call(jit)
    call(x_ptr=x[1:], y_ptr=y)  # Triton compiles x_ptr without the alignment
    call(x_ptr=x, y_ptr=y)  # compiles the aligned kernel, kept
    call(x_ptr=x, y_ptr=y)
    assert len(jit.launches) == 2
    assert [len(c.calls) for c in jit.compiled] == [0, 1]


def test_a_first_call_leaving_a_parameter_to_its_default_is_not_kept(jit):
    x = torch.zeros(64)
    call = _call(jit)
    call(x_ptr=x)  # y_ptr: a default Triton fills in
    call(x_ptr=x)
    assert len(jit.launches) == 2 and jit.compiled[0].calls == []


def test_amd_keys_the_2gib_buffer_bound(jit, monkeypatch):
    amd = SUPPORTED._replace(amd_buffer_bound=True)
    monkeypatch.setattr(triton_launch, "relaunch_supported", lambda: amd)
    call = _call(jit)
    small = torch.zeros(64)
    call(x_ptr=small, y_ptr=small)
    call(x_ptr=small, y_ptr=small)
    assert len(jit.launches) == 1
    big = types.SimpleNamespace(
        dtype=torch.float32,
        data_ptr=lambda: 0,
        untyped_storage=lambda: types.SimpleNamespace(nbytes=lambda: 2**31),
    )
    call(x_ptr=small, y_ptr=big)
    assert len(jit.launches) == 2


def test_a_missing_or_non_tensor_argument_goes_through_kernel_grid(jit):
    x = torch.zeros(64)
    call = _call(jit)
    call(x_ptr=x, y_ptr=x)
    call(x_ptr=x)  # Triton reports the missing parameter
    call(x_ptr=x, y_ptr=3)
    assert len(jit.launches) == 3


def test_unsupported_triton_or_compiling_goes_through_kernel_grid(jit, monkeypatch):
    x = torch.zeros(64)
    unsupported = RelaunchSupport(relaunch=False, amd_buffer_bound=False)
    monkeypatch.setattr(triton_launch, "relaunch_supported", lambda: unsupported)
    call = _call(jit)
    call(x_ptr=x, y_ptr=x)
    call(x_ptr=x, y_ptr=x)
    assert len(jit.launches) == 2
    monkeypatch.setattr(triton_launch, "relaunch_supported", lambda: SUPPORTED)
    call = _call(jit)
    call(x_ptr=x, y_ptr=x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    call(x_ptr=x, y_ptr=x)
    assert len(jit.launches) == 4


def test_interpreted_kernels_always_go_through_kernel_grid():
    calls = []

    class Interpreted:  # TRITON_INTERPRET=1: not a JITFunction
        arg_names = NAMES

        def __getitem__(self, grid):
            return lambda **kw: calls.append(kw)

    x = torch.zeros(4)
    call = KernelCall(Interpreted(), (1,), s_ptr=None, n=1, stride=1, BLOCK=4)
    call(x_ptr=x, y_ptr=x)
    call(x_ptr=x, y_ptr=x)
    assert len(calls) == 2


def test_version_check_is_plain():
    support = triton_launch.relaunch_supported()
    assert isinstance(support.relaunch, bool) and isinstance(
        support.amd_buffer_bound, bool
    )
    assert triton_launch.TESTED_TRITON[0] <= triton_launch.TESTED_TRITON[1]
