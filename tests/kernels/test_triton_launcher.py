"""triton_launcher (vllm/v1/attention/ops/triton_launcher.py) and the wrappers' launch caches.

KernelLaunch's direct path is exercised on the CPU tier with a stand-in for a
compiled Triton kernel that records what it is handed: the first call of a
pointer pattern goes through ``kernel[grid]``, later ones hand the tensors,
fixed scalars and constexprs (parameter order) to the compiled kernel's
launcher, and anything that selects another compiled kernel (pointer alignment
or storage, device, ENABLED off, the plain path) goes back through
``kernel[grid]``.  The pointer probe is checked against stand-in backends here
and against every real Triton release in tests/launcher.

The wrappers' caches: a call that misses runs the full checks; bad input after
a good call with the same shapes still gets the same clear error (its key
differs: a dtype, a shape, a stride, a device); hits add nothing to the cache;
and results are bit-identical to the uncached path (ENABLED = False: checks on
every call and ``kernel[grid]``), compiled on the GPU tier.
"""

import types
from typing import Any

import pytest
import torch
import triton
from vllm.v1.attention.ops import triton_launcher as tl_launch
from vllm.v1.attention.ops.triton_launcher import KernelLaunch
from vllm.v1.attention.ops.triton_mla_rope_cache import (
    mla_rope_and_cache,
    mla_rope_concat_and_cache,
)

import test_triton_mla_rope_cache as mla_tests  # noqa: E402


# ------------------------------------------------------------ KernelLaunch


class _Compiled:
    """Stands in for a triton CompiledKernel: ``compiled[grid]`` is its launcher,
    ``run`` its backend launcher; both record."""

    def __init__(self):
        self.function = object()
        self.packed_metadata = ("warps", "ctas", "shared")
        self.calls = []
        self.runs = []
        self.run = lambda *args: self.runs.append(args)

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.calls.append((grid, stream, args))

        return runner


class _FakeJIT:
    """Stands in for a JITFunction: kernel[grid](...) records and returns a compiled kernel."""

    arg_names = ["x_ptr", "y_ptr", "n", "stride", "BLOCK", "FLAG"]

    def __init__(self):
        self.launches = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.compiled

        return launch


def _path(pointer_key=tl_launch.ALIGNMENT, spec=None, device=(0,), direct=True, quiet=None):
    """A launch path; ``device[0]`` is the current device (a list to change it)."""
    return tl_launch.LaunchPath(direct, "test", pointer_key, spec, lambda: device[0],
                                lambda dev: 1234 + dev, _Compiled, quiet)


@pytest.fixture
def fake_jit(monkeypatch):
    """A fake kernel on a launch path found for it."""
    monkeypatch.setattr(tl_launch, "_JITFunction", _FakeJIT)
    monkeypatch.setattr(tl_launch, "_PATH", _path())
    return _FakeJIT()


def _launch(kernel):
    return KernelLaunch(kernel, (7, 3), (5, 16), {"FLAG": True, "BLOCK": 64}, num_warps=4)


def test_first_call_goes_through_kernel_grid_then_direct(fake_jit):
    launch = _launch(fake_jit)
    x, y = torch.zeros(64), torch.zeros(64)
    launch(x, y)
    assert fake_jit.launches == [((7, 3), (x, y, 5, 16), {"FLAG": True, "BLOCK": 64,
                                                         "num_warps": 4})]
    a, b = torch.ones(64), torch.ones(64)
    launch(a, b)
    assert len(fake_jit.launches) == 1, "a hit must not go through kernel[grid]"
    # The compiled kernel's own launcher, for the grid padded to three
    # dimensions, with every parameter in order and the current stream.
    ((grid, stream, args),) = fake_jit.compiled.calls
    assert grid == (7, 3, 1) and stream == 1234
    assert args[:2] == (a, b) and args[2:] == (5, 16, 64, True)


def test_no_hook_set_calls_run_with_what_the_launcher_would_pass(fake_jit, monkeypatch):
    hooks = [False]
    monkeypatch.setattr(tl_launch, "_PATH", _path(quiet=lambda: not hooks[0]))
    launch = _launch(fake_jit)
    x, y = torch.zeros(64), torch.zeros(64)
    launch(x, y)
    launch(x, y)
    compiled = fake_jit.compiled
    assert compiled.runs == [(7, 3, 1, 1234, compiled.function, compiled.packed_metadata,
                              None, None, None, x, y, 5, 16, 64, True)]
    hooks[0] = True  # a profiler: Triton's own launcher passes the hooks
    launch(x, y)
    assert len(compiled.runs) == 1 and len(compiled.calls) == 1


def test_quiet_reads_the_hooks_of_this_triton(monkeypatch):
    """_hooks_quiet finds _RUN_CALL in the installed CompiledKernel and its
    check follows triton.knobs.runtime's hooks."""
    from triton.compiler.compiler import CompiledKernel

    quiet = tl_launch._hooks_quiet(CompiledKernel)
    assert quiet is not None and quiet()
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    assert not quiet()


def test_a_launcher_that_calls_run_otherwise_is_never_bypassed():
    class Other:
        def __getitem__(self, grid):
            return lambda *args, stream=None: self.run(grid, stream, *args)

    assert tl_launch._hooks_quiet(Other) is None


def test_another_alignment_is_another_compiled_kernel(fake_jit):
    launch = _launch(fake_jit)
    base = torch.zeros(80)
    launch(base[:64], base[:64])
    launch(base[1:65], base[:64])  # 4-byte offset: Triton specialises it differently
    assert len(fake_jit.launches) == 2 and not fake_jit.compiled.calls
    launch(base[5:69], base[16:80])  # first pointer misaligned, second aligned: a hit
    assert len(fake_jit.launches) == 2 and len(fake_jit.compiled.calls) == 1


def test_other_device_goes_through_kernel_grid(fake_jit, monkeypatch):
    device = [0]
    monkeypatch.setattr(tl_launch, "_PATH", _path(device=device))
    launch = _launch(fake_jit)
    x = torch.zeros(64)
    launch(x, x)
    device[0] = 1
    launch(x, x)
    assert len(fake_jit.launches) == 2 and not fake_jit.compiled.calls
    launch(x, x)
    assert fake_jit.compiled.calls[0][1] == 1235, "the stream of the current device"


def test_disabled_and_the_plain_path_go_through_kernel_grid(fake_jit, monkeypatch):
    x = torch.zeros(64)
    monkeypatch.setattr(tl_launch, "ENABLED", False)
    launch = _launch(fake_jit)
    launch(x, x)
    launch(x, x)
    monkeypatch.setattr(tl_launch, "ENABLED", True)
    monkeypatch.setattr(tl_launch, "_PATH", _path(direct=False))
    launch = _launch(fake_jit)
    launch(x, x)
    launch(x, x)
    assert len(fake_jit.launches) == 4 and not fake_jit.compiled.calls


def test_storage_within_2gib_is_part_of_the_key(fake_jit, monkeypatch):
    monkeypatch.setattr(tl_launch, "_PATH", _path(tl_launch.ALIGNMENT_AND_2GB))
    launch = _launch(fake_jit)
    small = torch.zeros(64)
    big = torch.empty(2**31, dtype=torch.uint8)  # not touched: no memory committed
    launch(small, small)
    launch(big[:256].view(torch.float32), small)
    launch(big[256:512].view(torch.float32), small)
    launch(torch.ones(64), small)
    assert len(fake_jit.launches) == 2 and len(fake_jit.compiled.calls) == 2


def test_backend_call_asks_the_backend_per_tensor(fake_jit, monkeypatch):
    monkeypatch.setattr(tl_launch, "_PATH", _path(
        tl_launch.BACKEND_CALL, spec=lambda t: "S" if t.numel() < 100 else ""))
    launch = _launch(fake_jit)
    small, big = torch.zeros(64), torch.zeros(128)
    launch(small, small)
    launch(big, small)
    launch(small, torch.ones(64))
    assert len(fake_jit.launches) == 2 and len(fake_jit.compiled.calls) == 1


def test_constexprs_must_be_the_trailing_parameters(fake_jit):
    launch = KernelLaunch(fake_jit, (1,), (5, 16), {"FLAG": True, "OTHER": 1})
    with pytest.raises(TypeError, match="takes"):
        launch(torch.zeros(4), torch.zeros(4))


def test_interpreted_kernels_always_go_through_kernel_grid():
    # Under TRITON_INTERPRET=1 (the CPU tier) triton.jit gives no JITFunction.
    if triton.knobs.runtime.interpret is False:
        pytest.skip("compiled Triton here")
    from vllm.v1.attention.ops.triton_fetch_kv import _fetch_kv_kernel

    assert not isinstance(_fetch_kv_kernel, tl_launch._JITFunction)


# ------------------------------------------------------------ the launch path


def test_no_usable_driver_is_the_plain_path_not_an_error(monkeypatch):
    """Where Triton cannot name its driver (the CPU tier), the path is the
    plain one, with the reason; nothing raises."""
    if torch.cuda.is_available():
        pytest.skip("a GPU driver is active here")
    path = tl_launch._find_launch_path()
    assert not path.direct and "Triton internals not found" in path.reason


def _backend(**functions):
    return type("Backend", (), {k: staticmethod(v) for k, v in functions.items()})


@pytest.mark.parametrize("functions, key", [
    ({"get_tensor_specialization": lambda t, align: "D" if t.data_ptr() % 16 == 0 else ""},
     tl_launch.ALIGNMENT),
    ({"get_arg_specialization": lambda t, ty, align: "D" if t.data_ptr() % 16 == 0 else ""},
     tl_launch.ALIGNMENT),
    ({"get_tensor_specialization": lambda t, align: ("D" if t.data_ptr() % 16 == 0 else "")
      + ("S" if t.untyped_storage().size() < 2**31 else "")}, tl_launch.ALIGNMENT_AND_2GB),
    ({"get_tensor_specialization": lambda t, align: "D" if t.dim() == 1 else ""},
     tl_launch.BACKEND_CALL),
    ({"get_tensor_specialization": lambda t, align: "D" if t.data_ptr() % 8 == 0 else ""},
     tl_launch.BACKEND_CALL),
], ids=["alignment", "alignment_before_3_6", "buffer_ops", "shape", "8_byte_alignment"])
def test_pointer_probe_names_what_the_backend_specialises_on(functions, key):
    assert tl_launch.probe_pointer_specialization(_backend(**functions))[0] == key


def test_a_backend_the_probe_cannot_read_gets_the_plain_path():
    assert tl_launch.probe_pointer_specialization(_backend())[0] is None

    def boom(t, align):
        raise RuntimeError("needs a device tensor")

    key, why = tl_launch.probe_pointer_specialization(_backend(get_tensor_specialization=boom))
    assert key is None and "probe failed" in why


# ------------------------------------------------------------ wrapper caches


def _cache_sizes():
    return [len(c) for c in tl_launch._CACHES]


# The error tables of the kernel tests build CPU tensors; on a GPU machine a
# good CPU call would launch the compiled kernel on them.  The checks and the
# key cache are the same Python on every device.
CPU_TABLES = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the error tables build CPU tensors")


@pytest.mark.parametrize("name,mutate,exc,match", mla_tests.BAD_ARGS,
                         ids=[b[0] for b in mla_tests.BAD_ARGS])
def test_mla_bad_input_after_a_good_call_raises_the_same_error(name, mutate, exc, match,
                                                              device):
    import re

    for form in ("decode", "prefill"):
        good = mla_tests._valid_args(device)
        args = mutate(mla_tests._valid_args(device))
        fn = mla_rope_concat_and_cache if form == "decode" else mla_rope_and_cache
        if form == "prefill":
            del good["ql_nope"], args["ql_nope"]
        fn(**good)
        with pytest.raises(exc, match=re.escape(match)):
            fn(**args)


# ------------------------------------------------------------ cached_launch


def _counting_check():
    calls = []

    @tl_launch.cached_launch
    def check(*args):
        calls.append(args)
        if args and args[0] is None:
            raise ValueError("check: bad input")
        return object()

    return check, calls


def test_cached_launch_hits_on_the_same_geometry_and_values():
    check, calls = _counting_check()
    a, b = torch.zeros(4, 3), torch.ones(4, 3)  # other data, other pointer
    first = check(a, 5, "NHD", (a, 2))
    assert check(b, 5, "NHD", (b, 2)) is first and len(calls) == 1


@pytest.mark.parametrize(
    "other",
    [
        lambda t: (t.t().contiguous().t(), 5, "NHD"),  # strides
        lambda t: (t.view(3, 4), 5, "NHD"),  # shape
        lambda t: (t.double(), 5, "NHD"),  # dtype
        lambda t: (t.to("meta"), 5, "NHD"),  # device
        lambda t: (t, 6, "NHD"),  # a scalar
        lambda t: (t, 5.0, "NHD"),  # the same value, another type
        lambda t: (t, 5, "SHUFFLE"),  # a string
        lambda t: (t, 5, "NHD", None),  # one more argument
    ],
)
def test_cached_launch_misses_on_anything_the_check_can_read(other):
    check, calls = _counting_check()
    t = torch.zeros(4, 3)
    first = check(t, 5, "NHD")
    assert check(*other(t)) is not first and len(calls) == 2


def test_cached_launch_caches_nothing_for_a_call_that_raises():
    check, calls = _counting_check()
    for _ in range(2):
        with pytest.raises(ValueError, match="bad input"):
            check(None, torch.zeros(2))
    assert len(calls) == 2 and not check.cache


def test_cached_launch_checks_every_call_when_unhashable_or_disabled(monkeypatch):
    check, calls = _counting_check()
    check([1], 2)
    check([1], 2)  # a list: no key
    monkeypatch.setattr(tl_launch, "ENABLED", False)
    check(torch.zeros(1))
    check(torch.zeros(1))
    assert len(calls) == 4 and not check.cache


def test_cached_launch_keys_annotated_groups_and_values():
    calls = []

    @tl_launch.cached_launch
    def check(
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: tl_launch.Tensors3 | None,
        scale: tuple[Any, Any],
        layout: str,
        plan: tuple[int, ...] | None,
    ):
        calls.append(1)
        return len(calls)

    a, b = torch.zeros(4, 3), torch.zeros(4, 3)
    meta = (a, b, torch.zeros(2))
    first = check((a, b), meta, (None, a), "NHD", None)
    assert check((b, a), (b, a, torch.ones(2)), (None, b), "NHD", None) == first
    others = [
        ((a, a.t()), meta, (None, a), "NHD", None),  # a group's strides
        ((a, b), None, (None, a), "NHD", None),  # a group given as None
        ((a, b), meta, (a, a), "NHD", None),  # None in a group vs a tensor
        ((a, b), meta, (None, a), "SHUFFLE", None),
        ((a, b), meta, (None, a), "NHD", (16, 4)),
    ]
    assert len({check(*args) for args in others}) == len(others) and len(calls) == 6
    for _ in range(2):  # a group of another size: no key, checked every call
        check((a,), meta, (None, a), "NHD", None)
    assert len(calls) == 8 and len(check.cache) == 6


def test_clear_caches_empties_cached_launches():
    check, calls = _counting_check()
    check(torch.zeros(1))
    tl_launch.clear_caches()
    check(torch.zeros(1))
    assert len(calls) == 2


# ------------------------------------------------------------ same results as the plain path


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _twice_and_plain(run, monkeypatch):
    """Outputs of run() on the cached path (a miss, then a hit) and on the plain path."""
    tl_launch.clear_caches()
    miss = run()
    hit = run()
    monkeypatch.setattr(tl_launch, "ENABLED", False)
    plain = run()
    monkeypatch.setattr(tl_launch, "ENABLED", True)
    return miss, hit, plain


def _assert_same(outs):
    miss, hit, plain = outs
    for a, b, c in zip(miss, hit, plain, strict=True):
        assert torch.equal(_bits(a), _bits(c)) and torch.equal(_bits(b), _bits(c))


def test_mla_rows_bound_metadata(device):
    """Calls passing the rows' own tensors use the rows' checks (made by the
    first call; one key for every layer); other tensors with the same rows are
    checked themselves; the outputs are those of the call without rows."""
    from vllm.v1.attention.ops import triton_mla_rope_cache as mla

    tl_launch.clear_caches()
    args = mla_tests._valid_args(device)
    ref = mla_rope_concat_and_cache(**{**args, "kv_cache": args["kv_cache"].clone()})
    rows = mla.mla_rope_rows(args["slot_mapping"], args["positions"], args["cos_sin_cache"])
    assert rows.checked is None
    for _ in range(2):
        out = mla_rope_concat_and_cache(**{**args, "kv_cache": args["kv_cache"].clone()},
                                        rows=rows)
        assert torch.equal(out, ref)
    assert rows.checked is not None and len(mla._check_rows.cache) == 1
    assert len(mla._mla_rope_concat_and_cache_launch.cache) == 1, (
        "calls with and without rows share their key")
    bad = dict(args, slot_mapping=args["slot_mapping"].float())
    with pytest.raises(TypeError, match="slot_mapping"):
        mla_rope_concat_and_cache(**bad, rows=rows)
    longer = dict(args, positions=torch.tensor([0, 5], device=device))
    with pytest.raises(AssertionError, match="positions"):
        mla_rope_concat_and_cache(**longer, rows=rows)
    prefill = {k: v for k, v in args.items() if k != "ql_nope"}
    mla_rope_and_cache(**prefill, rows=rows)
    mla_rope_and_cache(**prefill, rows=rows)
    assert len(mla._mla_rope_and_cache_launch.cache) == 1
    assert mla.mla_rope_rows(None, None, None).checked is None  # checked by calls


def test_host_int_helpers_are_tritons():
    """The wrappers size launches with upstream's vllm.utils.math_utils (plain
    Python) in place of Triton's constexpr functions: the same values."""
    from vllm.utils.math_utils import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(1, 2049)] == [
        triton.next_power_of_2(n) for n in range(1, 2049)]
    assert [cdiv(a, b) for a in range(0, 300) for b in (1, 7, 16, 128)] == [
        triton.cdiv(a, b) for a in range(0, 300) for b in (1, 7, 16, 128)]
