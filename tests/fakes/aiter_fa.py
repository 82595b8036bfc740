"""Fakes of the AITER functions vLLM's AITER FA backend calls, written from AITER's source.

Mirrors ROCm/aiter at e4048607 (``v0.1.20-46``, the newest readable snapshot).
The pinned AITER is v0.1.28.post1 (pins.env ``AITER_REF``; v0.1.26 before the
vLLM 0.34.0 port); neither tag is readable here, so every file:line below is at
e4048607 and was not re-checked at v0.1.28.post1
(tests/validate_rocm/test_conformance.py checks the constraints it cites against that source,
and these fakes against the installed AITER on ROCm).

``install_fa_fakes(export)`` registers, on an ``aiter_export.AiterExport``,
what ``rocm_aiter_fa.py`` reaches:

==============================================  =====================================
``aiter.flash_attn_varlen_func``                 plain Python (aiter/ops/mha.py), also
                                                 ``aiter.ops.mha.flash_attn_varlen_func``
``aiter.ops.mha.mha_varlen_fwd``,                ``compile_ops`` -> ``torch_compile_guard``:
``aiter.ops.mha.fmha_v3_varlen_fwd``             ``(*args, **kwargs)`` over
                                                 ``torch.ops.aiter.<name>``, schema from
                                                 ``generate_schema`` (MANUAL_SCHEMA_OPS)
``aiter.ops.triton.attention.unified_attention`` plain Python (the Triton wrapper); the
``.unified_attention``                           old path ``aiter.ops.triton.unified_attention``
                                                 is the same module (the package's
                                                 backward-compat map)
``torch.ops.aiter.paged_attention_v1``           ``direct_register_custom_op`` (schema
                                                 ``infer_schema``); the Python function is
                                                 ``aiter.paged_attention_v1``
==============================================  =====================================

Each fake checks what AITER's Python wrapper and its kernel launcher check, in
their order, with their exception types and messages (``TORCH_CHECK`` ->
``RuntimeError``, ``assert`` -> ``AssertionError``), then reads its inputs the
way the kernel reads them: the strides the kernel is given are honoured, those
it is not given are assumed (raw pointer arithmetic over the tensor's storage,
``torch.as_strided``), integers and scales are read as the C types the kernel
declares.  Where the real kernel would not raise but read the wrong memory (an
int64 block table for an ``int*``, a cache of another element size than the
kernel's ``cache_t``), the fake raises ``KernelMisread`` instead of computing
garbage.  Features vLLM's AITER FA never passes (dropout, bias, ALiBi, logits
soft-cap, sinks, paged varlen, fp8 queries, MTP > 1) raise
``NotImplementedError("fake: ...")``: a limit of the fake, not of AITER.

Results are float64 attention rounded once to the output dtype, on the
tensors' device (CPU tier, or CUDA on the GPU tier).  Rows a kernel does not
write (skipped sequences, rows past the launch grid) are left as they were;
tensors the kernel allocates with ``torch.empty`` start as NaN here.

Device arch: ``gfx950`` (MI355, fp8 = e4m3fn, 256 CUs) by default, or
``gfx942`` (MI300X, e4m3fnuz, 304 CUs): it decides the fp8 format
``paged_attention_v1`` decodes, the fp8 dtype ``unified_attention`` accepts,
its 2D/3D kernel choice and ``flash_attn_varlen_func``'s ASM-v3 / CK route
(both modelled; FlyDSL and the gfx1250 paths are not, they are not taken on
these archs).
"""

import itertools
import math

import torch
from aiter_export import AiterExport

__all__ = ["ARCHS", "FakeAiterFA", "KernelMisread", "install_fa_fakes"]

AITER_COMMIT = "e4048607"  # the source read; the pinned AITER_REF (v0.1.28.post1) is not readable
# aiter/utility/dtypes.py l.12-13 (fp8 per gfx) and a CU count per arch
# (aiter.ops.triton.utils.device_info.get_num_sms on MI300X / MI355X).
ARCHS = {
    "gfx942": {"fp8": torch.float8_e4m3fnuz, "num_cus": 304},
    "gfx950": {"fp8": torch.float8_e4m3fn, "num_cus": 256},
}
_NAN = float("nan")


class KernelMisread(RuntimeError):
    """The real kernel would not raise here but read the wrong memory."""


# --------------------------------------------------------------------------
# Shared float64 reference and raw reads.
# --------------------------------------------------------------------------


def _attend(q, k, v, scale, allowed):
    """q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv] (float64), allowed [n, m]
    -> (out [n, Hq, Dv], lse [Hq, n]); a row that sees no key: out 0, lse -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse


def _window_mask(n, m, left, right, device):
    """Bottom-right aligned: query i sees key j iff
    i + m - n - left <= j <= i + m - n + right (a negative bound is open)."""
    d = (torch.arange(m, device=device)[None, :] - torch.arange(n, device=device)[:, None]
         - (m - n))
    allowed = torch.ones(n, m, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= d >= -left
    if right >= 0:
        allowed &= d <= right
    return allowed


def _flat(t, dtype=None):
    """Everything from t's data pointer to the end of its storage, as a 1-D
    tensor of ``dtype`` (same element size): what a kernel can index."""
    base = t if dtype is None else t.view(dtype)
    n = t.untyped_storage().nbytes() // base.element_size() - base.storage_offset()
    return torch.as_strided(base, (n,), (1,), base.storage_offset())


def _read(t, size, stride, offset=0):
    """``size`` elements at ``t.data_ptr() + offset`` with ``stride`` (elements)."""
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


def _need_dtype(name, t, dtype, kernel):
    if t.dtype != dtype:
        raise KernelMisread(f"{kernel} reads {name} as {dtype} (got {t.dtype})")


def _same_device(name, t, device):
    if t.device != device:  # CHECK_DEVICE / a pointer into another device
        raise RuntimeError(f"{name} must be on CUDA (fake: on q's device {device})")


def _not_modelled(what):
    raise NotImplementedError(f"fake: {what} is not modelled (vLLM's AITER FA does not pass it)")


# --------------------------------------------------------------------------
# Stubs: AITER's Python signatures, from which the op schemas are generated.
# --------------------------------------------------------------------------


def mha_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    sink_size: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    sink_ptr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """aiter/ops/mha.py l.922-958 (e4048607): the ``compile_ops`` stub."""


def fmha_v3_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    how_v3_bf16_cvt: int,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """aiter/ops/mha.py l.1023-1058 (e4048607): the ``compile_ops`` stub."""


class FakeAiterFA:
    """The fakes, bound to one device arch, recording the calls tests assert on:
    ``varlen_calls`` (flash_attn_varlen_func: lengths, causal, window, route),
    ``unified_calls``
    (unified_attention), ``decode_calls`` (paged_attention_v1)."""

    def __init__(self, arch: str = "gfx950"):
        if arch not in ARCHS:
            raise ValueError(f"fake: arch {arch!r} not modelled; one of {sorted(ARCHS)}")
        self.arch = arch
        self.fp8 = ARCHS[arch]["fp8"]
        self.num_cus = ARCHS[arch]["num_cus"]
        self.varlen_calls: list[dict] = []
        self.unified_calls: list[dict] = []
        self.decode_calls: list[dict] = []

    # ----------------------------------------------------------------------
    # flash_attn_varlen_func -> mha_varlen_fwd / fmha_v3_varlen_fwd
    # ----------------------------------------------------------------------

    def flash_attn_varlen_func(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        min_seqlen_q=0, dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0,
        causal=False, window_size=(-1, -1, 0), bias=None, alibi_slopes=None,
        deterministic=False, return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1,
        block_table=None, out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None,
        sink_ptr=None,
    ):
        """``aiter.flash_attn_varlen_func``: aiter/ops/mha.py
        ``flash_attn_varlen_func`` l.3446-3675 -> ``FlashAttnVarlenFunc.forward``
        l.3243-3341 -> ``_flash_attn_varlen_forward`` l.2769-3046 (e4048607).

        On gfx942/gfx950 (no FlyDSL, no gfx1250 ASM): softmax_scale defaults to
        D**-0.5; q/k (v) are zero-padded to a head size multiple of 8; sink_ptr
        must be on q's device with nhead_q entries (then cast to fp32); a window
        bound >= max_seqlen_k is dropped (-1); q/k/v whose last stride is not 1
        are made contiguous (``maybe_contiguous``, l.1707), others keep their
        row and head strides; ``can_impl_fmha_v3_fwd`` (bf16, head size 128,
        no SWA/ALiBi/bias/dropout/soft-cap, nhead_q % nhead_k == 0) picks
        ``fmha_v3_varlen_fwd`` (ASM, which ignores min_seqlen_q), everything else
        ``mha_varlen_fwd`` (CK, which skips sequences of at most min_seqlen_q
        queries): fp16, sliding window, head size != 128, ALiBi, soft-cap.
        Returns ``out[..., :Dv]`` and, with return_lse, the LSE [Hq, total_q]."""
        if block_table is not None and (cu_seqlens_q_padded is not None
                                        or cu_seqlens_k_padded is not None):
            raise NotImplementedError(
                "Paged/Split-KV attention (using block_table) does not currently support "
                "physical sequence padding (cu_seqlens_*_padded).")
        call = {
            "causal": causal, "return_lse": return_lse, "window": window_size[0],
            "min_seqlen_q": min_seqlen_q,
            "q_lens": [b - a for a, b in itertools.pairwise(cu_seqlens_q.tolist())],
            "k_lens": (None if cu_seqlens_k is None else
                       [b - a for a, b in itertools.pairwise(cu_seqlens_k.tolist())]),
        }
        self.varlen_calls.append(call)
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_size_q_og, head_size_v_og = q.size(-1), v.size(-1)
        if head_size_q_og % 8 != 0:
            q = torch.nn.functional.pad(q, [0, 8 - head_size_q_og % 8])
            k = torch.nn.functional.pad(k, [0, 8 - head_size_q_og % 8])
        if head_size_v_og % 8 != 0:
            v = torch.nn.functional.pad(v, [0, 8 - head_size_v_og % 8])
        # _flash_attn_varlen_forward
        _, nhead_q, hdim_q = q.shape
        nhead_k, hdim_v = v.shape[-2], v.shape[-1]
        if sink_ptr is not None:
            assert sink_ptr.device == q.device, "sink_ptr must be on the same device as q"
            assert sink_ptr.shape[0] == nhead_q, "sink_ptr has incorrect shape"
            sink_ptr = sink_ptr.to(torch.float32)
        left = -1 if window_size[0] >= max_seqlen_k else window_size[0]
        right = -1 if window_size[1] >= max_seqlen_k else window_size[1]
        sink_size = window_size[2] if len(window_size) > 2 else 0
        sink_size = 0 if sink_size >= max_seqlen_k else sink_size
        swa = left > 0 or right > 0
        if q.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            _not_modelled("an fp8 query (fmha v3 fp8)")
        if hdim_q != hdim_v:
            _not_modelled("head_size_q != head_size_v (the OPUS / hd192 paths)")
        v3 = (alibi_slopes is None and bias is None and dropout_p == 0.0 and hdim_q == 128
              and nhead_q % nhead_k == 0 and not swa and q.dtype == torch.bfloat16
              and logits_soft_cap == 0.0)
        q, k, v = [x.contiguous() if x.stride(-1) != 1 else x for x in (q, k, v)]
        call["route"] = "fmha_v3_varlen_fwd" if v3 else "mha_varlen_fwd"
        if v3:
            out, lse, _, _ = self._mha_v3_export(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                min_seqlen_q, dropout_p, softmax_scale, logits_soft_cap, False, causal, left,
                right, return_lse, return_attn_probs and dropout_p > 0, how_v3_bf16_cvt, out,
                block_table, bias, alibi_slopes, None, None, None, None, cu_seqlens_q_padded,
                cu_seqlens_k_padded)
        else:
            out, lse, _, _ = self._mha_varlen_export(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                min_seqlen_q, dropout_p, softmax_scale, logits_soft_cap, False, causal, left,
                right, sink_size, return_lse, return_attn_probs and dropout_p > 0, out=out,
                block_table=block_table, bias=bias, alibi_slopes=alibi_slopes,
                cu_seqlens_q_padded=cu_seqlens_q_padded,
                cu_seqlens_k_padded=cu_seqlens_k_padded, sink_ptr=sink_ptr)
        out = out[..., :head_size_v_og]
        return (out, lse) if return_lse else out

    def _varlen_gen_func(self, q, out, block_table):
        """``cmdGenFunc_mha_varlen_fwd`` (aiter/ops/mha.py l.728-856), which
        compile_ops calls before the kernel to name the module to load."""
        if block_table is not None:
            return
        if q.dtype == torch.float8_e4m3fn or q.dtype == torch.float8_e4m3fnuz:
            if out is not None and out.dtype != torch.bfloat16:
                raise NotImplementedError("Unsupported output dtype for FP8 MHA")
        elif q.dtype not in (torch.float16, torch.bfloat16):
            raise NotImplementedError("Unsupported dtype for MHA")

    def mha_varlen_fwd(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q,
        dropout_p, softmax_scale, logits_soft_cap, zero_tensors, is_causal, window_size_left,
        window_size_right, sink_size, return_softmax_lse, return_dropout_randval, out=None,
        block_table=None, bias=None, alibi_slopes=None, q_descale=None, k_descale=None,
        v_descale=None, gen=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None,
        sink_ptr=None,
    ):
        """``torch.ops.aiter.mha_varlen_fwd``: the CK group-mode forward,
        csrc/py_itfs_ck/mha_varlen_fwd_kernels.cu ``mha_varlen_fwd`` l.358-680
        and ``get_ck_fmha_varlen_fwd_args`` l.13-205 (e4048607); the kernel's
        sequence skip is ``kSkipMinSeqlenQ`` in composable_kernel
        include/ck_tile/ops/fmha/kernel/fmha_fwd_kernel.hpp (``seqlen_q <=
        min_seqlen_q`` returns; the variant is chosen by ``min_seqlen_q != 0``,
        csrc/cpp_itfs/mha_fwd.cu l.288).

        Checks: fp16/bf16 (fp8) q, k and v of q's dtype, int32 contiguous
        cu_seqlens (``CHECK_CONTIGUOUS``, csrc/include/mha_common.h l.17), last strides 1, head sizes <= 256 and multiples of 8,
        nhead_q % nhead_k == 0, batch >= 1, q/k/v shapes (total, heads, D),
        out of q's dtype, shape and last stride 1.  Reads q/k/v/out with their
        row and head strides (``stride(0)``, ``stride(1)``).  Sequence b covers
        q rows cu_seqlens_q[b]..[b+1] and k rows cu_seqlens_k[b]..[b+1]; the
        grid covers max_seqlen_q rows of each; with min_seqlen_q != 0 a
        sequence of at most min_seqlen_q queries is skipped (nothing written);
        max_seqlen_k == 0 zeroes out and fills the LSE with +inf."""
        self._varlen_gen_func(q, out, block_table)
        return self._varlen_kernel(
            "mha_varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, min_seqlen_q, dropout_p, softmax_scale, logits_soft_cap,
            zero_tensors, is_causal, window_size_left, window_size_right, sink_size,
            return_softmax_lse, return_dropout_randval, out, block_table, bias, alibi_slopes,
            q_descale, k_descale, v_descale, cu_seqlens_q_padded, cu_seqlens_k_padded,
            sink_ptr)

    def fmha_v3_varlen_fwd(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q,
        dropout_p, softmax_scale, logits_soft_cap, zero_tensors, is_causal, window_size_left,
        window_size_right, return_softmax_lse, return_dropout_randval, how_v3_bf16_cvt,
        out=None, block_table=None, bias=None, alibi_slopes=None, q_descale=None,
        k_descale=None, v_descale=None, gen=None, cu_seqlens_q_padded=None,
        cu_seqlens_k_padded=None,
    ):
        """``torch.ops.aiter.fmha_v3_varlen_fwd``: the ASM v3 forward,
        csrc/py_itfs_cu/asm_mha_varlen_fwd.cu ``fmha_v3_varlen_fwd`` l.242-502
        (e4048607): the same checks as ``mha_varlen_fwd`` without sinks;
        cu_seqlens_k is required.  No CK fallback: the module is built
        ``-DFAV3_ON=1 -DENABLE_CK=0`` (aiter/jit/optCompilerConfig.json
        ``module_fmha_v3_varlen_fwd``), so ``aiter::mha_fwd`` runs only
        ``fmha_fwd_v3`` (csrc/cpp_itfs/mha_fwd.cu l.367-382) and a case it has no
        kernel for (head sizes other than 128/128, 192/128, 256/256; not bf16;
        bias, dropout; a mask other than none or causal without a left window,
        ``get_cfg_mask_type`` l.12-24) returns -1, which raises
        ``RuntimeError("invalid argument for fmha_v3_varlen_fwd")``
        (asm_mha_varlen_fwd.cu l.493-494).  ``min_seqlen_q`` is passed on
        (l.232) but ``fmha_fwd_v3`` (mha_fwd.cu l.208-286) never reads it: only
        CK's ``fmha_fwd_ck`` skips short sequences (l.288, l.356), so on this
        route every sequence is computed.  The ASM kernel table (which head
        size / mask / ``how_v3_bf16_cvt`` has a kernel on which arch,
        asm_fmha_v3_fwd_configs.hpp) is assumed to cover every case above."""
        return self._varlen_kernel(
            "fmha_v3_varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, min_seqlen_q, dropout_p, softmax_scale, logits_soft_cap,
            zero_tensors, is_causal, window_size_left, window_size_right, 0,
            return_softmax_lse, return_dropout_randval, out, block_table, bias, alibi_slopes,
            q_descale, k_descale, v_descale, cu_seqlens_q_padded, cu_seqlens_k_padded, None)

    def _varlen_kernel(
        self, op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        min_seqlen_q, p_dropout, softmax_scale, logits_soft_cap, zero_tensors, is_causal,
        window_size_left, window_size_right, sink_size, return_softmax_lse,
        return_dropout_randval, out, block_table, bias, alibi_slopes, q_descale, k_descale,
        v_descale, cu_seqlens_q_padded, cu_seqlens_k_padded, sink_ptr,
    ):
        q_dtype = q.dtype
        is_fp8 = q_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        if not (q_dtype in (torch.float16, torch.bfloat16) or is_fp8):
            raise RuntimeError("FlashAttention only support fp16, bf16 and fp8_e4m3 data type")
        if k.dtype != q_dtype:
            raise RuntimeError("query and key must have the same dtype")
        if v.dtype != q_dtype:
            raise RuntimeError("query and value must have the same dtype")
        if is_fp8 and out is not None and out.dtype != torch.bfloat16:
            raise RuntimeError("For FP8 input, output must have dtype BF16 for now")
        if not ((q_descale is None) == (k_descale is None) == (v_descale is None)):
            raise RuntimeError(
                "q_descale, k_descale, v_descale must be all provided or all not provided")
        if cu_seqlens_q.dtype != torch.int32:
            raise RuntimeError("cu_seqlens_q must have dtype int32")
        if cu_seqlens_k is not None and cu_seqlens_k.dtype != torch.int32:
            raise RuntimeError("cu_seqlens_k must have dtype int32")
        for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k)):
            if t is not None:
                _same_device(name, t, q.device)
        if block_table is not None:
            _not_modelled("paged varlen (block_table)")
        for t in (q, k, v):
            if t.stride(-1) != 1:
                raise RuntimeError("Input tensor must have contiguous last dimension")
        if not cu_seqlens_q.is_contiguous():
            raise RuntimeError("cu_seqlens_q must be contiguous")
        if cu_seqlens_k is not None and not cu_seqlens_k.is_contiguous():
            raise RuntimeError("cu_seqlens_k must be contiguous")
        batch_size = cu_seqlens_q.numel() - 1
        num_heads, head_size_q, head_size_v = q.size(1), q.size(-1), v.size(-1)
        num_heads_k = k.size(-2)
        if max_seqlen_q == 1 and alibi_slopes is None:
            is_causal = False  # causal == non-causal for one query row
        if bias is not None and alibi_slopes is not None:
            raise RuntimeError("cannot apply bias and alibi at the same time")
        total_q = q.size(0)
        if batch_size <= 0:
            raise RuntimeError("batch size must be postive")
        if head_size_q > 256 or head_size_v > 256:
            raise RuntimeError("CK only supports head dimension at most 256")
        if head_size_q % 8 != 0 or head_size_v % 8 != 0:
            raise RuntimeError("query, key, value, and out_ must have a head_size that is a "
                               "multiple of 8")
        if num_heads % num_heads_k != 0:
            raise RuntimeError("Number of heads in key/value must divide number of heads in "
                               "query")
        left = -1 if window_size_left >= max_seqlen_k else window_size_left
        right = -1 if window_size_right >= max_seqlen_k else window_size_right
        if is_causal:
            right = 0
        if q.shape != (total_q, num_heads, head_size_q):
            raise RuntimeError("q must have shape (total_q, num_heads, head_size_q)")
        total_k = k.size(0)
        if k.shape != (total_k, num_heads_k, head_size_q):
            raise RuntimeError("k must have shape (total_k, num_heads_k, head_size_q)")
        if v.shape != (total_k, num_heads_k, head_size_v):
            raise RuntimeError("v must have shape (total_k, num_heads_k, head_size_v)")
        if cu_seqlens_k is not None and cu_seqlens_k.shape != (batch_size + 1,):
            raise RuntimeError("cu_seqlens_k.value() must have shape (batch_size + 1)")
        out_type = torch.bfloat16 if is_fp8 else q_dtype
        if out is not None:
            if out.dtype != out_type:
                raise RuntimeError(
                    "For FP16/BF16 input, output must have the same dtype as inputs. For FP8 "
                    "input, output must have dtype BF16")
            _same_device("out", out, q.device)
            if out.stride(-1) != 1:
                raise RuntimeError("Output tensor must have contiguous last dimension")
            if out.shape != (total_q, num_heads, head_size_v):
                raise RuntimeError("out must have shape (total_q, num_heads, head_size_v)")
        else:
            out = torch.full((total_q, num_heads, head_size_v), _NAN, dtype=out_type,
                             device=q.device)
        if return_dropout_randval and not p_dropout > 0.0:
            raise RuntimeError("return_dropout_randval require p_dropout > 0")
        if return_softmax_lse:
            lse = torch.full((num_heads, total_q), _NAN, dtype=torch.float32, device=q.device)
        else:
            lse = torch.empty(0, dtype=torch.float32, device=q.device)
        if zero_tensors:
            out.zero_()
            lse.fill_(float("-inf"))
        extras = {"dropout": p_dropout > 0, "bias": bias is not None,
                  "ALiBi": alibi_slopes is not None, "logits soft-cap": logits_soft_cap > 0,
                  "sinks": sink_size > 0 or sink_ptr is not None,
                  "qkv descales": q_descale is not None,
                  "padded cu_seqlens": cu_seqlens_q_padded is not None
                  or cu_seqlens_k_padded is not None}
        for what, present in extras.items():
            if present:
                _not_modelled(what)
        p = torch.empty(0, dtype=q_dtype, device=q.device)
        rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
        if max_seqlen_k <= 0:
            out.zero_()
            lse.fill_(float("inf"))
            return out, lse, p, rng_state
        if cu_seqlens_k is None:
            raise RuntimeError("cu_seqlens_k must be provided if paged_KV is false")
        if op == "fmha_v3_varlen_fwd":
            # fmha_fwd_v3 (csrc/cpp_itfs/mha_fwd.cu l.208-239) or nothing: ENABLE_CK=0.
            causal_mask = is_causal and left == -1
            no_mask = not is_causal and left == -1 and right == -1
            if ((head_size_q, head_size_v) not in ((128, 128), (192, 128), (256, 256))
                    or q_dtype != torch.bfloat16 or not (causal_mask or no_mask)):
                raise RuntimeError("invalid argument for fmha_v3_varlen_fwd")
            min_seqlen_q = 0  # passed on, never read by fmha_fwd_v3 (l.208-286)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for name, cu, total in (("cu_seqlens_q", cq, total_q), ("cu_seqlens_k", ck, total_k)):
            if any(b < a for a, b in itertools.pairwise(cu)) or cu[0] < 0 or cu[-1] > total:
                raise KernelMisread(f"{op}: {name} {cu} is not a cumulative length within "
                                    f"the {total} rows it indexes")
        for b in range(batch_size):
            len_q, len_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if len_q <= 0 or (min_seqlen_q != 0 and len_q <= min_seqlen_q):
                continue  # kSkipMinSeqlenQ / no q block: nothing written
            rows = min(len_q, max_seqlen_q)  # the grid's q blocks end there
            allowed = (_window_mask(len_q, len_k, left, right, q.device)
                       if is_causal or left != -1 or right != -1
                       else torch.ones(len_q, len_k, dtype=torch.bool, device=q.device))
            o, l_ = _attend(q[cq[b]:cq[b] + rows].double(), k[ck[b]:ck[b + 1]].double(),
                            v[ck[b]:ck[b + 1]].double(), softmax_scale, allowed[:rows])
            out[cq[b]:cq[b] + rows] = o.to(out.dtype)
            if return_softmax_lse:
                lse[:, cq[b]:cq[b] + rows] = l_.float()
        return out, lse, p, rng_state

    # ----------------------------------------------------------------------
    # unified_attention (Triton)
    # ----------------------------------------------------------------------

    def unified_attention(
        self, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
        softmax_scale, causal, window_size, block_table, softcap, q_descale, k_descale,
        v_descale, q_scales=None, alibi_slopes=None, output_scale=None, qq_bias=None,
        sinks=None, shuffled_kv_cache=False, skip_reduce=False,
    ):
        """``aiter.ops.triton.attention.unified_attention.unified_attention``
        l.307-748 and ``kernel_unified_attention_2d`` / ``_3d``
        (aiter/ops/triton/_triton_kernels/attention/unified_attention.py
        l.56-438 / l.441-, e4048607).

        Asserts causal; sinks need nhead_q entries; a uint8 query is nvfp4 and
        needs e4m3 q_scales.  k/v are [num_blocks, block_size, num_kv_heads, D]
        read with all four strides; q and out with their row and head strides
        (last stride assumed 1); block_table with its row stride (entries
        assumed contiguous); seqused_k and cu_seqlens_q as contiguous arrays of
        their own dtype; q/k/v descales by their first element (k and v
        dequantize only when both are given).  ``max_seqlen_q == 1`` is the
        all-decode mode: sequence b is query row b, cu_seqlens_q is not read.
        Sequence b's query i (of n) at position seq_len - n + i sees keys
        j <= that position, and with window_size[0] >= 0 only those within
        window_size[0] of it (SLIDING_WINDOW = 1 + window_size[0]);
        window_size[1] is not read.  The cache is cast to q's dtype before the
        dot.  The 3D (split-K) kernel, used when no window is set,
        max_seqlen_k > 512 and the 2D grid fits 4 programs per CU, asserts an
        fp16/bf16/e4m3 cache (e4m3 = the arch's fp8); the 2D kernel reads any
        float cache the pointer type says.  A uint8 cache is nvfp4 for the 3D
        assert and integers for the 2D load: the fake refuses it on both."""
        assert causal, "Only causal attention is supported"
        if alibi_slopes is not None or qq_bias is not None or output_scale is not None:
            _not_modelled("ALiBi / qq_bias / output_scale")
        if softcap > 0:
            _not_modelled("softcap")
        if shuffled_kv_cache:
            _not_modelled("the shuffled KV cache layout")
        num_tokens, num_query_heads, _ = q.shape
        if sinks is not None:
            assert sinks.shape[0] == num_query_heads, "Sinks must be num_query_heads size"
            _not_modelled("sinks")
        if q.dtype == torch.uint8:
            assert q_scales is not None and q_scales.dtype == self.fp8
            _not_modelled("an nvfp4 query")
        _, block_size, num_kv_heads, _ = k.shape
        num_seqs = len(seqused_k)
        num_queries_per_kv = num_query_heads // num_kv_heads
        block_m = 16 if num_queries_per_kv <= 16 else 1 << (num_queries_per_kv - 1).bit_length()
        block_q = block_m // num_queries_per_kv
        assert block_q >= 1
        all_decode = int(max_seqlen_q) == 1
        total_num_q_blocks = num_seqs if all_decode else num_tokens // block_q + num_seqs
        sliding_window = 1 + window_size[0]
        use_2d = (sliding_window > 0 or max_seqlen_k <= 512
                  or total_num_q_blocks * num_kv_heads > self.num_cus * 4)
        kv_ok = (torch.float16, torch.bfloat16, self.fp8)
        if not use_2d:
            assert k.dtype in kv_ok, (
                f"kv_cache_dtype only supports F16 ({torch.float16}) BF16 ({torch.bfloat16}), "
                f"FP8 ({self.fp8}) in arch = {self.arch}")
        if k.dtype == torch.uint8:
            raise KernelMisread("unified_attention: a uint8 cache is nvfp4 (gfx1250, shuffled) "
                                "for the wrapper and integers for the 2D kernel's load")
        self.unified_calls.append({"path": "2d" if use_2d else "3d",
                                   "max_seqlen_q": max_seqlen_q,
                                   "seq_lens": seqused_k.tolist()})
        device = q.device
        seq_lens = _read(seqused_k, (num_seqs,), (1,)).tolist()
        starts = (list(range(num_seqs + 1)) if all_decode
                  else _read(cu_seqlens_q, (num_seqs + 1,), (1,)).tolist())
        q_raw = _read(q, q.shape, (q.stride(0), q.stride(1), 1))
        out_raw = _read(out, out.shape, (out.stride(0), out.stride(1), 1))
        qk_scale = softmax_scale
        if q_descale is not None:
            qk_scale *= float(_read(q_descale, (1,), (1,)))
        k_scale = v_scale = 1.0
        if k_descale is not None and v_descale is not None:
            k_scale = float(_read(k_descale, (1,), (1,)))
            v_scale = float(_read(v_descale, (1,), (1,)))
        for b in range(num_seqs):
            n = 1 if all_decode else starts[b + 1] - starts[b]
            if n <= 0:
                continue
            seq_len = seq_lens[b]
            row = _read(block_table, (max(1, math.ceil(seq_len / block_size)),),
                        (1,), b * block_table.stride(0)).long()
            pos = torch.arange(seq_len, device=device)
            kb = k[row[pos // block_size], pos % block_size].to(q.dtype).double() * k_scale
            vb = v[row[pos // block_size], pos % block_size].to(q.dtype).double()
            allowed = _window_mask(n, seq_len, window_size[0], 0, device)
            o, _ = _attend(q_raw[starts[b]:starts[b] + n].double(), kb, vb, qk_scale, allowed)
            out_raw[starts[b]:starts[b] + n] = (o * v_scale).to(out.dtype)
        return out

    # ----------------------------------------------------------------------
    # paged_attention_v1 (HIP, ll4mi)
    # ----------------------------------------------------------------------

    def paged_attention_v1(
        self, out, workspace_buffer, query, key_cache, value_cache, scale, block_tables,
        cu_query_lens, context_lens, max_context_len, alibi_slopes, kv_cache_dtype,
        kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale=None,
        partition_size=256, mtp=1, sliding_window=0,
    ):
        """``torch.ops.aiter.paged_attention_v1``: aiter/ops/attention.py
        ``paged_attention_v1`` l.674-725 (registered l.721) ->
        csrc/cpp_itfs/pa/pa_v1.py ``paged_attention_v1`` l.111-300 and
        ``validate_paged_attention_v1_workspace`` l.58-108 -> pa_v1.cpp.jinja
        -> csrc/cpp_itfs/pa/pa_v1.cuh ``paged_attention_ll4mi_QKV_mfma16_kernel``
        l.39-88 -> pa_kernels.cuh ``_paged_attention_kernel`` (e4048607).

        Host checks: fp16/bf16 query and out; kv_cache_dtype "auto", "fp8" or
        "fp8_e4m3" only; block_tables 2-D with at least
        ceil(max_context_len / block_size) columns, one row per context_lens
        entry; workspace large enough.  The kernel gets only these strides:
        query.stride(0) (heads assumed dense), key_cache's block / head / token
        strides, used for value_cache too (head elements assumed dense); out is
        written dense [query row, heads, D]; a block-table row starts at
        b * block_tables.size(1); context_lens, block_tables and cu_query_lens
        are int*, k_scale/v_scale float*.  Sequence b reads query row
        cu_query_lens[b] and cu_query_lens[b + 1] (one past the slice vLLM
        passes); a sequence with more than one query token is skipped.  The
        cache bytes are query-dtype elements ("auto") or e4m3 bytes decoded as
        the arch's fp8 (fnuz on gfx942, fn on gfx950), whatever the tensor's
        dtype, the logits scaled by k_scale and the output by v_scale.  With
        sliding_window > 0 only the last sliding_window tokens are seen.
        Compile-time limits (static_asserts / dropped elements): 4 warps of
        64, so head_size must be a multiple of 64 (VHELOOP = D / 16 / 4) and
        block_size <= 32 (16-bit cache) or 64 (fp8); the kernel's partition is
        256 tokens (T_PAR_SIZE), so partition_size must be 256."""
        if kv_cache_dtype == "auto":
            if query.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"Unsupported data type: {query.dtype}")
            cache_t = query.dtype
        elif kv_cache_dtype in ("fp8", "fp8_e4m3"):
            if query.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"Unsupported data type: {query.dtype}")
            cache_t = torch.uint8
        else:
            raise ValueError(f"Unsupported kv_cache_dtype: {kv_cache_dtype}")
        if out.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"Unsupported data type: {out.dtype}")
        hnd = kv_cache_layout == "HND"
        num_kv_heads = key_cache.size(1) if hnd else key_cache.size(2)
        num_seqs = block_tables.size(0)
        num_heads, head_size = query.size(1), query.size(2)
        q_stride = query.stride(0)
        block_size = key_cache.size(2) if hnd else key_cache.size(1)
        self._validate_workspace(workspace_buffer, query, block_tables, context_lens,
                                 block_size, max_context_len, partition_size, mtp)
        max_num_blocks_per_seq = block_tables.size(1)
        kv_block_stride = key_cache.stride(0)
        kv_head_stride = key_cache.stride(1) if hnd else key_cache.stride(2)
        kv_seq_stride = key_cache.stride(2) if hnd else key_cache.stride(1)
        if num_heads % num_kv_heads != 0:  # assert() in the launcher
            raise AssertionError("num_heads % num_kv_heads == 0")
        gqa_ratio = num_heads // num_kv_heads
        max_num_partitions = math.ceil(max_context_len / partition_size)
        # Compile-time limits of the ll4mi kernel (pa_kernels.cuh).
        if head_size % 64 != 0:
            raise RuntimeError(f"paged_attention_v1: the ll4mi kernel covers head_size in "
                               f"steps of 64 (VHELOOP = HEAD_SIZE / 16 / NWARPS); got "
                               f"{head_size}")
        if block_size > (64 if cache_t == torch.uint8 else 32):
            raise RuntimeError(f"paged_attention_v1: static_assert(BLOCK_SIZE <= "
                               f"k_thread_per_block) fails for block_size {block_size}")
        if gqa_ratio > 16 and gqa_ratio % math.ceil(gqa_ratio / 16) != 0:
            raise RuntimeError(f"paged_attention_v1: GQA ratio {gqa_ratio} does not split "
                               "into equal loops of <= 16 heads")
        if partition_size != 256:
            raise KernelMisread("paged_attention_v1: the kernel's partition is 256 tokens "
                                f"(T_PAR_SIZE); partition_size {partition_size} sizes the "
                                "grid for another")
        if alibi_slopes is not None or logits_soft_cap > 0 or fp8_out_scale is not None:
            _not_modelled("ALiBi / logits soft-cap / fp8 output")
        if mtp != 1:
            _not_modelled("mtp > 1")
        device = query.device
        for name, t in (("out", out), ("key_cache", key_cache), ("value_cache", value_cache),
                        ("block_tables", block_tables), ("context_lens", context_lens),
                        ("k_scale", k_scale), ("v_scale", v_scale)):
            _same_device(name, t, device)
        kernel = "paged_attention_v1"
        for name, t, dtype in (("context_lens", context_lens, torch.int32),
                               ("block_tables", block_tables, torch.int32),
                               ("k_scale", k_scale, torch.float32),
                               ("v_scale", v_scale, torch.float32)):
            _need_dtype(name, t, dtype, kernel)
        if cu_query_lens is not None:
            _same_device("cu_query_lens", cu_query_lens, device)
            _need_dtype("cu_query_lens", cu_query_lens, torch.int32, kernel)
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.element_size() != torch.empty(0, dtype=cache_t).element_size():
                raise KernelMisread(f"{kernel} reads {name} as {cache_t} elements "
                                    f"(kv_cache_dtype {kv_cache_dtype!r}); got {t.dtype}")
            if kv_cache_dtype == "auto" and t.dtype != cache_t:
                raise KernelMisread(f"{kernel} reads {name} as {cache_t} (the query dtype); "
                                    f"got {t.dtype}")
        self.decode_calls.append({"seq_lens": context_lens.tolist(),
                                  "kv_cache_dtype": kv_cache_dtype})
        decoded = self.fp8 if cache_t == torch.uint8 else cache_t
        k_flat = _flat(key_cache, cache_t).view(decoded)
        v_flat = _flat(value_cache, cache_t).view(decoded)
        lens = _read(context_lens, (num_seqs,), (1,)).tolist()
        cu = (None if cu_query_lens is None
              else _read(cu_query_lens, (num_seqs + 1,), (1,)).tolist())
        ks = float(_read(k_scale, (1,), (1,))) if cache_t == torch.uint8 else 1.0
        vs = float(_read(v_scale, (1,), (1,))) if cache_t == torch.uint8 else 1.0
        heads = torch.arange(num_kv_heads, device=device)[None, :, None] * kv_head_stride
        dims = torch.arange(head_size, device=device)[None, None, :]
        for b in range(num_seqs):
            query_loc = b * mtp if cu is None else cu[b]
            if cu is not None and cu[b + 1] - cu[b] > 1:
                continue  # multi-token rows: the kernel returns
            ctx = lens[b]
            if ctx <= 0:
                continue
            if ctx > max_num_partitions * 256:
                raise KernelMisread(f"{kernel}: context_lens[{b}] = {ctx} exceeds the "
                                    f"{max_num_partitions} partitions max_context_len "
                                    f"{max_context_len} launches")
            row = _read(block_tables, (max_num_blocks_per_seq,), (1,),
                        b * max_num_blocks_per_seq).long()
            pos = torch.arange(ctx, device=device)
            tok = (row[pos // block_size] * kv_block_stride
                   + (pos % block_size) * kv_seq_stride)[:, None, None]
            idx = tok + heads + dims
            if int(idx.max()) >= k_flat.numel() or int(idx.max()) >= v_flat.numel():
                raise KernelMisread(f"{kernel}: sequence {b} reads past the cache storage")
            kb, vb = k_flat[idx].double() * ks, v_flat[idx].double()
            qb = _read(query, (1, num_heads, head_size), (q_stride, head_size, 1),
                       query_loc * q_stride).double()
            allowed = torch.ones(1, ctx, dtype=torch.bool, device=device)
            if sliding_window > 0:
                allowed &= pos[None, :] >= ctx - sliding_window
            o, _ = _attend(qb, kb, vb, scale, allowed)
            _read(out, (1, num_heads, head_size), (num_heads * head_size, head_size, 1),
                  query_loc * num_heads * head_size).copy_((o * vs).to(out.dtype))
        return out

    @staticmethod
    def _validate_workspace(workspace_buffer, query, block_tables, context_lens, block_size,
                            max_context_len, partition_size, mtp):
        """csrc/cpp_itfs/pa/pa_v1.py ``validate_paged_attention_v1_workspace`` l.58-108."""
        op_name = "paged_attention_v1"
        max_num_partitions = math.ceil(max_context_len / partition_size)
        min_blocks_per_seq = math.ceil(max_context_len / block_size)
        if block_tables.dim() != 2:
            raise ValueError(f"{op_name}: block_tables must be 2D "
                             f"[num_seqs, max_num_blocks_per_seq], got "
                             f"{tuple(block_tables.shape)}")
        if block_tables.size(1) < min_blocks_per_seq:
            raise ValueError(
                f"{op_name}: block_tables.size(1)={block_tables.size(1)} is too small "
                f"for max_context_len={max_context_len} and block_size={block_size}; "
                f"need at least {min_blocks_per_seq} block-table entries per sequence")
        if context_lens.size(0) != block_tables.size(0):
            raise ValueError(f"{op_name}: context_lens.size(0)={context_lens.size(0)} must "
                             f"match block_tables.size(0)={block_tables.size(0)}")
        num_seqs, num_heads, head_size = block_tables.size(0), query.size(1), query.size(2)
        required = (num_seqs * mtp * num_heads * max_num_partitions * head_size
                    * query.element_size()
                    + 2 * num_seqs * mtp * num_heads * max_num_partitions * 4)
        have = workspace_buffer.numel() * workspace_buffer.element_size()
        if have < required:
            raise ValueError(f"{op_name}: workspace_buffer is too small ({have} bytes) for "
                             f"max_context_len={max_context_len}, partition_size="
                             f"{partition_size}, num_seqs={num_seqs}, num_heads={num_heads}, "
                             f"head_size={head_size}, mtp={mtp}; need at least {required} "
                             f"bytes ({max_num_partitions} partition slots)")

    # ----------------------------------------------------------------------
    # Exporting.
    # ----------------------------------------------------------------------

    def install(self, export: AiterExport) -> "FakeAiterFA":
        """Register and export everything on ``export`` (not installed yet)."""
        self._mha_varlen_export = export.register_guarded(
            "aiter.ops.mha", mha_varlen_fwd, self.mha_varlen_fwd)
        self._mha_v3_export = export.register_guarded(
            "aiter.ops.mha", fmha_v3_varlen_fwd, self.fmha_v3_varlen_fwd)
        for module in ("aiter", "aiter.ops.mha"):
            export.export_plain(module, "flash_attn_varlen_func", self.flash_attn_varlen_func)
        unified = "aiter.ops.triton.attention.unified_attention"
        export.export_plain(unified, "unified_attention", self.unified_attention)
        # aiter/ops/triton/__init__.py _BACKWARD_COMPAT_MAP: the old module path
        # resolves to the same module object.
        export.modules["aiter.ops.triton.unified_attention"] = export.module(unified)
        export.module("aiter.ops.triton").unified_attention = export.module(unified)

        fake = self

        def paged_attention_v1(
            out: torch.Tensor,
            workspace_buffer: torch.Tensor,
            query: torch.Tensor,
            key_cache: torch.Tensor,
            value_cache: torch.Tensor,
            scale: float,
            block_tables: torch.Tensor,
            cu_query_lens: torch.Tensor | None,
            context_lens: torch.Tensor,
            max_context_len: int,
            alibi_slopes: torch.Tensor | None,
            kv_cache_dtype: str,
            kv_cache_layout: str,
            logits_soft_cap: float,
            k_scale: torch.Tensor,
            v_scale: torch.Tensor,
            fp8_out_scale: torch.Tensor | None = None,
            partition_size: int = 256,
            mtp: int = 1,
            sliding_window: int = 0,
        ) -> torch.Tensor:
            return fake.paged_attention_v1(
                out, workspace_buffer, query, key_cache, value_cache, scale, block_tables,
                cu_query_lens, context_lens, max_context_len, alibi_slopes, kv_cache_dtype,
                kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale,
                partition_size, mtp, sliding_window)

        paged_attention_v1.__doc__ = FakeAiterFA.paged_attention_v1.__doc__
        export.register_direct(paged_attention_v1, ["out", "workspace_buffer"])
        for module in ("aiter", "aiter.ops.attention"):
            export.export_plain(module, "paged_attention_v1", paged_attention_v1)
        return self


def install_fa_fakes(export: AiterExport, arch: str = "gfx950") -> FakeAiterFA:
    """The FA-path fakes of ``arch``, registered and exported on ``export``."""
    return FakeAiterFA(arch).install(export)
