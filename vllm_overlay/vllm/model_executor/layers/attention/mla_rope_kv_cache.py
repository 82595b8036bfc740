# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused RoPE + KV-cache write for ``MLAAttention``: custom ops and runner.

``MLAAttention.forward_impl`` calls, when its layer fuses (``rope_kv_fusion``
is an ``MLARopeKVFusion``; the path is chosen in ``mla_rope_fusion.py``):

  * ``begin()`` once per forward, with the positions ``MLAAttention.forward``
    received from the wrapper and the layer's slot mapping;
  * ``prefill()`` on the prefill rows before ``forward_mha``: RoPE of
    ``q_pe`` / ``k_pe`` in place and their cache rows
    (``torch.ops.vllm.mla_rope_and_cache``);
  * ``decode()`` on the decode rows, after the W_UK bmm, instead of the
    ``[ql_nope | q_pe]`` concat / fp8 quant: returns the MQA query and writes
    their cache rows (``torch.ops.vllm.mla_rope_concat_and_cache``, AITER's
    ``fused_qk_rope_concat_and_cache_mla`` or the Triton kernel).

Every token of the batch goes through exactly one of the two ops, so the
separate ``unified_mla_kv_cache_update`` is not called for these layers.

Both ops are registered with ``direct_register_custom_op`` and have fake
implementations, so ``torch.compile`` traces them wherever ``forward_impl``
is traced; the tensors they read (positions, slots, scales) are arguments,
never captured host values.  Run eagerly (inside the attention custom op, once
per layer), the step calls their implementations directly: the dispatcher
round trip would cost about as much host time as the kernel launch.
"""

from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_rope_fusion import (
    RopeKVDecision,
    RopeKVFacts,
    RopeKVPath,
    decide_rope_kv_path,
    log_rope_kv_decision,
    rope_fusion_problem,
)
from vllm.model_executor.warmup.jit_warmup import VllmJitKernel
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import MLAAttentionImpl, max_decode_query_len
from vllm.v1.kv_cache_interface import is_quantized_kv_cache
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)

if TYPE_CHECKING:
    from vllm.v1.attention.ops.triton_mla_rope_cache_warmup import MLAGeometry

logger = init_logger(__name__)

__all__ = ["MLARopeKVFusion", "rope_kv_facts"]


# One-element fp32 ones per device: AITER's op takes a q_scale tensor also
# when q_out is not fp8.
_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


# The rotary caches' copies on another device, by source cache (an entry lives
# exactly as long as the rotary embedding's cos_sin_cache it copies; every
# layer sharing that rotary embedding shares it).
_MOVED_COS_SIN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _not_capturing(what: str) -> None:
    """Derived caches are built before any CUDA graph capture: one built
    during a capture would be recorded into the graph, in its memory pool."""
    if current_platform.is_cuda_alike() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what} was first needed during a CUDA graph capture; it must be "
            "built by an eager forward before capturing (vLLM's warmup runs do)"
        )


def _unit_scale(device: torch.device) -> torch.Tensor:
    scale = _UNIT_SCALES.get(device)
    if scale is None:
        _not_capturing("the MLA unit q_scale")
        scale = _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return scale


def _rope_concat_and_cache(
    ql_nope,
    q_pe,
    kv_c,
    k_pe,
    kv_cache,
    q_out,
    slot_mapping,
    positions,
    cos_sin_cache,
    is_neox,
    kv_cache_dtype,
    k_scale,
    q_scale,
    use_aiter,
    all_q_rope,
    rows=None,
) -> None:
    """Decode form: q_out = [ql_nope | rope(q_pe)] (fp8 / q_scale when q_scale
    is given) and the cache rows [kv_c | rope(k_pe)]; q_pe / k_pe untouched.
    The parameters of torch.ops.vllm.mla_rope_concat_and_cache (typed in
    _rope_concat_and_cache_impl), and ``rows``: the step's ``MLARopeRows``
    (eager calls only; not in the op's schema)."""
    if use_aiter:
        rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
            ql_nope,
            q_pe,
            kv_c,
            k_pe,
            kv_cache,
            q_out,
            slot_mapping,
            positions,
            cos_sin_cache,
            is_neox,
            k_scale,
            q_scale if q_scale is not None else _unit_scale(q_out.device),
            all_q_rope,
        )
        return
    # Imported here: importing this module (and MLAAttention) needs no Triton.
    from vllm.v1.attention.ops.triton_mla_rope_cache import mla_rope_concat_and_cache

    mla_rope_concat_and_cache(
        ql_nope,
        q_pe,
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        is_neox,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale,
        q_out=q_out,
        q_scale=q_scale,
        rows=rows,
    )


def _rope_concat_and_cache_impl(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    q_out: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    q_scale: torch.Tensor | None,
    use_aiter: bool,
    all_q_rope: bool,
) -> None:
    _rope_concat_and_cache(
        ql_nope,
        q_pe,
        kv_c,
        k_pe,
        kv_cache,
        q_out,
        slot_mapping,
        positions,
        cos_sin_cache,
        is_neox,
        kv_cache_dtype,
        k_scale,
        q_scale,
        use_aiter,
        all_q_rope,
    )


def _rope_concat_and_cache_fake(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    q_out: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    q_scale: torch.Tensor | None,
    use_aiter: bool,
    all_q_rope: bool,
) -> None:
    return None


def _rope_and_cache(
    q_pe,
    kv_c,
    k_pe,
    kv_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    is_neox,
    kv_cache_dtype,
    k_scale,
    rows=None,
) -> None:
    """Prefill form: rotate q_pe and k_pe in place, write [kv_c | k_pe] rows
    (parameters as torch.ops.vllm.mla_rope_and_cache, and ``rows`` as for the
    decode form)."""
    from vllm.v1.attention.ops.triton_mla_rope_cache import mla_rope_and_cache

    mla_rope_and_cache(
        q_pe,
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        is_neox,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale,
        rows=rows,
    )


def _rope_and_cache_impl(
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
) -> None:
    _rope_and_cache(
        q_pe,
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        is_neox,
        kv_cache_dtype,
        k_scale,
    )


def _rope_and_cache_fake(
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
) -> None:
    return None


direct_register_custom_op(
    op_name="mla_rope_concat_and_cache",
    op_func=_rope_concat_and_cache_impl,
    mutates_args=["kv_cache", "q_out"],
    fake_impl=_rope_concat_and_cache_fake,
)
direct_register_custom_op(
    op_name="mla_rope_and_cache",
    op_func=_rope_and_cache_impl,
    mutates_args=["q_pe", "k_pe", "kv_cache"],
    fake_impl=_rope_and_cache_fake,
)


def rope_kv_facts(layer, rotary_emb) -> RopeKVFacts:
    """What decide_rope_kv_path() needs to know about an MLAAttention layer."""
    impl = layer.impl
    aiter_requested = bool(rocm_aiter_ops.is_mla_rope_kv_fusion_enabled())
    op_problem, op_all_q_rope = (
        rocm_aiter_ops.mla_rope_kv_op_support() if aiter_requested else (None, False)
    )
    writer = getattr(type(impl), "do_kv_cache_update", None)
    standard_writer = writer is MLAAttentionImpl.do_kv_cache_update
    return RopeKVFacts(
        triton_requested=rocm_aiter_ops.is_mla_triton_rope_kv_fusion_enabled(),
        aiter_requested=aiter_requested,
        aiter_op_problem=op_problem,
        aiter_op_all_q_rope=op_all_q_rope,
        gpu=current_platform.is_cuda_alike(),
        rope_problem=rope_fusion_problem(rotary_emb, layer.qk_rope_head_dim),
        model_dtype=str(torch.get_default_dtype()).removeprefix("torch."),
        kv_cache_dtype=layer.kv_cache_dtype,
        sparse=bool(layer.use_sparse or getattr(impl, "is_sparse", False)),
        hisparse=layer.hisparse_cache is not None,
        kv_sharing=layer.kv_sharing_target_layer_name is not None,
        dcp_world_size=impl.dcp_world_size,
        dcp_q_replicate=bool(layer.dcp_q_replicate),
        pcp=bool(layer.use_pcp),
        q_pad_num_heads=layer.q_pad_num_heads,
        backend_cache_writer=not standard_writer,
        kv_lora_rank=layer.kv_lora_rank,
        qk_rope_head_dim=layer.qk_rope_head_dim,
        num_heads=layer.num_heads,
    )


# q_out buffers when vLLM's workspace manager is not set up (tests, tools).
_Q_OUT_BUFFERS: dict[tuple, torch.Tensor] = {}


class MLARopeCacheWarmup(VllmJitKernel[tuple]):
    """The fused layers' Triton kernel in vLLM's JIT warmup: the prefill form
    at every BLOCK_T and, on the Triton path, the decode form."""

    def get_warmup_keys(self, geometry, decode: bool) -> list[tuple]:
        from vllm.v1.attention.ops.triton_mla_rope_cache_warmup import warmup_cases

        return [
            (geometry, case)
            for case in warmup_cases(geometry)
            if decode or case[0] != "decode"
        ]

    def compile(self, compile_key: tuple) -> None:
        from vllm.v1.attention.ops.triton_mla_rope_cache_warmup import compile_case

        geometry, case = compile_key
        compile_case(geometry, case, torch.device(current_platform.device_type))


MLA_ROPE_CACHE_WARMUP = MLARopeCacheWarmup()


class MLARopeKVFusion:
    """RoPE + KV-cache write of one MLAAttention layer, fused in forward_impl."""

    def __init__(self, decision: RopeKVDecision, rotary_emb: torch.nn.Module, layer):
        assert decision.fused, decision
        self.decision = decision
        # A plain attribute, not a submodule: the wrapper owns the module.
        self.rotary_emb = rotary_emb
        self.is_neox = bool(rotary_emb.is_neox_style)
        self.use_aiter = decision.path is RopeKVPath.AITER
        self.kv_cache_dtype = layer.kv_cache_dtype
        self.nope_dim = layer.qk_nope_head_dim
        self.kv_lora_rank = layer.kv_lora_rank
        self.rope_dim = layer.qk_rope_head_dim
        # current_platform.fp8_dtype() is a host query on ROCm: ask once.
        self.fp8_dtype = current_platform.fp8_dtype()
        self.num_heads = layer.num_heads
        # Decode queries quantised to fp8 (forward_impl's condition).
        self._quant_q = bool(
            is_quantized_kv_cache(layer.kv_cache_dtype)
            and layer.impl.supports_quant_query_input
        )
        # In an engine (a vLLM config is set while the model is built): the
        # decode rows' bound, which sizes the q_out buffer, and the JIT warmup.
        vllm_config = get_current_vllm_config_or_none()
        self.max_decode_tokens = None
        if vllm_config is not None:
            self.max_decode_tokens = (
                vllm_config.scheduler_config.max_num_seqs
                * max_decode_query_len(vllm_config)
            )
        if vllm_config is not None and vllm_config.kernel_config.enable_jit_warmup:
            MLA_ROPE_CACHE_WARMUP.register_warmup(
                self._warmup_geometry(layer, vllm_config), decode=not self.use_aiter
            )
        # Both paths run the Triton kernel for prefill rows: a fused layer has
        # Triton (the module itself imports without it).
        from vllm.v1.attention.ops.triton_mla_rope_cache import mla_rope_step_rows

        # The forward's rows, shared with the other layers of the same forward.
        self._step_rows = mla_rope_step_rows

    @classmethod
    def for_layer(cls, layer, rotary_emb) -> "MLARopeKVFusion | None":
        """Decide, log the path once, and return the runner (None: upstream path)."""
        decision = decide_rope_kv_path(rope_kv_facts(layer, rotary_emb))
        log_rope_kv_decision(logger, decision)
        return cls(decision, rotary_emb, layer) if decision.fused else None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """The rotary embedding's cos/sin cache on ``device`` (both kernels
        read any float type; AITER's wrapper converts and splits it once per
        cache).  A copy to another device is made once per source cache and
        lives as long as it (_MOVED_COS_SIN), never during a graph capture."""
        cache = self.rotary_emb.cos_sin_cache
        if cache.device == device:
            return cache
        moved = _MOVED_COS_SIN.get(cache)
        if moved is None:
            moved = _MOVED_COS_SIN[cache] = {}
        converted = moved.get(device)
        if converted is None:
            _not_capturing("the rotary cos/sin cache's copy")
            converted = moved[device] = cache.to(device=device)
        return converted

    def q_out(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The decode rows' MQA query, ``[num_tokens, H, L + R]``: a view of a
        persistent buffer that every fused layer writes in turn (each layer's
        forward_mqa reads it before the next layer writes).  In an engine the
        buffer is sized at the step's decode bound and reserved by the
        profiling run (reserve_workspace), so memory profiling counts it and
        no CUDA graph pool ever holds it; elsewhere it grows as needed, never
        during a capture."""
        width = (self.num_heads, self.kv_lora_rank + self.rope_dim)
        bound = self.max_decode_tokens
        if bound is not None and is_workspace_manager_initialized():
            assert num_tokens <= bound, (num_tokens, bound)
            buffer = current_workspace_manager().get_persistent(
                ("mla_rope_kv_q_out", width, dtype), (bound, *width), dtype
            )
            return buffer[:num_tokens]
        key = (width, dtype, device)
        buffer = _Q_OUT_BUFFERS.get(key)
        if buffer is None or buffer.shape[0] < num_tokens:
            _not_capturing("the MLA decode q_out buffer")
            rows = max(num_tokens, bound or 0)
            buffer = _Q_OUT_BUFFERS[key] = torch.empty(
                (rows, *width), dtype=dtype, device=device
            )
        return buffer[:num_tokens]

    def reserve_workspace(self, dtype: torch.dtype, device: torch.device) -> None:
        """Called in the profiling run: claim the q_out buffer at its bound."""
        if self.max_decode_tokens is not None:
            self.q_out(0, self.fp8_dtype if self._quant_q else dtype, device)

    def _warmup_geometry(self, layer, vllm_config) -> "MLAGeometry":
        """The layer's launches for the JIT warmup.  The strides are those of
        the wrapper's tensors (q from the q projection, kv_c | k_pe rows of
        the latent projection, the bmm's ql_nope), given by the layer's dims:
        they select a variant only by their divisibility by 16."""
        from vllm.v1.attention.ops.triton_mla_rope_cache_warmup import MLAGeometry

        h, p, L, R = self.num_heads, self.nope_dim, self.kv_lora_rank, self.rope_dim
        fp8 = is_quantized_kv_cache(self.kv_cache_dtype)
        model_dtype = vllm_config.model_config.dtype
        block_size = vllm_config.cache_config.block_size
        return MLAGeometry(
            num_heads=h,
            lora_rank=L,
            rope_dim=R,
            model_dtype=model_dtype,
            cache_dtype=torch.uint8 if fp8 else model_dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=block_size,
            cache_strides=(block_size * (L + R), L + R),
            q_strides=(h * (p + R), p + R),
            kv_stride=L + R,
            ql_nope_strides=(h * L, L),
            cos_sin_stride=self.rotary_emb.cos_sin_cache.stride(0),
            cos_sin_dtype=self.rotary_emb.cos_sin_cache.dtype,
            is_neox=self.is_neox,
            max_num_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            q_fp8=self._quant_q,
        )

    def begin(
        self,
        layer,
        q: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor | None,
    ) -> "tuple[MLARopeKVStep | None, torch.Tensor]":
        """Start one forward over ``q.shape[0]`` tokens: (step, k_pe).

        The step is None when there is no cache to write this time (no slot
        mapping, cache not allocated): RoPE is then applied here, exactly as
        the wrapper would have, and forward_impl continues on upstream's path.
        """
        num_tokens = q.shape[0]
        if slot_mapping is None or kv_cache.numel() == 0:
            positions = positions[:num_tokens]
            nope = self.nope_dim
            q[..., nope:], k_pe = self.rotary_emb(positions, q[..., nope:], k_pe)
            return None, k_pe
        rows = self._step_rows(
            positions, slot_mapping, num_tokens, self.cos_sin_cache(kv_cache.device)
        )
        return MLARopeKVStep(self, layer, kv_cache, rows), k_pe


class MLARopeKVStep:
    """One forward of a fused layer: its cache and scale, and the rows."""

    __slots__ = ("fusion", "kv_cache", "k_scale", "shared")

    def __init__(self, fusion: MLARopeKVFusion, layer, kv_cache, shared):
        self.fusion = fusion
        self.kv_cache = kv_cache
        self.k_scale = layer._k_scale
        self.shared = shared

    def prefill(
        self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, start: int
    ) -> None:
        """Rows ``start:start + len(q)``: rotate q[..., P:] and k_pe in place
        and write their cache rows."""
        f = self.fusion
        slots, positions, rows = self.shared.rows(start, start + q.shape[0])
        if torch.compiler.is_compiling():
            torch.ops.vllm.mla_rope_and_cache(
                q[..., f.nope_dim :],
                kv_c,
                k_pe,
                self.kv_cache,
                slots,
                positions,
                self.shared.cos_sin_cache,
                f.is_neox,
                f.kv_cache_dtype,
                self.k_scale,
            )
            return
        _rope_and_cache(
            q[..., f.nope_dim :],
            kv_c,
            k_pe,
            self.kv_cache,
            slots,
            positions,
            self.shared.cos_sin_cache,
            f.is_neox,
            f.kv_cache_dtype,
            self.k_scale,
            rows,
        )

    def decode(
        self,
        ql_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        q_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The first ``len(ql_nope)`` rows: the MQA query [ql_nope | rope(q_pe)]
        (fp8, / q_scale, when q_scale is given) and their cache rows."""
        f = self.fusion
        num_tokens = ql_nope.shape[0]
        q_out = f.q_out(
            num_tokens,
            ql_nope.dtype if q_scale is None else f.fp8_dtype,
            ql_nope.device,
        )
        slots, positions, rows = self.shared.rows(0, num_tokens)
        args = (
            ql_nope,
            q_pe,
            kv_c,
            k_pe,
            self.kv_cache,
            q_out,
            slots,
            positions,
            self.shared.cos_sin_cache,
            f.is_neox,
            f.kv_cache_dtype,
            self.k_scale,
            q_scale,
            f.use_aiter,
            f.decision.aiter_all_q_rope,
        )
        if torch.compiler.is_compiling():
            torch.ops.vllm.mla_rope_concat_and_cache(*args)
        else:
            _rope_concat_and_cache(*args, rows)
        return q_out
