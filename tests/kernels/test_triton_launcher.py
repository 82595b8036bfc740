"""triton_launcher (vllm/v1/attention/ops/triton_launcher.py) and the wrappers on it.

``launch()``'s direct path is exercised on the CPU tier with a stand-in for a
compiled Triton kernel that records what it is handed: the first call of a key
goes through ``kernel[grid]``, later ones hand every parameter (parameter
order) to the compiled kernel's ``run``, and anything that selects another
compiled kernel (pointer alignment or storage, a dtype, a specialised scalar, a
constexpr or option, the device, ENABLED off, the plain path) goes back through
``kernel[grid]``.  The pointer probe is checked against stand-in backends here
and against every real Triton release in tests/launcher.

The wrappers check every call: bad input after a good call (a launch hit) still
gets the same clear error, and results through launch hits are bit-identical
to ``kernel[grid]`` on every call (ENABLED = False), compiled on the GPU tier.
"""

import inspect
import types

import pytest
import torch
import triton
from vllm.v1.attention.ops import triton_launcher as tl_launch
from vllm.v1.attention.ops.triton_fetch_kv import fetch_kv, fetch_kv_plan
from vllm.v1.attention.ops.triton_mla_rope_cache import (
    mla_rope_and_cache,
    mla_rope_concat_and_cache,
)
from vllm.v1.attention.ops.triton_paged_context_attention import (
    paged_context_attention,
    paged_context_workspace,
)

import test_triton_fetch_kv as fk_tests  # noqa: E402  (sibling test module)
import test_triton_mla_rope_cache as mla_tests  # noqa: E402
import test_triton_paged_context_attention as pca_tests  # noqa: E402


# ------------------------------------------------------------ stand-ins


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


def test_interpreted_kernels_always_go_through_kernel_grid():
    # Under TRITON_INTERPRET=1 (the CPU tier) triton.jit gives no JITFunction.
    if triton.knobs.runtime.interpret is False:
        pytest.skip("compiled Triton here")
    from vllm.v1.attention.ops.triton_fetch_kv import _fetch_kv_kernel

    assert not isinstance(_fetch_kv_kernel, tl_launch._JITFunction)


# ------------------------------------------------------------ launch()


class _Param:
    def __init__(self, name, do_not_specialize=False, default=inspect.Parameter.empty):
        self.name, self.do_not_specialize, self.default = name, do_not_specialize, default


class _StepJIT(_FakeJIT):
    """A kernel (x_ptr, y_ptr, n, stride, BLOCK, FLAG=False) whose ``n`` is a
    per-step integer (do_not_specialize)."""

    params = [_Param("x_ptr"), _Param("y_ptr"), _Param("n", do_not_specialize=True),
              _Param("stride"), _Param("BLOCK"), _Param("FLAG", default=False)]


@pytest.fixture
def step_jit(monkeypatch):
    monkeypatch.setattr(tl_launch, "_JITFunction", _StepJIT)
    monkeypatch.setattr(tl_launch, "_PATH", _path(quiet=lambda: True))
    tl_launch.clear_caches()
    yield _StepJIT()
    tl_launch.clear_caches()


def test_launch_compiles_through_kernel_grid_then_runs_the_compiled_kernel(step_jit):
    x, y = torch.zeros(64), torch.zeros(64)
    tl_launch.launch(step_jit, (7, 3), x, y, 5, 16, BLOCK=64, num_warps=4)
    assert step_jit.launches == [((7, 3), (x, y, 5, 16), {"BLOCK": 64, "num_warps": 4})]
    a, b = torch.ones(64), torch.ones(64)
    tl_launch.launch(step_jit, (9,), a, b, 6, 16, BLOCK=64, num_warps=4)
    assert len(step_jit.launches) == 1, "a hit must not go through kernel[grid]"
    compiled = step_jit.compiled
    # What CompiledKernel[grid]'s launcher would pass: the grid padded to three,
    # the stream, handle and metadata, no launch metadata or hooks, then every
    # parameter in order (FLAG's default included).
    assert compiled.runs == [(9, 1, 1, 1234, compiled.function, compiled.packed_metadata,
                              None, None, None, a, b, 6, 16, 64, False)]


@pytest.mark.parametrize("edit", [
    lambda a, kw: ((a[0][1:], *a[1:]), kw),          # another pointer alignment
    lambda a, kw: ((a[0].double(), *a[1:]), kw),      # another dtype
    lambda a, kw: ((*a[:3], 17), kw),                 # another (specialised) scalar
    lambda a, kw: ((*a[:2], 2**31, a[3]), kw),        # a per-step value of another type
    lambda a, kw: (a, {**kw, "BLOCK": 32}),           # another constexpr
    lambda a, kw: (a, {**kw, "num_warps": 8}),        # another option
], ids=["alignment", "dtype", "scalar", "per_step_type", "constexpr", "option"])
def test_what_selects_another_compiled_kernel_goes_through_kernel_grid(step_jit, edit):
    base = torch.zeros(80)
    args, kwargs = (base[:64], base[:64], 5, 16), {"BLOCK": 64, "num_warps": 4}
    tl_launch.launch(step_jit, (1,), *args, **kwargs)
    args, kwargs = edit(args, kwargs)
    tl_launch.launch(step_jit, (1,), *args, **kwargs)
    assert len(step_jit.launches) == 2 and not step_jit.compiled.runs
    tl_launch.launch(step_jit, (1,), *args, **kwargs)
    assert len(step_jit.compiled.runs) == 1, "the new key is kept"


def test_a_per_step_value_is_a_hit(step_jit):
    x = torch.zeros(64)
    for n in (1, 16, 37, 4096):
        tl_launch.launch(step_jit, (n,), x, x, n, 16, BLOCK=64)
    assert len(step_jit.launches) == 1 and len(step_jit.compiled.runs) == 3


def test_launch_hooks_go_through_the_compiled_kernels_launcher(step_jit, monkeypatch):
    hooks = [False]
    monkeypatch.setattr(tl_launch, "_PATH", _path(quiet=lambda: not hooks[0]))
    x = torch.zeros(64)
    tl_launch.launch(step_jit, (2, 2), x, x, 5, 16, BLOCK=64)
    hooks[0] = True  # a profiler: Triton's own launcher passes the hooks
    tl_launch.launch(step_jit, (3, 2), x, x, 6, 16, BLOCK=64)
    assert not step_jit.compiled.runs
    assert step_jit.compiled.calls == [((3, 2, 1), 1234, (x, x, 6, 16, 64, False))]


def test_launch_plain_where_it_cannot_hit(step_jit, monkeypatch):
    x = torch.zeros(64)
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    tl_launch.launch(step_jit, (1,), x, 3, 5, 16, BLOCK=64)  # a non-tensor pointer
    monkeypatch.setattr(tl_launch, "ENABLED", False)
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    monkeypatch.setattr(tl_launch, "ENABLED", True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    assert len(step_jit.launches) == 4 and not step_jit.compiled.runs
    other = _FakeJIT()  # not a JITFunction here (an interpreted kernel)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    tl_launch.launch(other, (1,), x, x, 5, 16, BLOCK=64)
    tl_launch.launch(other, (1,), x, x, 5, 16, BLOCK=64)
    assert len(other.launches) == 2 and other not in tl_launch._STATES


@pytest.mark.parametrize("pointer_key", [tl_launch.ALIGNMENT_AND_2GB, tl_launch.BACKEND_CALL])
def test_launch_keys_pointers_as_the_backend_does(step_jit, monkeypatch, pointer_key):
    spec = lambda t: "S" if t.untyped_storage().nbytes() < 2**31 else ""  # noqa: E731
    monkeypatch.setattr(tl_launch, "_PATH", _path(pointer_key, spec=spec, quiet=lambda: True))
    small = torch.zeros(64)
    big = torch.empty(2**31, dtype=torch.uint8)  # not touched: no memory committed
    tl_launch.launch(step_jit, (1,), small, small, 5, 16, BLOCK=64)
    tl_launch.launch(step_jit, (1,), big[:256].view(torch.float32), small, 5, 16, BLOCK=64)
    tl_launch.launch(step_jit, (1,), big[256:512].view(torch.float32), small, 6, 16, BLOCK=64)
    tl_launch.launch(step_jit, (1,), torch.ones(64), small, 7, 16, BLOCK=64)
    assert len(step_jit.launches) == 2 and len(step_jit.compiled.runs) == 2


@pytest.mark.parametrize("call", [
    lambda x: ((x, x, 5), {"BLOCK": 64, "stride": 16}),     # fewer positional arguments
    lambda x: ((x, x, 5, 16), {"BLOCK": 64, "FLAG": True}),  # another keyword
    lambda x: ((x, x, 5, 16), {"FLAG": 64}),                 # as many, other names
], ids=["positional", "keyword", "names"])
def test_calls_shaped_otherwise_go_through_kernel_grid(step_jit, call):
    """A kernel's fast path is for calls shaped like its first compiled one
    (one call site, as the wrappers have): others always take kernel[grid]."""
    x = torch.zeros(64)
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    args, kwargs = call(x)
    tl_launch.launch(step_jit, (1,), *args, **kwargs)
    tl_launch.launch(step_jit, (1,), *args, **kwargs)
    assert len(step_jit.launches) == 3 and not step_jit.compiled.runs
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    tl_launch.launch(step_jit, (1,), x, x, 7, 16, BLOCK=64)  # another per-step value
    assert len(step_jit.compiled.runs) == 2


def test_another_device_is_another_key(step_jit, monkeypatch):
    device = [0]
    monkeypatch.setattr(tl_launch, "_PATH", _path(device=device, quiet=lambda: True))
    x = torch.zeros(64)
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    device[0] = 1
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    tl_launch.launch(step_jit, (1,), x, x, 5, 16, BLOCK=64)
    assert len(step_jit.launches) == 2 and step_jit.compiled.runs[0][3] == 1235


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


# The error tables of the kernel tests build CPU tensors; on a GPU machine a
# good CPU call would launch the compiled kernel on them.  The checks and the
# key cache are the same Python on every device.
CPU_TABLES = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the error tables build CPU tensors")


def _fetch_kv_cases():
    return [(c[0], c[1], c[2], c[3]) for c in fk_tests.INVALID]


@pytest.mark.parametrize("name,make_args,exc,match", _fetch_kv_cases(),
                         ids=[c[0] for c in fk_tests.INVALID])
@CPU_TABLES
def test_fetch_kv_bad_input_after_a_good_call_raises_the_same_error(name, make_args, exc, match):
    fetch_kv(**fk_tests._valid_args())
    fetch_kv(**fk_tests._valid_args())  # a launch hit
    with pytest.raises(exc, match=match):
        fetch_kv(**make_args())


@CPU_TABLES
def test_fetch_kv_plan_bad_input_after_a_good_call_raises_the_same_error():
    good = {"block_table": torch.ones(1, 2, dtype=torch.int32),
            "cu_seqlens_kv": torch.tensor([0, 8], dtype=torch.int32),
            "seq_starts": torch.zeros(1, dtype=torch.int32),
            "num_tokens": 8, "block_size": 16, "head_size": 64, "cache_dtype": torch.float16}
    fetch_kv_plan(**good)
    fetch_kv_plan(**good)  # a launch hit
    for edits, exc, match in [c[1:] for c in fk_tests.PLAN_INVALID]:
        with pytest.raises(exc, match=match):
            fetch_kv_plan(**{**good, **edits})


def test_fetch_kv_with_a_plan_checks_the_plan_on_every_key(device):
    args = fk_tests._valid_args(device)
    fetch_kv(**args, plan=fk_tests._plan_for(device))
    for overrides, edits, exc, match in [c[1:] for c in fk_tests.PLAN_MISMATCHES]:
        plan = "plan" if overrides is None else fk_tests._plan_for(device, **overrides)
        call = dict(args)
        for key, fn in edits.items():
            call[key] = fn(call)
        with pytest.raises(exc, match=match):
            fetch_kv(**call, plan=plan)


def test_fetch_kv_changed_stride_is_checked_and_launched(device):
    args = fk_tests._valid_args(device)
    fetch_kv(**args)
    fetch_kv(**fk_tests._valid_args(device))  # same key (new tensors): a hit
    # Same shapes, other strides: a transposed-back cache view (SHUFFLE needs dense blocks).
    kc = torch.randn(4, 2, 16, 64, device=device).half().transpose(1, 2)
    with pytest.raises(ValueError, match="dense"):
        fetch_kv(**{**args, "key_cache": kc, "value_cache": kc.clone(),
                    "kv_cache_layout": "SHUFFLE"})
    fetch_kv(**{**args, "key_cache": kc, "value_cache": kc.clone()})  # valid NHD: new key
    # Block 1, slots 0-7 of each head (block_table is all ones, 8 tokens from 0).
    assert torch.equal(args["key_out"], kc[1, :8])


@pytest.mark.parametrize("idx", range(22))
def test_paged_context_bad_input_after_a_good_call_raises_the_same_error(idx, device):
    name, kwargs, exc = pca_tests._bad_args(device)[idx]
    # The table's first entry with its edit undone (query_2d: the query itself).
    good = dict(pca_tests._bad_args(device)[0][1],
                query=pca_tests.build(pca_tests.Case("args", [20], [3]), device)["q"])
    paged_context_attention(**good)
    paged_context_attention(**good)  # a launch hit
    with pytest.raises(exc, match=pca_tests.BAD_ARGS_MATCH):
        paged_context_attention(**kwargs)


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


@pytest.mark.parametrize("path", ["lookup", "plan"])
def test_fetch_kv_cached_path_is_bit_identical(path, device, monkeypatch):
    case = fk_tests.CPU_CASES[3]  # many requests, ragged

    def run():
        return fk_tests.run_case(case, device, path=path)

    _assert_same(_twice_and_plain(run, monkeypatch))


@pytest.mark.parametrize("num_splits,workspace", [(None, False), (2, False), (2, True)])
def test_paged_context_cached_path_is_bit_identical(num_splits, workspace, device,
                                                    monkeypatch):
    case = pca_tests.Case("cached", [45, 21], [5, 7], num_splits=num_splits)
    data = pca_tests.build(case, device)
    q = data["q"]

    def run():
        ws = None
        if workspace:
            ws = paged_context_workspace(q.shape[0], 2, q.shape[1], data["key_cache"].shape[2],
                                         q.shape[2], q.dtype, q.device, num_splits=num_splits)
        out, lse = paged_context_attention(
            q, data["key_cache"], data["value_cache"], data["block_table"],
            data["cu_seqlens_q"], data["seq_lens"], data["scale"], key=data["k_new"],
            value=data["v_new"], num_splits=None if workspace else num_splits, workspace=ws)
        return out.clone(), lse.clone()

    _assert_same(_twice_and_plain(run, monkeypatch))


@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_mla_cached_path_is_bit_identical(form, device, monkeypatch):
    def run():
        torch.manual_seed(0)  # _valid_args draws random inputs
        args = mla_tests._valid_args(device)
        if form == "decode":
            return (mla_rope_concat_and_cache(**args), args["kv_cache"])
        del args["ql_nope"]
        mla_rope_and_cache(**args)
        return (args["q_pe"], args["k_pe"], args["kv_cache"])

    _assert_same(_twice_and_plain(run, monkeypatch))


def test_paged_context_workspace_must_match_the_call(device):
    case = pca_tests.Case("ws", [20], [3])
    d = pca_tests.build(case, device)
    q = d["q"]
    args = (q, d["key_cache"], d["value_cache"], d["block_table"], d["cu_seqlens_q"],
            d["seq_lens"], d["scale"])
    ws = paged_context_workspace(q.shape[0] + 1, 1, q.shape[1], d["key_cache"].shape[2],
                                 q.shape[2], q.dtype, q.device, num_splits=2)
    with pytest.raises(ValueError, match="paged_context_attention: lse must be"):
        paged_context_attention(*args, workspace=ws)
    with pytest.raises(TypeError, match="PagedContextWorkspace"):
        paged_context_attention(*args, workspace=types.SimpleNamespace(key=()))
    ws = paged_context_workspace(q.shape[0], 1, q.shape[1], d["key_cache"].shape[2],
                                 q.shape[2], q.dtype, q.device, num_splits=2)
    with pytest.raises(ValueError, match="differs from the workspace"):
        paged_context_attention(*args, workspace=ws, num_splits=3)
    out, lse = paged_context_attention(*args, workspace=ws)
    assert lse is ws.lse


# ------------------------------------------------------------ GPU: the kernel Triton picks


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned_outputs"])
def test_direct_launch_uses_the_kernel_triton_picks(offset, device, monkeypatch):
    """For every alignment pattern, the compiled kernel a hit launches is the one
    JITFunction.run would pick (kernel.warmup), and the outputs match the plain path."""
    from vllm.v1.attention.ops import triton_fetch_kv as module

    launches = []

    def recording_launch(kernel, grid, *args, **kwargs):
        launches.append((grid, args, kwargs))
        tl_launch.launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", recording_launch)
    case = fk_tests.CPU_CASES[1]  # fp16, ragged start
    gen = torch.Generator().manual_seed(case.seed)
    table, num_blocks = fk_tests.make_block_table(case.lens, case.starts, case.block_size,
                                                  case.extra_blocks, gen)
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    kc = torch.randn(shape, device=device, dtype=case.cache_dtype)
    vc = torch.randn(shape, device=device, dtype=case.cache_dtype)
    cu = torch.tensor([0] + case.lens, device=device).cumsum(0).to(torch.int32)
    starts = torch.tensor(case.starts, dtype=torch.int32, device=device)
    table = table.to(device)
    total = int(cu[-1])
    outs = []
    for enabled in (True, True, False):
        monkeypatch.setattr(tl_launch, "ENABLED", enabled)
        flat = torch.zeros(2, (total + 1) * case.num_kv_heads * case.head_size + 8,
                           device=device, dtype=case.cache_dtype)
        n = total * case.num_kv_heads * case.head_size
        ko = flat[0, offset:offset + n].view(total, case.num_kv_heads, case.head_size)
        vo = flat[1, offset:offset + n].view(total, case.num_kv_heads, case.head_size)
        fetch_kv(kc, vc, ko, vo, table, cu, starts)
        outs.append((ko.clone(), vo.clone()))
        if enabled:
            (grid, args, kwargs), = launches[-1:]
            picked = module._fetch_kv_kernel.warmup(*args, grid=grid, **kwargs)
            state = tl_launch._STATES[module._fetch_kv_kernel]
            assert picked.function in {c.kernel.function for c, _ in state.compiled.values()}
    torch.cuda.synchronize()
    for k in range(2):
        assert torch.equal(outs[0][k], outs[2][k]) and torch.equal(outs[1][k], outs[2][k])


def test_paged_context_workspace_call_checks_its_metadata(device):
    """A workspace call after good ones checks the metadata it is given (nothing
    about them is kept from an earlier call), and other metadata tensors of the
    same values give the same output."""
    case = pca_tests.Case("bound", [20, 9], [3, 4])
    d = pca_tests.build(case, device)
    q = d["q"]
    ws = paged_context_workspace(q.shape[0], 2, q.shape[1], d["key_cache"].shape[2],
                                 q.shape[2], q.dtype, q.device, num_splits=2)
    args = [q, d["key_cache"], d["value_cache"], d["block_table"], d["cu_seqlens_q"],
            d["seq_lens"], d["scale"]]
    ref, _ = paged_context_attention(*args, num_splits=2)
    ref = ref.clone()
    out, lse = paged_context_attention(*args, workspace=ws)
    assert lse is ws.lse and torch.equal(out, ref)
    paged_context_attention(*args, workspace=ws)
    bad = list(args)
    bad[3] = d["block_table"].float()
    with pytest.raises(TypeError, match="request metadata must be int32 or int64"):
        paged_context_attention(*bad, workspace=ws)
    other = list(args)
    other[3] = d["block_table"].clone()
    out2, _ = paged_context_attention(*other, workspace=ws)
    assert torch.equal(out2, ref)


class _MLAJIT(_FakeJIT):
    """The MLA kernel's parameters (its per-step integers do_not_specialize),
    launches recorded: a fake JITFunction of the interpreted kernel."""

    def __init__(self, real):
        super().__init__()
        per_step = ("num_tokens", "num_slots", "num_heads")
        self.arg_names = list(inspect.signature(real.fn).parameters)
        self.params = [_Param(n, n in per_step) for n in self.arg_names]


@CPU_TABLES
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_mla_hit_runs_what_kernel_grid_got_and_still_checks(form, monkeypatch):
    """A call that hits runs the compiled kernel with exactly the arguments
    the first call handed kernel[grid] (parameter order, constexprs last);
    bad input after it still raises (nothing kept of the checked call)."""
    from vllm.v1.attention.ops import triton_mla_rope_cache as mla

    kernel = _MLAJIT(mla._mla_rope_cache_kernel)
    monkeypatch.setattr(mla, "_mla_rope_cache_kernel", kernel)
    monkeypatch.setattr(tl_launch, "_JITFunction", _MLAJIT)
    monkeypatch.setattr(tl_launch, "_PATH", _path(quiet=lambda: True))
    tl_launch.clear_caches()
    args = mla_tests._valid_args("cpu")
    args["q_out"] = torch.empty(3, 2, 48)
    fn = mla_rope_concat_and_cache
    if form == "prefill":
        del args["q_out"], args["ql_nope"]
        fn = mla_rope_and_cache
    fn(**args)
    fn(**args)
    (grid, first, constexprs), = kernel.launches
    (run,) = kernel.compiled.runs
    names = kernel.arg_names[len(first) :]
    assert set(constexprs) == {*names, "num_warps", "enable_fp_fusion"}
    assert run[:3] == (*grid, 1) and len(run) == 9 + len(first) + len(names)
    n = len(first)
    same = [a is b or type(a) is int and a == b for a, b in zip(run[9:], first)]
    assert all(same), same
    assert run[9 + n :] == tuple(map(constexprs.get, names))
    import re

    for _, mutate, exc, match in mla_tests.BAD_ARGS:
        with pytest.raises(exc, match=re.escape(match)):
            fn(**mutate(dict(args)))
    tl_launch.clear_caches()
