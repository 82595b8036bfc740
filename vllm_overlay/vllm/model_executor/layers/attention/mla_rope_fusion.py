# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where an MLA layer applies RoPE and writes its KV cache: the decision.

Upstream ("unfused") runs three steps per layer:
``MultiHeadLatentAttentionWrapper.forward`` rotates ``q_pe`` / ``k_pe``,
``MLAAttention.forward`` writes ``[kv_c | k_pe]`` to the cache through
``unified_mla_kv_cache_update``, and ``forward_impl`` concatenates the decode
query ``[ql_nope | q_pe]`` (fp8-quantised when the backend takes an fp8
query).

Fused, the wrapper hands the rotary embedding and the token positions to
``MLAAttention``, which does all of it in ``forward_impl``, one launch per
token kind (see ``mla_rope_kv_cache.py``):

  * decode tokens (the first ``num_decode_tokens``): RoPE, cache write and the
    MQA query in one launch, which replaces the concat / fp8 quant;
  * prefill tokens: RoPE of ``q_pe`` / ``k_pe`` in place plus the cache write.

Paths:

  * ``triton``: both through ``vllm/v1/attention/ops/triton_mla_rope_cache.py``
    (any CUDA or ROCm GPU): ``VLLM_MLA_TRITON_ROPE_KV_FUSION=1``, or the AITER
    flag below when the installed AITER cannot serve the decode form.
  * ``aiter``: decode through AITER's ``fused_qk_rope_concat_and_cache_mla``,
    prefill through the Triton kernel: ``VLLM_ROCM_USE_AITER_MLA_ROPE_KV_FUSION``
    (default off: the AITER op path has not run on AMD hardware yet), which
    acts only with ``VLLM_ROCM_USE_AITER=1`` and AITER MLA on a supported ROCm
    GPU.  An AITER whose op has another schema fails at startup.
  * ``unfused``: upstream, unchanged -- both flags off, or a layer the fused
    kernels cannot serve (the reason names it).

This module holds only pure functions of the facts handed in, and the one log
line; ``mla_rope_kv_cache.py`` gathers the facts and runs the chosen path.
"""

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "FUSABLE_KV_CACHE_DTYPES",
    "RopeKVDecision",
    "RopeKVFacts",
    "RopeKVPath",
    "aiter_all_q_rope_problem",
    "decide_rope_kv_path",
    "log_rope_kv_decision",
    "rope_fusion_problem",
]

# KV-cache formats the fused kernels write: the model dtype, or e4m3 fp8 with a
# per-tensor scale.  "fp8_e5m2" is left out because MLAAttention reads every
# fp8 cache through the platform's e4m3 type; the per-token and opaque
# (fp8_ds_mla, nvfp4_ds_mla, ...) formats have their own writers.
FUSABLE_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")

# Activation dtypes: the Triton kernel takes all three, AITER's HIP op 16-bit.
_MODEL_DTYPES = ("bfloat16", "float16", "float32")
_AITER_MODEL_DTYPES = ("bfloat16", "float16")
_AITER_OP = "AITER's fused_qk_rope_concat_and_cache_mla"

# Rotary embeddings whose forward is "look up cos_sin_cache[positions], rotate
# halves (NeoX) or pairs (GPT-J)", which is what the fused kernels compute.  A
# subclass qualifies only if it overrides none of _ROPE_METHODS (it may change
# how the cache is built, e.g. Llama-3 / YaRN scaling).  CustomOp provides the
# dispatching forward().
_FUSABLE_ROPE_CLASSES = (
    "RotaryEmbedding",
    "DeepseekScalingRotaryEmbedding",
    "CustomOp",
)
_ROPE_METHODS = ("forward", "forward_native", "forward_cuda", "forward_hip")


class RopeKVPath(StrEnum):
    UNFUSED = "unfused"
    TRITON = "triton"
    AITER = "aiter"


@dataclass(frozen=True)
class RopeKVFacts:
    """What the decision depends on, for one MLAAttention layer."""

    # VLLM_MLA_TRITON_ROPE_KV_FUSION.
    triton_requested: bool
    # VLLM_ROCM_USE_AITER_MLA_ROPE_KV_FUSION and VLLM_ROCM_USE_AITER and AITER
    # MLA, on a ROCm GPU AITER supports (rocm_aiter_ops).
    aiter_requested: bool
    # Why AITER's fused_qk_rope_concat_and_cache_mla cannot be called (None:
    # it can); only consulted when aiter_requested.
    aiter_op_problem: str | None
    # The AITER op takes compute_all_q_rope (RoPE on q of slot -1 tokens too).
    aiter_op_all_q_rope: bool
    # current_platform.is_cuda_alike().
    gpu: bool
    # rope_fusion_problem() of the rotary embedding handed over.
    rope_problem: str | None
    model_dtype: str  # "bfloat16", "float16", "float32"
    kv_cache_dtype: str  # vLLM's cache dtype string
    sparse: bool = False  # sparse MLA (top-k indexer)
    hisparse: bool = False  # HiSparse cache with its own write target
    kv_sharing: bool = False  # reads another layer's KV cache, writes none
    dcp_world_size: int = 1
    dcp_q_replicate: bool = False  # the decode query spans the DCP group's heads
    pcp: bool = False  # prefill context parallelism
    q_pad_num_heads: int | None = None  # the backend wants a head-padded query
    backend_cache_writer: bool = False  # the backend overrides do_kv_cache_update
    # The layer's MLA dims (rank-local heads): what AITER's dispatch depends on.
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    num_heads: int = 128


@dataclass(frozen=True)
class RopeKVDecision:
    path: RopeKVPath
    reason: str
    # A flag asked for the fusion (the log line is info, not debug).
    requested: bool
    # Pass compute_all_q_rope=True to the AITER op (DCP: every token's q is
    # all-gathered, also those whose KV lives on another rank, slot -1).
    aiter_all_q_rope: bool = False

    @property
    def fused(self) -> bool:
        return self.path is not RopeKVPath.UNFUSED


def _method_owner(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def rope_fusion_problem(rotary_emb: object, qk_rope_head_dim: int) -> str | None:
    """Why the fused kernels cannot replace ``rotary_emb`` (None: they can)."""
    if rotary_emb is None:
        return "the model hands no rotary embedding to the attention layer"
    cls = type(rotary_emb)
    for name in _ROPE_METHODS:
        owner = _method_owner(cls, name)
        if owner is None or owner.__name__ not in _FUSABLE_ROPE_CLASSES:
            where = "missing" if owner is None else f"defined by {owner.__name__}"
            return (
                f"{cls.__name__}.{name} is {where}, not a cos/sin lookup "
                "rotary embedding"
            )
    rotary_dim = getattr(rotary_emb, "rotary_dim", None)
    head_size = getattr(rotary_emb, "head_size", None)
    if rotary_dim != qk_rope_head_dim or head_size != qk_rope_head_dim:
        return (
            f"partial rotary (rotary_dim {rotary_dim}, head_size {head_size}, "
            f"qk_rope_head_dim {qk_rope_head_dim})"
        )
    cache = getattr(rotary_emb, "cos_sin_cache", None)
    shape = tuple(getattr(cache, "shape", ()))
    if len(shape) != 2 or shape[1] != rotary_dim:
        return (
            f"{cls.__name__}.cos_sin_cache is not [max_pos, {rotary_dim}] (got {shape})"
        )
    if not isinstance(getattr(rotary_emb, "is_neox_style", None), bool):
        return f"{cls.__name__} has no is_neox_style flag"
    return None


def _layer_problem(f: RopeKVFacts) -> str | None:
    """Why the layer stays on upstream's path although a flag asks (None: it
    need not)."""
    if not f.gpu:
        return "not a CUDA or ROCm platform"
    if f.rope_problem is not None:
        return f.rope_problem
    if f.sparse:
        return "sparse MLA (the top-k path writes and reads the cache its own way)"
    if f.hisparse:
        return "HiSparse MLA cache (its own write target)"
    if f.kv_sharing:
        return "KV sharing (the layer reads another layer's cache and writes none)"
    if f.kv_cache_dtype not in FUSABLE_KV_CACHE_DTYPES:
        return (
            f"kv_cache_dtype {f.kv_cache_dtype!r} (the fused kernels write "
            f"{', '.join(FUSABLE_KV_CACHE_DTYPES)})"
        )
    if f.model_dtype not in _MODEL_DTYPES:
        return f"model dtype {f.model_dtype}"
    if (
        f.kv_cache_dtype not in ("auto", *_FP8_KV_CACHE_DTYPES)
        and f.kv_cache_dtype != f.model_dtype
    ):
        return (
            f"kv_cache_dtype {f.kv_cache_dtype!r} differs from the model dtype "
            f"{f.model_dtype}"
        )
    if f.dcp_q_replicate:
        return "DCP q replication (the decode query is a second, replicated q)"
    if f.pcp:
        return (
            "prefill context parallelism (cache inputs are gathered across ranks first)"
        )
    if f.q_pad_num_heads is not None:
        return (
            f"the attention backend pads the decode query to {f.q_pad_num_heads} heads"
        )
    if f.backend_cache_writer:
        return (
            "the attention backend writes the KV cache its own way (do_kv_cache_update)"
        )
    return None


# AITER's launcher honours compute_all_q_rope only in its per-head and "opt"
# decode kernels, and refuses every other case with an AITER_CHECK (csrc/kernels/
# cache_kernels.cu, fused_qk_rope_concat_and_cache_mla, read at v0.1.20-46 =
# e4048607; the pinned v0.1.28.post1 was not readable, so not re-checked).  The
# per-head kernel also needs block size 1 and < 256 tokens per call, which a
# step does not guarantee, so DCP takes the AITER path only where "opt" runs.
_AITER_OPT_KV_LORA_RANK = 512
_AITER_OPT_ROPE_DIM = 64
_AITER_OPT_MIN_LORA_X_HEADS = 2048


def aiter_all_q_rope_problem(f: RopeKVFacts) -> str | None:
    """Why AITER's op cannot serve compute_all_q_rope=True for this layer."""
    if (
        f.qk_rope_head_dim == _AITER_OPT_ROPE_DIM
        and f.kv_lora_rank == _AITER_OPT_KV_LORA_RANK
        and f.kv_lora_rank * f.num_heads >= _AITER_OPT_MIN_LORA_X_HEADS
    ):
        return None
    return (
        "DCP needs compute_all_q_rope, which AITER's op serves only with "
        f"qk_rope_head_dim {_AITER_OPT_ROPE_DIM}, kv_lora_rank "
        f"{_AITER_OPT_KV_LORA_RANK} and kv_lora_rank x heads >= "
        f"{_AITER_OPT_MIN_LORA_X_HEADS} (this layer: {f.qk_rope_head_dim}, "
        f"{f.kv_lora_rank}, {f.num_heads} heads)"
    )


def decide_rope_kv_path(f: RopeKVFacts) -> RopeKVDecision:
    """The path of one layer and why; a pure function of ``f``."""
    if not (f.aiter_requested or f.triton_requested):
        return RopeKVDecision(
            RopeKVPath.UNFUSED,
            "VLLM_MLA_TRITON_ROPE_KV_FUSION is off and the AITER fusion is not on "
            "(it needs VLLM_ROCM_USE_AITER=1, AITER MLA and "
            "VLLM_ROCM_USE_AITER_MLA_ROPE_KV_FUSION=1 on a ROCm GPU AITER supports)",
            requested=False,
        )
    problem = _layer_problem(f)
    if problem is not None:
        return RopeKVDecision(RopeKVPath.UNFUSED, problem, requested=True)
    triton = "decode and prefill through the Triton kernel"
    if not f.aiter_requested:
        return RopeKVDecision(
            RopeKVPath.TRITON,
            f"VLLM_MLA_TRITON_ROPE_KV_FUSION=1: {triton}",
            requested=True,
        )
    if f.aiter_op_problem is not None:
        why = f"{_AITER_OP} is unusable ({f.aiter_op_problem})"
    elif f.model_dtype not in _AITER_MODEL_DTYPES:
        why = f"{_AITER_OP} takes fp16/bf16, not {f.model_dtype}"
    elif f.dcp_world_size > 1 and not f.aiter_op_all_q_rope:
        why = (
            "DCP needs RoPE on the query of every token and the installed AITER "
            "op has no compute_all_q_rope"
        )
    elif f.dcp_world_size > 1 and (problem := aiter_all_q_rope_problem(f)) is not None:
        why = problem
    else:
        return RopeKVDecision(
            RopeKVPath.AITER,
            "decode through AITER fused_qk_rope_concat_and_cache_mla, prefill "
            "through the Triton kernel",
            requested=True,
            aiter_all_q_rope=f.dcp_world_size > 1,
        )
    return RopeKVDecision(RopeKVPath.TRITON, f"{why}: {triton}", requested=True)


def log_rope_kv_decision(logger, decision: RopeKVDecision) -> None:
    """The one line saying which path runs and why, at info level, once per
    process for each distinct line (every layer of a model gives the same)."""
    logger.info_once(
        "MLA RoPE + KV-cache write: %s path (%s).", decision.path.value, decision.reason
    )
