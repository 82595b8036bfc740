"""A small MLAAttention on the CPU, for the RoPE + KV-cache fusion tests.

Building a real ``MLAAttention`` needs a backend, a vLLM config and tensor
parallel groups, none of which exist on the CPU tier, so ``make_layer`` builds
one with ``object.__new__`` and sets the attributes ``forward`` /
``forward_impl`` / ``update_kv_cache`` read.  The methods are vLLM's own; only
the backend is a stub (``StubImpl``): deterministic torch functions for
``forward_mha`` / ``forward_mqa`` that read every value the RoPE / cache /
query plumbing produces (the rotated q, k_pe and the cache rows of the decode
tokens), and a torch reference of ``concat_and_cache_mla`` for the unfused
cache write.

Run as a script (``python _mla_rope_harness.py OUT``) against a *pristine*
vLLM tree, it records the upstream results of every case in ``CASES`` so that
the tests can compare the patched tree with both flags off byte for byte.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass

import torch

# The GPU when there is one (compiled kernels), else the CPU (interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Small dims keep the Triton interpreter fast: heads, nope, rope, latent, v.
N, P, R, L, V = 2, 4, 8, 16, 4
BLOCK_SIZE, NUM_BLOCKS = 4, 8
MAX_POS = 64
LAYER_NAME = "model.layers.0.self_attn.attn"
# Powers of two: x / s and x * (1 / s) round alike, so upstream's reciprocal
# quant and the kernels' division give the same fp8 codes.
K_SCALE, Q_SCALE = 0.5, 2.0


@dataclass(frozen=True)
class Case:
    name: str
    num_decode: int  # decode tokens (one per request), first in the batch
    num_prefill: int  # prefill tokens (one request), after the decodes
    pad: int = 0  # CUDA-graph padding rows past the real tokens
    rope: str = "deepseek_yarn"  # "deepseek_yarn" (GPT-J pairs) or "neox"
    kv_cache_dtype: str = "auto"
    quant_query: bool = False  # backend takes an fp8 decode query


CASES = [
    Case("decode_only", 3, 0, rope="neox"),
    Case("prefill_only", 0, 5),
    Case("mixed_decode_first", 2, 4),
    Case("mixed_padded", 2, 3, pad=3, rope="neox"),
    Case("fp8_cache_fp8_query", 2, 3, rope="neox", kv_cache_dtype="fp8", quant_query=True),
    Case("fp8_cache_model_query", 3, 2, rope="neox", kv_cache_dtype="fp8"),
]
CASES_BY_NAME = {c.name: c for c in CASES}


def fp8_dtype() -> torch.dtype:
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def exact_fp8(case: Case) -> bool:
    """fp8 cases: every value the kernels convert to fp8 is an fp8 value times
    the scale, and RoPE is the identity (position 0, NeoX).  The Triton
    interpreter's fp8 conversion mis-rounds across binades, and exact values
    keep the comparison exact on GPUs too; fp8 rounding itself is the kernel
    tests' business."""
    return case.kv_cache_dtype.startswith("fp8")


def _fp8_values(shape, generator, scale: float) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(torch.float8_e4m3fn).float() * scale


def make_rope(kind: str) -> torch.nn.Module:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding,
    )

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        if kind == "neox":
            rope = RotaryEmbedding(R, R, MAX_POS, 10000.0, True, torch.float32)
        else:  # DeepSeek-V2/V3: GPT-J pairs, YaRN cache with mscale folded in.
            rope = DeepseekScalingRotaryEmbedding(
                R, R, MAX_POS // 4, 10000.0, False, 4.0, torch.float32,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707,
            )
    return rope.to(DEVICE)


CACHE_WRITES = [0]  # calls of the unfused cache write since the last run()


def reference_concat_and_cache(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale,
                               skip_scale=False):
    """vLLM's concat_and_cache_mla in torch: rows [kv_c | k_pe] (/ scale, fp8).

    Installed as vllm._custom_ops.concat_and_cache_mla (vllm._C is not built on
    the CPU tier), so the unfused path runs vLLM's own do_kv_cache_update."""
    CACHE_WRITES[0] += 1
    k_scale = scale
    rows = torch.cat([kv_c, k_pe.reshape(kv_c.shape[0], -1)], dim=-1)
    if kv_cache_dtype.startswith("fp8"):
        dtype = fp8_dtype()
        finfo = torch.finfo(dtype)
        rows = (rows.float() / k_scale.float()).clamp(finfo.min, finfo.max).to(dtype)
        kv_cache = kv_cache.view(dtype)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    for t, slot in enumerate(slot_mapping.tolist()[: kv_c.shape[0]]):
        if slot >= 0:
            flat[slot] = rows[t]


class StubImpl:
    """The backend: plain torch, deterministic, no kernels; the cache write is
    MLAAttentionImpl's (see install_reference_cache_write)."""

    is_sparse = False
    dcp_world_size = 1

    def __init__(self, supports_quant_query_input: bool, dtype: torch.dtype):
        g = torch.Generator().manual_seed(7)
        self.supports_quant_query_input = supports_quant_query_input
        self.w_mha = (torch.randn(N * (P + R) + R + L, N * V, generator=g) / 8).to(DEVICE)
        self.dtype = dtype
        self.mqa_queries: list[torch.Tensor] = []

    def forward_mha(self, q, kv_c, k_pe, kv_cache, attn_metadata, k_scale, output,
                    output_scale=None):
        t = q.shape[0]
        x = torch.cat([q.reshape(t, -1), k_pe.reshape(t, -1), kv_c.reshape(t, -1)], dim=-1)
        output.copy_((x.float() @ self.w_mha).to(output.dtype))

    def forward_mqa(self, q, kv_cache, attn_metadata, layer):
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        self.mqa_queries.append(q.clone())
        qf = q.float() * (layer._q_scale.float() if is_fp8(q) else 1.0)
        rows = kv_cache.reshape(-1, L + R)[attn_metadata.decode.slots].float()
        if is_fp8(kv_cache):
            rows = rows * layer._k_scale.float()
        score = (qf * rows[:, None, :]).sum(dim=-1, keepdim=True)
        out = 0.5 * qf[..., :L] + 0.01 * score * rows[:, None, :L]
        return out.to(self.dtype), None


def install_reference_cache_write() -> None:
    from vllm import _custom_ops
    from vllm.v1.attention.backend import MLAAttentionImpl

    StubImpl.do_kv_cache_update = MLAAttentionImpl.do_kv_cache_update
    _custom_ops.concat_and_cache_mla = reference_concat_and_cache


def concat_quant_fp8(ql_nope, q_pe, scale):
    """Upstream's decode concat + static fp8 quant (QuantFP8.forward_native)."""
    dtype = fp8_dtype()
    finfo = torch.finfo(dtype)
    x = torch.cat((ql_nope, q_pe), dim=-1).float() * scale.float().reciprocal()
    return x.clamp(finfo.min, finfo.max).to(dtype)


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bit patterns as integers ordered like the values (+0 == -0)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.contiguous().view(ints).to(torch.int64)
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal or adjacent representable values, in the tensors' own float type
    (a raw uint8 cache is read as fp8 codes)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    far = (_ordered_bits(actual) - _ordered_bits(expected)).abs() > 1
    assert not far.any(), f"{what}: {int(far.sum())} values differ by more than one ulp"


def assert_same_cache(fused: torch.Tensor, unfused: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows without a slot untouched, kv_c part bit-exact, rotated part one ulp."""
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=slots.device)
    written[slots[slots >= 0]] = True
    f = fused.view(-1, L + R)
    u = unfused.view(-1, L + R)
    def as_bytes(t):
        return t.contiguous().view(torch.uint8)

    assert torch.equal(as_bytes(f[~written]), as_bytes(u[~written])), "rows without a slot changed"
    assert torch.equal(as_bytes(f[written, : L]), as_bytes(u[written, : L])), "kv_c part differs"
    assert_within_one_ulp(f[written, L :], u[written, L :], "rotated k_pe part")


def make_layer(case: Case, dtype: torch.dtype = torch.float32):
    """An MLAAttention with the attributes forward / forward_impl read."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    install_reference_cache_write()
    g = torch.Generator().manual_seed(3)
    layer = object.__new__(MLAAttention)
    torch.nn.Module.__init__(layer)
    layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim = N, P, R
    layer.v_head_dim, layer.kv_lora_rank, layer.head_size = V, L, L + R
    layer.qk_head_dim = P + R
    layer.layer_name = LAYER_NAME
    layer.kv_cache_dtype = case.kv_cache_dtype
    layer.use_sparse = False
    layer.use_pcp = False
    layer.pcp_shard_decode_requests = False
    layer.hisparse_cache = None
    layer.kv_sharing_target_layer_name = None
    layer.q_pad_num_heads = None
    layer.dcp_q_replicate = False
    layer.dcp_manager = None
    layer.prefill_backend = None
    layer.is_aiter_triton_fp4_bmm_enabled = False
    layer.is_aiter_triton_fp8_bmm_enabled = False
    layer.is_amx_bmm_enabled = False
    layer.use_direct_call = True
    layer.impl = StubImpl(case.quant_query, dtype)
    layer.W_UK_T = (torch.randn(N, P, L, generator=g) / 2).to(dtype)
    if exact_fp8(case):
        # With a one-hot q_nope, ql_nope is an fp8 value times Q_SCALE.
        layer.W_UK_T = _fp8_values((N, P, L), g, Q_SCALE).to(dtype)
    layer.W_UK_T_dcp_qrep = None
    layer.W_UV_dcp = None
    layer.W_UV = (torch.randn(N, L, V, generator=g) / 2).to(dtype)
    layer.W_UK_T, layer.W_UV = layer.W_UK_T.to(DEVICE), layer.W_UV.to(DEVICE)
    layer._k_scale = torch.tensor(K_SCALE, device=DEVICE)
    layer._k_scale_float = K_SCALE
    layer._q_scale = torch.tensor(Q_SCALE, device=DEVICE)
    layer._q_scale_float = Q_SCALE
    layer._decode_concat_quant_fp8_op = concat_quant_fp8
    layer.rope_kv_fusion = None  # upstream path; the fused tests replace it
    return layer


def make_inputs(case: Case, dtype: torch.dtype = torch.float32) -> dict:
    """Batch [decodes | prefill | padding] with a randomly laid out cache."""
    g = torch.Generator().manual_seed(11 + len(case.name))
    real = case.num_decode + case.num_prefill
    total = real + case.pad
    q = torch.randn(total, N, P + R, generator=g).to(dtype)
    kv_lora = torch.randn(total, L + R, generator=g).to(dtype)  # k_pe is a strided view
    kv_c = torch.randn(total, L, generator=g).to(dtype)
    positions = torch.randint(0, MAX_POS, (total,), generator=g)
    positions[0] = MAX_POS - 1
    positions[real:] = 0
    if exact_fp8(case):
        positions.zero_()
        q = _fp8_values(q.shape, g, Q_SCALE).to(dtype)
        q[..., :P] = torch.nn.functional.one_hot(torch.randint(0, P, (total, N), generator=g),
                                                 P).to(dtype)
        kv_lora = _fp8_values(kv_lora.shape, g, K_SCALE).to(dtype)
        kv_c = _fp8_values(kv_c.shape, g, K_SCALE).to(dtype)
    # Slots in randomly permuted blocks, block 0 never used.
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=g) + 1
    slots = torch.stack([blocks * BLOCK_SIZE + off for off in range(BLOCK_SIZE)], 1).flatten()
    slots = slots[torch.randperm(slots.numel(), generator=g)][:real]
    slot_mapping = torch.full((total,), -1, dtype=torch.int64)
    slot_mapping[:real] = slots
    if case.kv_cache_dtype.startswith("fp8"):
        cache = torch.randint(0, 120, (NUM_BLOCKS, BLOCK_SIZE, L + R), generator=g,
                              dtype=torch.uint8)
    else:
        cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, L + R, generator=g).to(dtype)
    q, kv_lora, kv_c, positions, slot_mapping, cache = (
        t.to(DEVICE) for t in (q, kv_lora, kv_c, positions, slot_mapping, cache))
    decode = types.SimpleNamespace(slots=slot_mapping[: case.num_decode]) if case.num_decode else None
    metadata = types.SimpleNamespace(
        num_actual_tokens=real,
        num_decode_tokens=case.num_decode,
        num_decodes=case.num_decode,
        num_prefills=1 if case.num_prefill else 0,
        decode=decode,
        prefill=None,
        mla_rope_rows=step_rows(positions, slot_mapping, case.num_decode, real),
    )
    return {"q": q, "kv_lora": kv_lora, "kv_c": kv_c, "positions": positions, "slot_mapping": slot_mapping,
                "kv_cache": cache, "metadata": metadata}


def step_rows(positions, slot_mapping, num_decode_tokens, num_tokens):
    """The step's rows as MLACommonMetadataBuilder.build() makes them (None
    on a pristine tree, which has no fusion)."""
    try:
        from vllm.model_executor.layers.attention.mla_rope_kv_cache import (
            build_mla_rope_step_rows,
        )
    except ImportError:
        return None
    return build_mla_rope_step_rows(positions, slot_mapping, num_decode_tokens, num_tokens)


@contextlib.contextmanager
def forward_context(layer, inputs):
    """What MLAAttention.forward and the custom ops look up at run time."""
    import vllm.model_executor.layers.attention.mla_attention as mla

    ctx = types.SimpleNamespace(attn_metadata=inputs["metadata"],
                                slot_mapping={LAYER_NAME: inputs["slot_mapping"]})
    saved = mla.get_forward_context, mla.get_attention_context
    mla.get_forward_context = lambda: ctx
    mla.get_attention_context = lambda name: (
        inputs["metadata"], layer, layer.kv_cache, inputs["slot_mapping"])
    try:
        yield
    finally:
        mla.get_forward_context, mla.get_attention_context = saved


def run(layer, rope, inputs: dict, *, via: str, fused: bool) -> dict:
    """One forward; returns the output, the cache bytes and the MQA queries.

    via: "impl" (forward_impl after the steps MLAAttention.forward does),
    "forward" (MLAAttention.forward, direct call) or "op" (forward through the
    custom ops).  Unfused, RoPE is applied first, as the wrapper does.
    """
    q = inputs["q"].clone()
    k_pe = inputs["kv_lora"].clone()[:, L:].unsqueeze(1)
    kv_c = inputs["kv_c"].clone()
    positions = inputs["positions"]
    slots = inputs["slot_mapping"]
    md = inputs["metadata"]
    layer.kv_cache = inputs["kv_cache"].clone()
    layer.impl.mqa_queries.clear()
    CACHE_WRITES[0] = 0
    if not fused:
        q[..., P:], k_pe = rope.forward_native(positions, q[..., P:], k_pe)
    kw = {"positions": positions} if fused else {}
    if via == "impl":
        output = torch.empty(q.shape[0], N * V, dtype=q.dtype, device=q.device)
        if fused:
            kw["slot_mapping"] = slots
        else:
            layer.update_kv_cache(kv_c, k_pe, layer.kv_cache, slots, md, layer.kv_cache_dtype,
                                  layer._k_scale)
        layer.forward_impl(q, kv_c, k_pe, layer.kv_cache, md, output, **kw)
    else:
        layer.use_direct_call = via == "forward"
        with forward_context(layer, inputs):
            output = layer.forward(q, kv_c, k_pe, output_shape=(q.shape[0], N * V), **kw)
        layer.use_direct_call = True
    real = md.num_actual_tokens
    return {"output": output[:real].clone(), "cache": layer.kv_cache.clone(),
                "mqa_q": [t.clone() for t in layer.impl.mqa_queries], "cache_writes": CACHE_WRITES[0]}


def upstream_results() -> dict:
    """Every case, unfused, through forward and through the custom ops."""
    results = {}
    for case in CASES:
        rope = make_rope(case.rope)
        for via in ("forward", "op"):
            layer = make_layer(case)
            results[f"{case.name}/{via}"] = run(layer, rope, make_inputs(case), via=via,
                                                fused=False)
    return results


if __name__ == "__main__":
    torch.save(upstream_results(), sys.argv[1])
