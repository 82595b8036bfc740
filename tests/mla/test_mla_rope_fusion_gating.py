"""Which path an MLA layer takes (flags, AITER conditions, fallbacks) and its log line."""

import logging
from dataclasses import replace

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

import _mla_rope_harness as h
import vllm._aiter_ops as aiter_ops
from vllm import envs
from vllm._aiter_ops import rocm_aiter_ops
from vllm.model_executor.layers.attention import mla_rope_kv_cache
from vllm.model_executor.layers.attention.mla_rope_fusion import (
    RopeKVFacts,
    RopeKVPath,
    decide_rope_kv_path,
    log_rope_kv_decision,
    rope_fusion_problem,
)

FLAG_AITER = "VLLM_ROCM_USE_AITER_MLA_ROPE_KV_FUSION"
FLAG_TRITON = "VLLM_MLA_TRITON_ROPE_KV_FUSION"


@pytest.fixture
def flags(monkeypatch):
    """Set env vars, then re-snapshot rocm_aiter_ops; restored afterwards."""

    def set_flags(**values):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        rocm_aiter_ops.refresh_env_variables()

    yield set_flags
    monkeypatch.undo()
    rocm_aiter_ops.refresh_env_variables()


# --- env flags and their rocm_aiter_ops snapshot -----------------------------

@pytest.mark.parametrize("name, value, expected", [
    (FLAG_AITER, None, False),  # default off: never run on AMD hardware
    (FLAG_AITER, "1", True),
    (FLAG_AITER, "0", False),
    (FLAG_AITER, "false", False),
    (FLAG_TRITON, None, False),  # default off
    (FLAG_TRITON, "1", True),
    (FLAG_TRITON, "True", True),
])
def test_env_flags(flags, name, value, expected):
    flags(**{name: value})
    assert getattr(envs, name) is expected


@pytest.mark.parametrize("aiter, aiter_mla, fusion, expected", [
    ("1", "1", None, False),  # off by default, also with VLLM_ROCM_USE_AITER=1
    ("1", "1", "1", True),
    ("1", "1", "0", False),
    ("0", "1", "1", False),  # acts only with VLLM_ROCM_USE_AITER ...
    ("1", "0", "1", False),  # ... and AITER MLA
    (None, None, None, False),  # VLLM_ROCM_USE_AITER defaults to off
])
def test_aiter_flag_acts_only_with_aiter_mla(flags, monkeypatch, aiter, aiter_mla, fusion,
                                             expected):
    monkeypatch.setattr(aiter_ops, "is_aiter_found_and_supported", lambda: True)
    flags(VLLM_ROCM_USE_AITER=aiter, VLLM_ROCM_USE_AITER_MLA=aiter_mla, **{FLAG_AITER: fusion})
    assert rocm_aiter_ops.is_mla_rope_kv_fusion_enabled() is expected


def test_aiter_flag_is_off_without_a_supported_rocm_gpu(flags):
    flags(VLLM_ROCM_USE_AITER="1", VLLM_ROCM_USE_AITER_MLA="1", **{FLAG_AITER: "1"})
    assert not rocm_aiter_ops.is_mla_rope_kv_fusion_enabled()  # CPU tier: no ROCm


def test_flags_are_snapshotted_at_refresh(flags, monkeypatch):
    flags(**{FLAG_TRITON: "1"})
    monkeypatch.setenv(FLAG_TRITON, "0")  # no refresh: the snapshot stays
    assert rocm_aiter_ops.is_mla_triton_rope_kv_fusion_enabled() is True
    rocm_aiter_ops.refresh_env_variables()
    assert rocm_aiter_ops.is_mla_triton_rope_kv_fusion_enabled() is False


# --- the decision --------------------------------------------------------------

BASE = RopeKVFacts(
    triton_requested=False, aiter_requested=False, aiter_op_problem=None,
    aiter_op_all_q_rope=False, gpu=True, rope_problem=None, model_dtype="bfloat16",
    kv_cache_dtype="auto",
)
TRITON_ON = replace(BASE, triton_requested=True)
AITER_ON = replace(BASE, aiter_requested=True)

DECISIONS = [
    # (name, facts, path, words in the reason)
    ("flags_off", BASE, RopeKVPath.UNFUSED, "is off"),
    ("triton", TRITON_ON, RopeKVPath.TRITON, "VLLM_MLA_TRITON_ROPE_KV_FUSION=1"),
    ("triton_fp8_cache", replace(TRITON_ON, kv_cache_dtype="fp8"), RopeKVPath.TRITON, "Triton"),
    ("triton_fp32_model", replace(TRITON_ON, model_dtype="float32"), RopeKVPath.TRITON, "Triton"),
    ("aiter", AITER_ON, RopeKVPath.AITER, "fused_qk_rope_concat_and_cache_mla"),
    ("aiter_and_triton_flags", replace(AITER_ON, triton_requested=True), RopeKVPath.AITER, "AITER"),
    ("aiter_op_missing", replace(AITER_ON, aiter_op_problem="import failed: nope"),
     RopeKVPath.TRITON, "import failed: nope"),
    ("aiter_fp32_model", replace(AITER_ON, model_dtype="float32"), RopeKVPath.TRITON, "fp16/bf16"),
    ("aiter_dcp_without_all_q_rope", replace(AITER_ON, dcp_world_size=2), RopeKVPath.TRITON,
     "compute_all_q_rope"),
    ("aiter_dcp_with_all_q_rope", replace(AITER_ON, dcp_world_size=2, aiter_op_all_q_rope=True),
     RopeKVPath.AITER, "AITER"),
    ("triton_dcp", replace(TRITON_ON, dcp_world_size=4), RopeKVPath.TRITON, "Triton"),
    ("not_a_gpu", replace(TRITON_ON, gpu=False), RopeKVPath.UNFUSED, "not a CUDA or ROCm"),
    ("no_rotary", replace(AITER_ON, rope_problem="the model hands no rotary embedding"),
     RopeKVPath.UNFUSED, "no rotary embedding"),
    ("sparse", replace(AITER_ON, sparse=True), RopeKVPath.UNFUSED, "sparse MLA"),
    ("hisparse", replace(TRITON_ON, hisparse=True), RopeKVPath.UNFUSED, "HiSparse"),
    ("kv_sharing", replace(AITER_ON, kv_sharing=True), RopeKVPath.UNFUSED, "KV sharing"),
    ("fp8_ds_mla", replace(AITER_ON, kv_cache_dtype="fp8_ds_mla"), RopeKVPath.UNFUSED,
     "'fp8_ds_mla'"),
    ("fp8_e5m2", replace(TRITON_ON, kv_cache_dtype="fp8_e5m2"), RopeKVPath.UNFUSED, "'fp8_e5m2'"),
    ("cache_dtype_not_model_dtype", replace(TRITON_ON, kv_cache_dtype="float16"),
     RopeKVPath.UNFUSED, "differs from the model dtype"),
    ("pcp", replace(AITER_ON, pcp=True), RopeKVPath.UNFUSED, "prefill context parallelism"),
    ("dcp_q_replicate", replace(AITER_ON, dcp_world_size=2, aiter_op_all_q_rope=True,
                                dcp_q_replicate=True), RopeKVPath.UNFUSED, "q replication"),
    ("padded_query_heads", replace(TRITON_ON, q_pad_num_heads=128), RopeKVPath.UNFUSED,
     "pads the decode query"),
    ("backend_cache_writer", replace(AITER_ON, backend_cache_writer=True), RopeKVPath.UNFUSED,
     "do_kv_cache_update"),
]


@pytest.mark.parametrize("facts, path, words", [d[1:] for d in DECISIONS],
                         ids=[d[0] for d in DECISIONS])
def test_decision(facts, path, words):
    decision = decide_rope_kv_path(facts)
    assert decision.path is path
    assert words in decision.reason
    assert decision.requested == (facts.aiter_requested or facts.triton_requested)
    assert decision.fused == (path is not RopeKVPath.UNFUSED)
    assert decision.aiter_all_q_rope == (path is RopeKVPath.AITER and facts.dcp_world_size > 1)


def _rope(cls_name: str):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as re

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        if cls_name == "partial":
            return re.RotaryEmbedding(2 * h.R, h.R, h.MAX_POS, 10000.0, True, torch.float32)
        if cls_name == "DeepseekV4ScalingRotaryEmbedding":
            return re.DeepseekV4ScalingRotaryEmbedding(h.R, h.R, h.MAX_POS, 10000.0, False, 1.0,
                                                       torch.float32)
        if cls_name == "Llama3RotaryEmbedding":
            return re.Llama3RotaryEmbedding(h.R, h.R, h.MAX_POS, 10000.0, True, torch.float32,
                                            8.0, 1.0, 4.0, 16)
        if cls_name == "overridden":
            class Custom(re.RotaryEmbedding):
                def forward_native(self, positions, query, key=None):
                    return query, key

            return Custom(h.R, h.R, h.MAX_POS, 10000.0, True, torch.float32)
    return h.make_rope(cls_name)


@pytest.mark.parametrize("rope, problem", [
    ("neox", None),
    ("deepseek_yarn", None),
    ("Llama3RotaryEmbedding", None),  # only the cache differs
    ("partial", "partial rotary"),
    ("DeepseekV4ScalingRotaryEmbedding", "not a cos/sin lookup"),
    ("overridden", "Custom.forward_native is defined by Custom"),
])
def test_rope_fusion_problem(rope, problem):
    got = rope_fusion_problem(_rope(rope), h.R)
    assert got == problem if problem is None else problem in got


def test_rope_fusion_problem_without_rotary():
    assert "no rotary embedding" in rope_fusion_problem(None, h.R)


# --- the log line, once ----------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log_records():
    logger = logging.getLogger(mla_rope_kv_cache.__name__)
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_for_layer_logs_the_path_once(flags, monkeypatch, log_records):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    flags(**{FLAG_TRITON: "1"})
    rope = h.make_rope("deepseek_yarn")
    fusions = [mla_rope_kv_cache.MLARopeKVFusion.for_layer(h.make_layer(c), rope)
               for c in h.CASES[:3]]
    assert all(f is not None and f.decision.path is RopeKVPath.TRITON for f in fusions)
    assert fusions[0].is_neox is False and fusions[0].use_aiter is False
    assert log_records == [("MLA RoPE + KV-cache write: triton path "
                           "(VLLM_MLA_TRITON_ROPE_KV_FUSION=1: decode and prefill through the "
                           "Triton kernel).")]


def test_for_layer_falls_back_with_one_line(flags, monkeypatch, log_records):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    flags(**{FLAG_TRITON: "1"})
    rope = h.make_rope("neox")
    for case in h.CASES[:3]:
        layer = h.make_layer(case)
        layer.kv_cache_dtype = "fp8_ds_mla"
        assert mla_rope_kv_cache.MLARopeKVFusion.for_layer(layer, rope) is None
    assert len(log_records) == 1
    assert log_records[0].startswith("MLA RoPE + KV-cache write: unfused path (kv_cache_dtype "
                                     "'fp8_ds_mla'")


def test_for_layer_declines_a_kv_sharing_layer(flags, monkeypatch):
    """A layer reading another layer's cache writes none: its RoPE stays in the
    wrapper (upstream's path), whatever the flags."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    flags(**{FLAG_TRITON: "1"})
    layer = h.make_layer(h.CASES[0])
    layer.kv_sharing_target_layer_name = "model.layers.0.self_attn.attn"
    assert mla_rope_kv_cache.MLARopeKVFusion.for_layer(layer, h.make_rope("deepseek_yarn")) is None


def test_every_decision_logs_at_info_once():
    """Which path runs and why, also when nothing asked for a fusion (the
    AITER path not taken must be visible without debug logging)."""
    calls = []

    class Logger:
        def info_once(self, *args):
            calls.append(("info", args))

        def debug_once(self, *args):
            calls.append(("debug", args))

    log_rope_kv_decision(Logger(), decide_rope_kv_path(BASE))
    log_rope_kv_decision(Logger(), decide_rope_kv_path(TRITON_ON))
    assert [c[0] for c in calls] == ["info", "info"]
    assert "unfused path" in calls[0][1][0] % calls[0][1][1:]


def test_flags_off_gives_no_fusion(flags):
    flags(**{FLAG_TRITON: None, FLAG_AITER: None})
    layer = h.make_layer(h.CASES[0])
    assert mla_rope_kv_cache.MLARopeKVFusion.for_layer(layer, h.make_rope("neox")) is None
