"""Fake of AITER's ``fused_qk_rope_concat_and_cache_mla``, as strict as its kernel.

Mirrors ROCm/aiter at e4048607 (``v0.1.20-46``, the newest readable snapshot).
The pinned AITER is v0.1.28.post1 (pins.env ``AITER_REF``; v0.1.26 before the
vLLM 0.34.0 port); neither tag is readable here, so every file:line below is at
e4048607 and was not re-checked at v0.1.28.post1 (the op's schema is re-checked
at layer build; tests/validate_rocm/test_conformance.py checks the constraints
cited here against that source, and this fake against the installed AITER on ROCm):

* export: ``aiter/ops/cache.py`` ``fused_qk_rope_concat_and_cache_mla`` (the
  stub, l.156-176), ``@compile_ops("module_cache", develop=True)``
  (``aiter/jit/core.py`` ``compile_ops``, l.1658) -> ``torch_compile_guard``
  (``aiter/jit/utils/torch_guard.py``): ``(*args, **kwargs)`` over
  ``torch.ops.aiter.fused_qk_rope_concat_and_cache_mla`` with the schema
  ``torch.library.infer_schema(stub, mutates_args="unknown")``;
* launcher: ``csrc/kernels/cache_kernels.cu``
  ``fused_qk_rope_concat_and_cache_mla`` (l.4212-4458): its ``AITER_CHECK``s,
  its dispatch (per-head / opt / general decode kernels, GQA prefill) and the
  strides it passes -- stride 0 (and 1) of q_nope / q_pe / q_out, stride 0 of
  kv_c / k_pe, strides 0 / 1 of kv_cache, **no stride of cos_cache /
  sin_cache** and no last-dim stride of any tensor;
* kernels: ``fuse_qk_rope_concat_and_cache_mla_kernel_opt`` (l.2207-2427),
  ``..._per_head_kernel_impl`` (l.1794), ``..._kernel_general_kernel``
  (l.2784): ``pos * (rot_dim / 2)`` into cos / sin (``reinterpret_cast`` to the
  kv_c dtype), RoPE in fp32, stores through ``opus::cast`` /
  ``scaled_cast(x, 1 / scale)``; ``slot < 0`` skips the token unless
  ``compute_all_q_rope`` (then q_out is still written, the cache is not);
  the per-head and opt kernels clamp ``pos`` into ``[0, max_position)``.

So this fake reads every input **from its data pointer with the kernel's
index arithmetic**: a ``[max_pos, R/2]`` view with row stride R is read as if
it were dense, exactly as the HIP kernel would.  It rejects what the launcher
rejects (the AITER_CHECK messages), an fp8 tensor that is not the target's
native e4m3 (gfx942: e4m3fnuz; gfx950: e4m3fn), which AITER's dtype
conversion refuses with ``AssertionError("Unsupported dtype: ...")``
(aiter/utility/dtypes.py l.51-57, reached from ``compile_ops``' develop path,
aiter/jit/core.py l.1940-1951, for every tensor argument: so does any dtype
outside AITER's ``AiterDtype`` enum, e.g. float64), and what the kernel would
silently misread:
int32 positions / slots (read as int64), non-fp32 scales (read as float),
cos / sin not in the kv_c dtype, a non-unit last stride.
fp8 stores saturate to the finite range (assumed for opus's hardware cvt).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiter_export import AiterExport

__all__ = ["MLA_OP", "AiterCheckError", "FakeMlaRopeOp", "KernelMisread", "install_mla_fakes"]

MLA_OP = "fused_qk_rope_concat_and_cache_mla"

NATIVE_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

# cache_kernels.cu, "Kernel Dispatch Logic".
_OPT_L, _OPT_R, _MAX_TOKENS_PER_HEAD, _MIN_SIZE_FOR_OPT = 512, 64, 256, 2048


class KernelMisread(RuntimeError):
    """The real kernel would not raise here but read the wrong memory."""


class AiterCheckError(RuntimeError):
    """What an ``AITER_CHECK`` failure raises (a RuntimeError on the host)."""


def _check(cond: bool, msg: str = "") -> None:
    if not cond:
        raise AiterCheckError(msg or "AITER_CHECK failed")


def fused_qk_rope_concat_and_cache_mla(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    kv_cache: Tensor,
    q_out: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor,
    q_scale: Tensor,
    positions: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    is_neox: bool,
    is_nope_first: bool,
    compute_all_q_rope: bool = False,
) -> None:
    """The stub of aiter/ops/cache.py, signature for signature (schema source)."""


def _flat(t: Tensor) -> Tensor:
    """The memory from ``t.data_ptr()`` to the end of its storage, 1-D dense:
    what a kernel indexing a raw pointer sees."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (n,), (1,))


def _store(x: Tensor, dtype: torch.dtype, inv_scale: float | None) -> Tensor:
    if inv_scale is not None:
        x = x * inv_scale
    if dtype in _FP8:
        fi = torch.finfo(dtype)
        x = x.clamp(fi.min, fi.max)
    return x.to(dtype)


class FakeMlaRopeOp:
    """The launcher + kernels in torch.  ``calls`` records each call's
    arguments (the tensors themselves) and the dispatch target."""

    def __init__(self, arch: str = "gfx942"):
        if arch not in NATIVE_FP8:
            raise ValueError(f"arch {arch!r}: one of {sorted(NATIVE_FP8)}")
        self.arch = arch
        self.calls: list[dict] = []

    def __call__(self, q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale,
                 q_scale, positions, cos_cache, sin_cache, is_neox, is_nope_first,
                 compute_all_q_rope=False):
        args = dict(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache,
                    q_out=q_out, slot_mapping=slot_mapping, k_scale=k_scale, q_scale=q_scale,
                    positions=positions, cos_cache=cos_cache, sin_cache=sin_cache,
                    is_neox=is_neox, is_nope_first=is_nope_first,
                    compute_all_q_rope=compute_all_q_rope)
        for name, value in args.items():  # torch_to_aiter_pybind, before the launcher
            if isinstance(value, Tensor) and value.dtype not in self._aiter_dtypes():
                raise AssertionError(f"Unsupported dtype: {value.dtype}")
        target = self._launch(**args)
        self.calls.append({**args, "target": target})

    # --- what the host code checks -----------------------------------------

    def _aiter_dtypes(self) -> set:
        """The torch dtypes of AITER's ``AiterDtype`` enum (csrc/include/aiter_enum.h
        l.34-50; aiter/utility/dtypes.py l.11-48): fp8 is the target's own."""
        optional = ("float8_e8m0fnu", "int4", "float4_e2m1fn_x2")
        return {NATIVE_FP8[self.arch], torch.float16, torch.bfloat16, torch.float32,
                torch.uint32, torch.int32, torch.int16, torch.int8, torch.uint8, torch.int64,
                torch.uint64, *(getattr(torch, n) for n in optional if hasattr(torch, n))}

    def _dtype_kind(self, dtype: torch.dtype, what: str) -> str:
        if dtype in (torch.float32, torch.float16, torch.bfloat16):
            return "auto"
        if dtype in _FP8:
            # aiter/utility/dtypes.py: the torch -> AITER dtype map holds one fp8,
            # the target's (``fp8 = get_dtype_fp8()``, l.11-27 and l.48), and
            # ``_aiter_dtype_id`` (l.51-57, called by the tensor conversion,
            # l.85 / l.115) raises for any other fp8 tensor.
            if dtype is not NATIVE_FP8[self.arch]:
                raise AssertionError(f"Unsupported dtype: {dtype}")
            return "fp8"
        raise AiterCheckError("kv cache data type is not supported")

    def _launch(self, q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale,
                q_scale, positions, cos_cache, sin_cache, is_neox, is_nope_first,
                compute_all_q_rope):
        # Read as int64* / float* / scalar_t* by the kernels: a wrong dtype is
        # garbage on the GPU; AITER checks none of it (KernelMisread, not an AITER_CHECK).
        for name, t in (("slot_mapping", slot_mapping), ("positions", positions)):
            if t.dtype is not torch.int64:
                raise KernelMisread(f"{name} is {t.dtype}; the kernel reads int64_t*")
        for name, t in (("k_scale", k_scale), ("q_scale", q_scale)):
            if t.dtype is not torch.float32 or t.numel() < 1:
                raise KernelMisread(f"{name} must be a float32 tensor (read as float*)")
        for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
            if t.dtype is not kv_c.dtype:
                raise KernelMisread(
                    f"{name} is {t.dtype}; the kernel reads it as the kv_c type {kv_c.dtype}")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("q_out", q_out),
                        ("kv_cache", kv_cache), ("cos_cache", cos_cache),
                        ("sin_cache", sin_cache)):
            if t.stride(-1) != 1:
                raise KernelMisread(f"{name} has last-dim stride {t.stride(-1)}; the kernel "
                                    "passes no last-dim stride")
        # One KV_T dispatches on kv_c.dtype and every input pointer is cast to it.
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("k_pe", k_pe)):
            if t.dtype is not kv_c.dtype:
                raise KernelMisread(f"{name} is {t.dtype}; the kernel reads it as the kv_c "
                                    f"type {kv_c.dtype}")

        num_tokens = slot_mapping.size(0)
        kv_lora_rank = kv_c.size(-1)
        pe_dim = k_pe.size(-1)
        block_size = kv_cache.size(1)
        num_heads = q_nope.size(1)
        qk_lora_rank = q_nope.size(-1)
        rot_dim = cos_cache.size(-1) * 2
        max_position = cos_cache.size(0)
        _check(q_nope.dim() == q_pe.dim())
        _check(q_nope.size(1) == q_pe.size(1))
        _check(q_out.size(2) == qk_lora_rank + pe_dim)
        _check(kv_lora_rank == qk_lora_rank, "kv_lora_rank and qk_lora_rank must be the same")
        cache_kind = self._dtype_kind(kv_cache.dtype, "kv_cache")
        q_kind = cache_kind if q_out.dtype == kv_cache.dtype else self._dtype_kind(
            q_out.dtype, "q_out")
        if cache_kind == "auto" and q_kind == "fp8":
            raise AiterCheckError("kv cache data type is auto and q_out data type is fp8, "
                                  "which is not supported")
        _check(kv_c.stride(-1) == 1, "kv_c stride(-1) must be equal to 1")
        _check(k_pe.stride(-1) == 1, "k_pe stride(-1) must be equal to 1")

        is_decode = kv_c.dim() == 2 and k_pe.dim() == 2
        single_kv_head = (kv_c.dim() == 3 and k_pe.dim() == 3 and kv_c.size(1) == 1
                          and k_pe.size(1) == 1 and kv_c.stride(1) == kv_c.size(2)
                          and k_pe.stride(1) == k_pe.size(2))
        prefill_gqa = kv_c.dim() == 3 and k_pe.dim() == 3 and kv_c.size(1) > 1
        hits_per_head = (is_nope_first and kv_lora_rank <= _OPT_L and block_size == 1
                         and rot_dim == _OPT_R and num_tokens < _MAX_TOKENS_PER_HEAD)
        hits_opt = (rot_dim == _OPT_R and kv_lora_rank * num_heads >= _MIN_SIZE_FOR_OPT
                    and kv_lora_rank == _OPT_L)
        if compute_all_q_rope:
            _check((is_decode or single_kv_head) and (hits_per_head or hits_opt),
                   "compute_all_q_rope is only supported by the per-head/opt MLA decode "
                   "kernels: decode path with kv_lora_rank=512 and rot_dim=64, and either "
                   "num_tokens<256 (per-head) or kv_lora_rank*num_heads>=2048 (opt). "
                   "Other dispatch targets (general decode / prefill) do not honor the flag.")
        if is_decode or single_kv_head:
            target = "per_head" if hits_per_head else "opt" if hits_opt else "general"
        elif prefill_gqa:
            raise NotImplementedError("GQA prefill form: not used by the series")
        else:
            raise AiterCheckError(
                f"Unsupported tensor dimensions: kv_c.dim()={kv_c.dim()}, "
                f"k_pe.dim()={k_pe.dim()}. Expected either decode (dim=2) or prefill "
                "with GQA (dim=3).")
        if target == "general":
            # cos_sin offset "positions[token_idx] * (pe_dim >> 1)", unclamped.
            clamp = False
        else:
            clamp = True
        self._compute(q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale,
                      q_scale, positions, cos_cache, sin_cache, is_neox, is_nope_first,
                      compute_all_q_rope, clamp, cache_kind, q_kind)
        return target

    # --- what the kernels compute ------------------------------------------

    def _compute(self, q_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale,
                 q_scale, positions, cos_cache, sin_cache, is_neox, is_nope_first,
                 compute_all_q_rope, clamp, cache_kind, q_kind):
        num_tokens, num_heads = slot_mapping.size(0), q_nope.size(1)
        lora, pe = kv_c.size(-1), k_pe.size(-1)
        half = pe // 2
        block_size = kv_cache.size(1)
        block_stride, entry_stride = kv_cache.stride(0), kv_cache.stride(1)
        slots, pos_all = _flat(slot_mapping), _flat(positions)
        cos_raw, sin_raw = _flat(cos_cache), _flat(sin_cache)
        qn, qp, qo = _flat(q_nope), _flat(q_pe), _flat(q_out)
        kc, kp, cache = _flat(kv_c), _flat(k_pe), _flat(kv_cache)
        inv_k = 1.0 / float(_flat(k_scale)[0])
        inv_q = 1.0 / float(_flat(q_scale)[0])
        nope_at, rope_at = (0, lora) if is_nope_first else (pe, 0)
        j_lora, j_half = torch.arange(lora), torch.arange(half)
        if is_neox:
            xi, yi = j_half, j_half + half
        else:
            xi, yi = 2 * j_half, 2 * j_half + 1

        def rope(src: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            x, y = src[..., xi].float(), src[..., yi].float()
            out = torch.empty(*src.shape[:-1], pe, dtype=torch.float32)
            out[..., xi] = x * cos - y * sin
            out[..., yi] = y * cos + x * sin
            return out

        for t in range(num_tokens):
            slot = int(slots[t])
            if slot < 0 and not compute_all_q_rope:
                continue
            pos = int(pos_all[t])
            if clamp:
                pos = min(max(pos, 0), cos_cache.size(0) - 1)
            # No stride: the kernel's "cos_cache + pos * (rot_dim / 2)".
            cos = cos_raw[pos * half + j_half].float()
            sin = sin_raw[pos * half + j_half].float()
            h = torch.arange(num_heads)[:, None]
            nope = qn[t * q_nope.stride(0) + h * q_nope.stride(1) + j_lora]
            qpe = qp[t * q_pe.stride(0) + h * q_pe.stride(1) + torch.arange(pe)]
            row = t * q_out.stride(0) + h * q_out.stride(1)
            qo[row + nope_at + j_lora] = _store(
                nope.float(), q_out.dtype, inv_q if q_kind == "fp8" else None)
            qo[row + rope_at + torch.arange(pe)] = _store(
                rope(qpe, cos, sin), q_out.dtype, inv_q if q_kind == "fp8" else None)
            if slot < 0:
                continue
            base = (slot // block_size) * block_stride + (slot % block_size) * entry_stride
            inv = inv_k if cache_kind == "fp8" else None
            cache[base + nope_at + j_lora] = _store(
                kc[t * kv_c.stride(0) + j_lora].float(), kv_cache.dtype, inv)
            kpe = kp[t * k_pe.stride(0) + torch.arange(pe)]
            cache[base + rope_at + torch.arange(pe)] = _store(
                rope(kpe, cos, sin), kv_cache.dtype, inv)


def install_mla_fakes(export: AiterExport, arch: str = "gfx942") -> FakeMlaRopeOp:
    """Register the op on ``export`` and export it from ``aiter.ops.cache``
    (and ``aiter``, which re-exports ``aiter.ops.cache``'s ops)."""
    op = FakeMlaRopeOp(arch)
    fn = export.register_guarded("aiter.ops.cache", fused_qk_rope_concat_and_cache_mla, op)
    export.export_plain("aiter", MLA_OP, fn)
    return op
