"""Fake conformance: every call of an AITER fake also goes to real AITER, same inputs.

A pytest plugin (``-p conformance`` with ``tests/fakes`` on ``PYTHONPATH``),
active when ``AITER_CONFORMANCE=<file.json>`` is set; ``make validate-rocm``
runs every test that goes through these fakes this way on a ROCm machine.
Every fake is registered through ``aiter_export.AiterExport``
(``register_guarded`` / ``register_direct`` / ``export_plain``); the plugin
wraps what those register, so each call of a fake

1. clones its inputs (whole storages, aliasing kept: the fakes and the kernels
   read raw memory), onto the GPU when they are CPU tensors (AITER runs there);
2. runs the fake on the originals (the test sees the fake, as always);
3. runs the same function of the reference -- real AITER, imported before any
   fake is installed, with ``sys.modules["aiter*"]`` and ``torch.ops.aiter``
   put back to it for the call -- on the clones;
4. compares: both accept or both refuse (the fake's exception an instance of
   AITER's class, AITER's message containing the fake's), and where both ran,
   the outputs (every tensor argument after the call, and the result) by the
   fake's rule in ``RULES``: bit-exact by default (copies), ulps for the MLA
   op's RoPE columns, a relative bound for attention.

A fake that raises ``KernelMisread`` (the kernel would read the wrong memory,
not raise) or ``NotImplementedError("fake: ...")`` (not modelled) is counted,
not compared.  Calls nested in a compared call (the varlen ops under
``flash_attn_varlen_func``) are not compared again.  A fake of another arch
than the device's is compared only where the arch cannot matter (no fp8 data:
e4m3fn vs fnuz is the arch's; elsewhere the arch picks among kernels that
compute the same), and counted as such.  At the end the plugin
writes the JSON: per fake the counts and the worst error seen, and each
disagreement with the test that made the call and the call's arguments.

``AITER_CONFORMANCE_REFERENCE=module:factory`` replaces real AITER by another
reference (a ``Reference``); the CPU tier's own tests use a second copy of the
fakes there, one of them made to disagree (tests/validate_rocm/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

import aiter_export
from aiter_export import AiterExport

__all__ = ["ENV", "RULES", "Harness", "RealAiter", "Reference", "Rule", "StandIn"]

ENV = "AITER_CONFORMANCE"
REFERENCE_ENV = "AITER_CONFORMANCE_REFERENCE"
MAX_RECORDED = 20  # disagreements kept per fake (all are counted)


@dataclasses.dataclass(frozen=True)
class Rule:
    """How a fake's outputs must match AITER's where both ran.

    ``ulps``: floating-point elements within this many units in the last place
    (compared as bit patterns, so fp8 bytes in a uint8 cache too); 0 is
    bit-exact.  ``rel``: instead, |fake - aiter| <= rel * u * (1 + |aiter|)
    with u the dtype's unit roundoff (the fakes compute attention in float64
    and round once; AITER's kernels round P and partial results).
    ``exact_cols``: (named arguments) -> the slice of the last dimension that
    must be bit-exact in tensors of that width (the copied part of a row).
    Integer tensors are always compared exactly."""

    ulps: int = 0
    rel: float | None = None
    exact_cols: Callable[[dict], tuple[int, slice]] | None = None


def _mla_copied_cols(named: dict) -> tuple[int, slice]:
    lora, pe = named["kv_c"].size(-1), named["k_pe"].size(-1)
    cols = slice(0, lora) if named["is_nope_first"] else slice(pe, pe + lora)
    return lora + pe, cols


_ATTENTION = Rule(rel=4.0)
RULES = {
    # kv_c / q_nope are copied into the row (bit-exact); RoPE in fp32 either way.
    "fused_qk_rope_concat_and_cache_mla": Rule(ulps=1, exact_cols=_mla_copied_cols),
    "flash_attn_varlen_func": _ATTENTION,
    "mha_varlen_fwd": _ATTENTION,
    "fmha_v3_varlen_fwd": _ATTENTION,
    "unified_attention": _ATTENTION,
    "paged_attention_v1": _ATTENTION,
}


# --------------------------------------------------------------------------
# References: where "the same function" comes from.
# --------------------------------------------------------------------------


class Reference:
    """What a fake is compared with: ``lookup(kind, module, name)`` gives the
    callable (an attribute of ``module``, or the ``torch.ops.aiter`` op where
    the fake is reached only there: ``module`` None);
    ``active()`` is the context it runs in; ``arch`` its device's gfx arch;
    ``device`` where its inputs must live."""

    name = "reference"
    arch: str | None = None
    device = torch.device("cpu")

    def lookup(self, kind: str, module: str | None, name: str) -> Callable | None:
        raise NotImplementedError

    @contextlib.contextmanager
    def active(self):
        yield


def _aiter_modules() -> dict:
    return {n: m for n, m in sys.modules.items() if n == "aiter" or n.startswith("aiter.")}


class RealAiter(Reference):
    """The AITER installed here: imported now, before any fake replaces it."""

    name = "aiter"

    def __init__(self):
        import aiter  # noqa: F401 - raises where AITER is not installed

        for mod in ("aiter.ops.cache", "aiter.ops.mha", "aiter.ops.attention",
                    "aiter.ops.triton.attention.unified_attention"):
            with contextlib.suppress(ImportError):
                importlib.import_module(mod)
        self.modules = _aiter_modules()
        self.ops = torch.ops.aiter
        self.version = getattr(sys.modules["aiter"], "__version__", None)
        self.device = torch.device("cuda")
        props = torch.cuda.get_device_properties(0)
        self.arch = getattr(props, "gcnArchName", "").split(":")[0] or None

    def lookup(self, kind, module, name):
        # A guarded op through its module's export (``wrapper_custom`` builds and
        # registers the op on first use); a direct op through torch.ops.aiter.
        if module is None:
            return getattr(self.ops, name, None)
        mod = self.modules.get(module)
        return getattr(mod, name, None) if mod is not None else None

    @contextlib.contextmanager
    def active(self):
        saved_modules = _aiter_modules()
        saved_ops = torch.ops.__dict__.get("aiter")
        for n in saved_modules:
            sys.modules.pop(n)
        sys.modules.update(self.modules)
        setattr(torch.ops, "aiter", self.ops)
        try:
            yield
        finally:
            for n in _aiter_modules():
                sys.modules.pop(n)
            sys.modules.update(saved_modules)
            if saved_ops is None:
                torch.ops.__dict__.pop("aiter", None)
            else:
                setattr(torch.ops, "aiter", saved_ops)


class StandIn(Reference):
    """Another ``AiterExport`` standing in for AITER (the CPU tier's tests of
    this harness): built by ``build()`` with the harness off, installed for
    each call."""

    name = "stand-in"

    def __init__(self, build: Callable[[], AiterExport], arch: str, device="cpu"):
        with Harness.suspended():
            self.export = build()
        self.arch = arch
        self.device = torch.device(device)

    def lookup(self, kind, module, name):
        if module is None:
            return getattr(getattr(torch.ops, self.export.namespace), name, None)
        mod = self.export.modules.get(module)
        return getattr(mod, name, None) if mod is not None else None

    @contextlib.contextmanager
    def active(self):
        with self.export:
            yield


# --------------------------------------------------------------------------
# Inputs: cloned with their storages; described for the report.
# --------------------------------------------------------------------------


def _clone(value, memo: dict, device: torch.device):
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        key = (storage.data_ptr(), str(value.device))
        if key not in memo:
            raw = torch.empty(0, dtype=torch.uint8, device=value.device)
            raw.set_(storage, 0, (storage.nbytes(),), (1,))
            memo[key] = raw.to(device, copy=True).untyped_storage()
        out = torch.empty(0, dtype=value.dtype, device=device)
        return out.set_(memo[key], value.storage_offset(), value.size(), value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v, memo, device) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v, memo, device) for k, v in value.items()}
    return value


def _describe(value) -> object:
    if isinstance(value, torch.Tensor):
        return (f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} "
                f"stride={tuple(value.stride())} on {value.device.type}")
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return type(value).__name__


def _bind(fn: Callable, args: tuple, kwargs: dict) -> dict:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return dict(bound.arguments)


def _tensors(value, path: str = "result"):
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}[{i}]")


# --------------------------------------------------------------------------
# Comparing.
# --------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns as integers ordered like the floats they encode (sign-magnitude)."""
    bits = t.contiguous().view(_INT_OF_SIZE[t.element_size()]).long()
    sign = 1 << (8 * t.element_size() - 1)
    return torch.where(bits < 0, -(bits & (sign - 1)), bits)


def _floatish(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype == torch.uint8  # uint8: fp8 cache bytes


def compare_tensor(fake: torch.Tensor, ref: torch.Tensor, rule: Rule, named: dict,
                   allocated: bool) -> tuple[str | None, float]:
    """(problem or None, worst error in the rule's unit). ``allocated``: the
    tensor was made by the call (NaN in the fake's = left unwritten)."""
    if fake.shape != ref.shape or fake.dtype != ref.dtype:
        return (f"shape/dtype {tuple(fake.shape)} {fake.dtype} vs AITER's "
                f"{tuple(ref.shape)} {ref.dtype}"), float("inf")
    fake, ref = fake.detach().cpu(), ref.detach().cpu()
    if fake.numel() == 0:
        return None, 0.0
    if not _floatish(fake):
        bad = int((fake != ref).sum())
        return (f"{bad} of {fake.numel()} elements differ" if bad else None), float(bad > 0)
    keep = torch.ones(fake.shape, dtype=torch.bool)
    if allocated and fake.dtype.is_floating_point:
        keep &= ~fake.isnan()
    if fake.dtype.is_floating_point:  # NaN in both: the same
        keep &= ~(fake.isnan() & ref.isnan())
    if rule.exact_cols is not None:
        width, cols = rule.exact_cols(named)
        if fake.dim() and fake.shape[-1] == width:
            a, b = _ordered_bits(fake[..., cols]), _ordered_bits(ref[..., cols])
            bad = int(((a != b) & keep[..., cols]).sum())
            if bad:
                return f"{bad} copied elements not bit-exact", float("inf")
    if rule.rel is not None and fake.dtype.is_floating_point:
        u = torch.finfo(fake.dtype).eps / 2
        a, b = fake.double(), ref.double()
        err = ((a - b).abs() / (u * (1 + b.abs()))).masked_fill(~keep | (a == b), 0)
        err = err.nan_to_num(nan=float("inf"))
        worst = float(err.max())
        return (f"error {worst:.3g} u exceeds {rule.rel:g} u" if worst > rule.rel else None), worst
    dist = (_ordered_bits(fake) - _ordered_bits(ref)).abs().masked_fill(~keep, 0)
    worst = float(dist.max())
    if worst > rule.ulps:
        bad = int((dist > rule.ulps).sum())
        return f"{bad} elements beyond {rule.ulps} ulp (worst {worst:g} ulp)", worst
    return None, worst


def _is_misread(exc: BaseException) -> bool:
    return type(exc).__name__ == "KernelMisread"


def _not_modelled(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) and str(exc).startswith("fake:")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


def _arch_sensitive(named: dict) -> bool:
    """Whether the call depends on the arch: fp8 data (e4m3fn vs fnuz per
    gfx; fp8 tensors, or an fp8 ``kv_cache_dtype`` over uint8 bytes).  Elsewhere
    the arch only picks among kernels that compute the same result (and the
    words of some messages)."""
    for value in named.values():
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor) and t.dtype in _FP8:
                return True
            if isinstance(t, str) and t.startswith("fp8"):
                return True
    return False


def _owner_arch(fn: Callable) -> str | None:
    """The arch of the fake object behind ``fn`` (a bound method, a callable
    fake, or a closure over one); None where there is none."""
    for obj in (getattr(fn, "__self__", None), fn,
                *(c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                  if c.cell_contents is not None)):
        arch = getattr(obj, "arch", None)
        if isinstance(arch, str):
            return arch
    return None


class _Wrapped:
    """A fake as the harness exports it: calls go through ``Harness.call``;
    equal to (and hashed as) the fake, so the fakes' own export checks still
    hold (``aiter.f == aiter.ops.mha.f``, the bound method of the fake);
    ``inspect.signature`` follows ``__wrapped__`` (schemas are inferred from it)."""

    def __init__(self, harness, kind, module, name, fn):
        self._harness, self._kind, self._module, self._name = harness, kind, module, name
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        fn = self.__wrapped__
        if getattr(Harness._local, "depth", 0) or getattr(Harness._local, "suspended", False):
            return fn(*args, **kwargs)
        return self._harness.call(self._kind, self._module, self._name, fn, args, kwargs)

    def __eq__(self, other):
        other = other.__wrapped__ if isinstance(other, _Wrapped) else other
        return self.__wrapped__ == other

    def __hash__(self):
        return hash(self.__wrapped__)


# --------------------------------------------------------------------------
# The harness.
# --------------------------------------------------------------------------


class Harness:
    """Wraps what ``AiterExport`` registers (``patch()`` / ``unpatch()``) and
    keeps the tally; ``report()`` is the JSON the plugin writes."""

    _local = threading.local()
    _current: "Harness | None" = None

    def __init__(self, reference: Reference):
        self.reference = reference
        self.fakes: dict[str, dict] = {}
        self.disagreements: list[dict] = []
        self._wrappers: dict = {}
        self._saved = None

    # --- state -------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def suspended(cls):
        """Register fakes without wrapping them (a stand-in reference's own)."""
        before = getattr(cls._local, "suspended", False)
        cls._local.suspended = True
        try:
            yield
        finally:
            cls._local.suspended = before

    @classmethod
    @contextlib.contextmanager
    def _nested(cls):
        cls._local.depth = getattr(cls._local, "depth", 0) + 1
        try:
            yield
        finally:
            cls._local.depth -= 1

    def _tally(self, name: str, key: str, worst: float | None = None) -> None:
        entry = self.fakes.setdefault(name, {
            "compared": 0, "agreed": 0, "disagreed": 0, "compared_other_arch": 0,
            "not_compared_arch": 0,
            "not_modelled": 0, "misread_refused": 0, "worst_error": 0.0})
        entry[key] += 1
        if worst is not None and worst != float("inf"):
            entry["worst_error"] = max(entry["worst_error"], worst)

    # --- patching AiterExport ---------------------------------------------

    def patch(self) -> "Harness":
        cls = AiterExport
        self._saved = (cls.register_guarded, cls.register_direct, cls.export_plain)
        guarded, direct, plain = self._saved
        harness = self

        def register_guarded(export, module, stub, impl, **kw):
            return guarded(export, module, stub, harness.wrap("op", module, stub.__name__, impl),
                           **kw)

        def register_direct(export, op_func, mutates_args):
            wrapped = harness.wrap("op", None, op_func.__name__, op_func)

            @functools.wraps(op_func)  # the schema is inferred from op_func's signature
            def direct_op(*args, **kwargs):
                return wrapped(*args, **kwargs)

            return direct(export, direct_op, mutates_args)

        def export_plain(export, module, name, fn):
            return plain(export, module, name, harness.wrap("plain", module, name, fn))

        cls.register_guarded, cls.register_direct, cls.export_plain = (
            register_guarded, register_direct, export_plain)
        Harness._current = self
        return self

    def unpatch(self) -> None:
        if self._saved is not None:
            (AiterExport.register_guarded, AiterExport.register_direct,
             AiterExport.export_plain) = self._saved
            self._saved = None
        if Harness._current is self:
            Harness._current = None

    def wrap(self, kind: str, module: str | None, name: str, fn: Callable) -> Callable:
        if getattr(Harness._local, "suspended", False):
            return fn
        if kind == "plain" and getattr(fn, "__name__", "") == "wrapper_custom":
            return fn  # the guard export over an op: the op itself is compared
        key = (kind, name, fn)
        if key not in self._wrappers:  # one wrapper per function, whatever module exports it
            self._wrappers[key] = _Wrapped(self, kind, module, name, fn)
        return self._wrappers[key]

    # --- one call ----------------------------------------------------------

    def call(self, kind, module, name, fn, args, kwargs):
        ref = self.reference
        arch = _owner_arch(fn)
        named = _bind(fn, args, kwargs)
        if ref.arch is not None and arch is not None and arch != ref.arch:
            if _arch_sensitive(named):
                self._tally(name, "not_compared_arch")
                with self._nested():
                    return fn(*args, **kwargs)
            self._tally(name, "compared_other_arch")
        other_arch = ref.arch is not None and arch is not None and arch != ref.arch
        memo: dict = {}
        ref_args = _clone(args, memo, ref.device)
        ref_kwargs = _clone(kwargs, memo, ref.device)
        fake_exc = result = None
        with self._nested():
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - compared, then re-raised
                fake_exc = exc
        if fake_exc is not None and _not_modelled(fake_exc):
            self._tally(name, "not_modelled")
            raise fake_exc
        real_fn = ref.lookup(kind, module, name)
        real_exc = real_result = None
        if real_fn is None:
            real_exc = AttributeError(f"{ref.name} has no {module or 'torch.ops.aiter'}.{name}")
        else:
            with self._nested(), ref.active():
                try:
                    real_result = real_fn(*ref_args, **ref_kwargs)
                except Exception as exc:  # noqa: BLE001 - a refusal is a result
                    real_exc = exc
        problem, worst = self._judge(name, fn, named, result, fake_exc, ref_args, ref_kwargs,
                                     real_result, real_exc, real_fn is None, other_arch)
        if problem == "misread":
            self._tally(name, "misread_refused")
        else:
            self._tally(name, "compared")
            self._tally(name, "disagreed" if problem else "agreed", worst)
            if problem:
                self._record(name, kind, module, named, problem, fake_exc, real_exc)
        if fake_exc is not None:
            raise fake_exc
        return result

    def _judge(self, name, fn, named, result, fake_exc, ref_args, ref_kwargs, real_result,
               real_exc, missing, other_arch=False):
        if missing:
            return f"AITER has no such function: {real_exc}", None
        if fake_exc is not None and _is_misread(fake_exc):
            if real_exc is None:
                return "misread", None  # expected: the kernel reads, the fake refuses
            return None, None
        if fake_exc is not None and real_exc is None:
            return (f"the fake refuses ({type(fake_exc).__name__}: {_first_line(fake_exc)}) "
                    "a call AITER accepts"), None
        if fake_exc is None and real_exc is not None:
            return (f"AITER refuses ({type(real_exc).__name__}: {_first_line(real_exc)}) "
                    "a call the fake accepts"), None
        if fake_exc is not None:
            if not isinstance(fake_exc, type(real_exc)):
                return (f"error class: the fake raises {type(fake_exc).__name__}, AITER "
                        f"{type(real_exc).__name__} ({_first_line(real_exc)})"), None
            if (not other_arch and str(fake_exc).strip()  # messages may name the arch
                    and str(fake_exc).strip() not in str(real_exc)):
                return (f"message: the fake says {_first_line(fake_exc)!r}, AITER "
                        f"{_first_line(real_exc)!r}"), None
            return None, None
        rule = RULES.get(name, Rule())
        worst = 0.0
        pairs = []
        ref_named = _bind(fn, ref_args, ref_kwargs)
        for key, fake_v in named.items():
            ref_tensors = dict(_tensors(ref_named.get(key), key))
            for path, t in _tensors(fake_v, key):
                pairs.append((path, t, ref_tensors.get(path), False))
        inputs = {t.untyped_storage().data_ptr() for _, t, _, _ in pairs}
        ref_out = dict(_tensors(real_result))
        for path, t in _tensors(result):
            if t.untyped_storage().data_ptr() in inputs:
                continue  # an argument returned: compared as the argument
            pairs.append((path, t, ref_out.get(path), True))
        for path, fake_t, ref_t, allocated in pairs:
            if ref_t is None:
                return f"{path}: AITER returns no tensor there", None
            problem, err = compare_tensor(fake_t, ref_t, rule, named, allocated)
            worst = max(worst, err)
            if problem:
                return f"{path}: {problem}", worst
        return None, worst

    def _record(self, name, kind, module, named, problem, fake_exc, real_exc):
        entry = self.fakes[name]
        if entry["disagreed"] > MAX_RECORDED:
            return
        self.disagreements.append({
            "fake": name,
            "function": f"{module}.{name}" if kind == "plain" else f"torch.ops.aiter.{name}",
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or None,
            "problem": problem,
            "fake_raised": None if fake_exc is None else
            f"{type(fake_exc).__name__}: {_first_line(fake_exc)}",
            "aiter_raised": None if real_exc is None else
            f"{type(real_exc).__name__}: {str(real_exc).strip()[:2000]}",
            "call": {k: _describe(v) for k, v in named.items()},
        })

    def report(self) -> dict:
        return {
            "reference": self.reference.name,
            "reference_version": getattr(self.reference, "version", None),
            "arch": self.reference.arch,
            "fakes": dict(sorted(self.fakes.items())),
            "disagreeing": sorted(n for n, e in self.fakes.items() if e["disagreed"]),
            "disagreements": self.disagreements,
        }


# --------------------------------------------------------------------------
# The pytest plugin.
# --------------------------------------------------------------------------


def _reference_from_env() -> Reference:
    spec = os.environ.get(REFERENCE_ENV, "")
    if not spec or spec == "aiter":
        return RealAiter()
    module, _, factory = spec.partition(":")
    return getattr(importlib.import_module(module), factory)()


def pytest_configure(config):
    path = os.environ.get(ENV)
    if not path:
        return
    import pytest

    try:
        reference = _reference_from_env()
    except Exception as exc:  # noqa: BLE001
        raise pytest.UsageError(f"conformance: the reference does not load "
                                f"({type(exc).__name__}: {exc})") from exc
    config._aiter_conformance = (Harness(reference).patch(), Path(path))


def pytest_unconfigure(config):
    state = getattr(config, "_aiter_conformance", None)
    if state is None:
        return
    harness, path = state
    harness.unpatch()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(harness.report(), indent=1) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    state = getattr(config, "_aiter_conformance", None)
    if state is None:
        return
    harness, path = state
    report = harness.report()
    compared = sum(e["compared"] for e in report["fakes"].values())
    terminalreporter.write_line(
        f"conformance vs {report['reference']}: {compared} calls compared over "
        f"{len(report['fakes'])} fakes; disagreeing: {', '.join(report['disagreeing']) or 'none'}"
        f" ({path})")


# aiter_export is the one registration path of the fakes; fail loudly if it changes.
assert all(hasattr(aiter_export.AiterExport, m)
           for m in ("register_guarded", "register_direct", "export_plain"))
