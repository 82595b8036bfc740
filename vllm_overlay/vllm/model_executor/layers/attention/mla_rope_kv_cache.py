# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused RoPE + KV-cache write for ``MLAAttention``: custom ops and runner.

Once per step, the MLA attention metadata builder splits the step's positions
and slot mapping into the decode rows and the prefill rows and checks them
(``build_mla_rope_step_rows``, kept as ``MLACommonMetadata.mla_rope_rows``).

``MLAAttention.forward_impl`` then calls, when its layer fuses
(``rope_kv_fusion`` is an ``MLARopeKVFusion``; the path is chosen in
``mla_rope_fusion.py``):

  * ``begin()`` with the step's rows from the metadata;
  * ``prefill()`` on the prefill rows before ``forward_mha``: RoPE of
    ``q_pe`` / ``k_pe`` in place and their cache rows
    (``torch.ops.vllm.mla_rope_and_cache``);
  * ``decode()`` on the decode rows, after the W_UK bmm, instead of the
    ``[ql_nope | q_pe]`` concat / fp8 quant: returns the MQA query and writes
    their cache rows (``torch.ops.vllm.mla_rope_concat_and_cache``, AITER's
    ``fused_qk_rope_concat_and_cache_mla`` or the Triton kernel).

Every token of the batch goes through exactly one of the two ops, so the
separate ``unified_mla_kv_cache_update`` is not called for these layers.

Each op is registered once with ``direct_register_custom_op`` and always
called through ``torch.ops.vllm``, so ``torch.compile`` traces its fake
implementation wherever ``forward_impl`` is traced; the tensors it reads
(positions, slots, scales) are arguments, never captured host values.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context, is_forward_context_available
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

__all__ = [
    "MLARopeKVFusion",
    "MLARopeRows",
    "MLARopeStepRows",
    "build_mla_rope_step_rows",
    "rope_kv_facts",
]

# slot_mapping's and positions' dtypes (the kernels read either).
_INDEX_DTYPES = (torch.int32, torch.int64)


# The rotary embedding's attribute that keeps AITER's cos/sin tables
# (MLARopeKVFusion.aiter_cos_sin).
_AITER_COS_SIN = "mla_rope_aiter_cos_sin"

# One-element fp32 ones per device: AITER's op takes a q_scale tensor also
# when q_out is not fp8.
_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


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


@dataclass(frozen=True)
class MLARopeRows:
    """One kind of a step's rows (decode or prefill): their cache slots and
    positions, 1-D int32 / int64 contiguous tensors on one device, and the
    Triton kernel's launches for them, one per layer geometry, each built by
    the step's first layer of that geometry (``triton_mla_rope_cache``)."""

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    launches: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class MLARopeStepRows:
    """A step's rows, split at ``num_decode_tokens``: built once per step by
    the MLA attention metadata builder and read by every fused layer."""

    decode: MLARopeRows
    prefill: MLARopeRows


def build_mla_rope_step_rows(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decode_tokens: int,
    num_tokens: int,
) -> MLARopeStepRows:
    """Check a step's positions and slot mapping and split them into its
    decode rows ``[0, num_decode_tokens)`` and prefill rows
    ``[num_decode_tokens, num_tokens)``."""
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"MLA RoPE rows: {name} must be int32 or int64: {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"MLA RoPE rows: {name} must be a contiguous 1-D tensor")
        if t.shape[0] < num_tokens:
            raise ValueError(
                f"MLA RoPE rows: {name} has {t.shape[0]} rows, the step {num_tokens}"
            )
    if positions.device != slot_mapping.device:
        raise ValueError("MLA RoPE rows: positions and slot_mapping on two devices")
    assert 0 <= num_decode_tokens <= num_tokens, (num_decode_tokens, num_tokens)
    return MLARopeStepRows(
        decode=MLARopeRows(
            slot_mapping=slot_mapping[:num_decode_tokens],
            positions=positions[:num_decode_tokens],
        ),
        prefill=MLARopeRows(
            slot_mapping=slot_mapping[num_decode_tokens:num_tokens],
            positions=positions[num_decode_tokens:num_tokens],
        ),
    )


def mla_rope_concat_and_cache(
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
    layer_name: str = "",
) -> None:
    """Decode form (torch.ops.vllm.mla_rope_concat_and_cache): q_out =
    [ql_nope | rope(q_pe)] (fp8, / q_scale, when q_scale is given) and the
    cache rows [kv_c | rope(k_pe)] of the first ``ql_nope.shape[0]`` rows of
    kv_c / k_pe (a step's rows, decode rows first); q_pe / k_pe untouched.
    ``cos_sin_cache``: the rotary embedding's [max_pos, R] cache, or with
    ``use_aiter`` AITER's tables (``MLARopeKVFusion.aiter_cos_sin``)."""
    if use_aiter:
        # AITER is handed exactly the decode rows (its launcher takes the
        # token count from slot_mapping; it is not asked to skip rows).
        num_tokens = ql_nope.shape[0]
        rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
            ql_nope=ql_nope,
            q_pe=q_pe,
            kv_c=kv_c[:num_tokens],
            k_pe=k_pe[:num_tokens],
            kv_cache=kv_cache,
            q_out=q_out,
            slot_mapping=slot_mapping,
            positions=positions,
            cos_sin=cos_sin_cache,
            is_neox=is_neox,
            k_scale=k_scale,
            q_scale=q_scale if q_scale is not None else _unit_scale(q_out.device),
            all_q_rope=all_q_rope,
        )
        return
    # Imported here: importing this module (and MLAAttention) needs no Triton.
    from vllm.v1.attention.ops import triton_mla_rope_cache

    triton_mla_rope_cache.mla_rope_concat_and_cache(
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
        launches=_step_launches(layer_name, decode=True),
    )


def mla_rope_and_cache(
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
    layer_name: str = "",
) -> None:
    """Prefill form (torch.ops.vllm.mla_rope_and_cache): rotate q_pe and k_pe
    in place and write the cache rows [kv_c | k_pe]."""
    from vllm.v1.attention.ops import triton_mla_rope_cache

    triton_mla_rope_cache.mla_rope_and_cache(
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
        launches=_step_launches(layer_name, decode=False),
    )


def _step_launches(layer_name: str, decode: bool) -> dict | None:
    """The step's Triton launches of one form, from the layer's attention
    metadata in the forward context (as vLLM's attention ops find theirs);
    None outside a forward (each call then checks and builds its launch)."""
    if not layer_name or not is_forward_context_available():
        return None
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    rows = getattr(attn_metadata.get(layer_name), "mla_rope_rows", None)
    if rows is None:
        return None
    return (rows.decode if decode else rows.prefill).launches


def _writes_only_fake(*args, **kwargs) -> None:
    """Both ops only write into their arguments (mutates_args)."""
    return None


direct_register_custom_op(
    op_name="mla_rope_concat_and_cache",
    op_func=mla_rope_concat_and_cache,
    mutates_args=["kv_cache", "q_out"],
    fake_impl=_writes_only_fake,
)
direct_register_custom_op(
    op_name="mla_rope_and_cache",
    op_func=mla_rope_and_cache,
    mutates_args=["q_pe", "k_pe", "kv_cache"],
    fake_impl=_writes_only_fake,
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
        # The custom ops find the step's launches by it (forward context).
        self.layer_name = getattr(layer, "layer_name", "")
        self._q_out_buffer: torch.Tensor | None = None
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

    @classmethod
    def for_layer(cls, layer, rotary_emb) -> "MLARopeKVFusion | None":
        """Decide, log the path once, and return the runner (None: upstream path)."""
        decision = decide_rope_kv_path(rope_kv_facts(layer, rotary_emb))
        log_rope_kv_decision(logger, decision)
        return cls(decision, rotary_emb, layer) if decision.fused else None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """The rotary embedding's cos/sin cache on ``device`` (the Triton
        kernel reads any float type).  On another device it is moved as
        upstream's rotary embedding moves it (``_match_cos_sin_cache_dtype``):
        the rotary embedding's own attribute is replaced, once, shared by
        every layer sharing that rotary embedding; never during a graph
        capture."""
        cache = self.rotary_emb.cos_sin_cache
        if cache.device != device:
            _not_capturing("the rotary cos/sin cache on the KV cache's device")
            cache = self.rotary_emb.cos_sin_cache = cache.to(device=device)
        return cache

    def aiter_cos_sin(self, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """AITER's dense cos/sin tables of the rotary ``cache`` in the model
        ``dtype`` (``rocm_aiter_ops.mla_rope_cos_sin``), what the AITER path's
        decode op reads.  Kept beside the cache they derive from, on the
        rotary embedding: built by the first layer that needs them, shared by
        every layer sharing the rotary embedding (vLLM shares them; their
        caches are fixed, ``rope_fusion_problem`` admits no other); rebuilt
        only for another device or dtype, never during a graph capture."""
        tables = getattr(self.rotary_emb, _AITER_COS_SIN, None)
        if tables is None or tables.device != cache.device or tables.dtype != dtype:
            _not_capturing("AITER's cos/sin tables")
            tables = rocm_aiter_ops.mla_rope_cos_sin(cache, dtype)
            setattr(self.rotary_emb, _AITER_COS_SIN, tables)
        return tables

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
        # Outside an engine (tests, tools): the layer's own buffer.
        buffer = self._q_out_buffer
        if (
            buffer is None
            or buffer.shape[0] < num_tokens
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            _not_capturing("the MLA decode q_out buffer")
            rows = max(num_tokens, bound or 0)
            buffer = self._q_out_buffer = torch.empty(
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
        rows: MLARopeStepRows | None,
    ) -> "tuple[MLARopeKVStep | None, torch.Tensor]":
        """Start one forward over ``q.shape[0]`` tokens: (step, k_pe).

        ``rows``: the step's rows from the attention metadata.  The step is
        None when there is no cache to write this time (no slot mapping,
        cache not allocated): RoPE is then applied here from ``positions``,
        exactly as the wrapper would have, and forward_impl continues on
        upstream's path.
        """
        if slot_mapping is None or kv_cache.numel() == 0:
            positions = positions[: q.shape[0]]
            nope = self.nope_dim
            q[..., nope:], k_pe = self.rotary_emb(positions, q[..., nope:], k_pe)
            return None, k_pe
        if rows is None:
            raise RuntimeError(
                "MLA RoPE + KV-cache fusion: the attention metadata has no "
                "mla_rope_rows; the model runner must set "
                "CommonAttentionMetadata.positions"
            )
        cos_sin_cache = self.cos_sin_cache(kv_cache.device)
        return MLARopeKVStep(
            fusion=self,
            kv_cache=kv_cache,
            k_scale=layer._k_scale,
            cos_sin_cache=cos_sin_cache,
            decode_cos_sin=(
                self.aiter_cos_sin(cos_sin_cache, q.dtype)
                if self.use_aiter
                else cos_sin_cache
            ),
            rows=rows,
        ), k_pe


@dataclass
class MLARopeKVStep:
    """One forward of a fused layer: its cache, scale and cos/sin (the
    prefill form's and the decode form's), and the step's rows."""

    fusion: MLARopeKVFusion
    kv_cache: torch.Tensor
    k_scale: torch.Tensor
    cos_sin_cache: torch.Tensor
    decode_cos_sin: torch.Tensor
    rows: MLARopeStepRows

    def prefill(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """The prefill rows: rotate q[..., P:] and k_pe in place and write
        their cache rows."""
        f = self.fusion
        # Positional, in mla_rope_and_cache's order, as vLLM calls its custom
        # ops: binding keywords to the schema adds to every call's dispatch.
        torch.ops.vllm.mla_rope_and_cache(
            q[..., f.nope_dim :],  # q_pe
            kv_c,
            k_pe,
            self.kv_cache,
            self.rows.prefill.slot_mapping,
            self.rows.prefill.positions,
            self.cos_sin_cache,
            f.is_neox,
            f.kv_cache_dtype,
            self.k_scale,
            f.layer_name,
        )

    def decode(
        self,
        ql_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        q_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decode rows: the MQA query [ql_nope | rope(q_pe)] (fp8, /
        q_scale, when q_scale is given) and their cache rows.  ``kv_c`` /
        ``k_pe``: the step's rows; the first ``ql_nope.shape[0]``, the decode
        rows, are read (no per-layer slice)."""
        f = self.fusion
        q_out = f.q_out(
            ql_nope.shape[0],
            ql_nope.dtype if q_scale is None else f.fp8_dtype,
            ql_nope.device,
        )
        # Positional, in mla_rope_concat_and_cache's order (as in prefill()).
        torch.ops.vllm.mla_rope_concat_and_cache(
            ql_nope,
            q_pe,
            kv_c,
            k_pe,
            self.kv_cache,
            q_out,
            self.rows.decode.slot_mapping,
            self.rows.decode.positions,
            self.decode_cos_sin,
            f.is_neox,
            f.kv_cache_dtype,
            self.k_scale,
            q_scale,
            f.use_aiter,
            f.decision.aiter_all_q_rope,  # all_q_rope
            f.layer_name,
        )
        return q_out
