"""Fixtures for the batch-order contract tests (issue 3).

The patched vLLM tree is on PYTHONPATH; the unpatched functions come from the
build tree's root commit (order_support.pristine_module), so one run shows the
bug before and the fix after.
"""

import json
from pathlib import Path

import pytest
from order_support import pristine_module


@pytest.fixture(scope="session")
def pristine():
    """Loader of pristine upstream modules: ``pristine(relpath, only=(...))``."""
    return pristine_module


# A config.json that is all the scheduler reads of facebook/opt-125m.
_STUB_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "max_position_embeddings": 32768,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


@pytest.fixture(scope="session")
def stub_model_dir(tmp_path_factory) -> Path:
    """A tmp HF cache holding a hand-written config.json; returns its snapshot.

    Laid out as the hub cache lays out facebook/opt-125m; the model is named by
    its snapshot path, so nothing depends on when the hub read HF_HOME.
    """
    hf_home = tmp_path_factory.mktemp("hf_home")
    repo = hf_home / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps(_STUB_CONFIG))
    return snapshot


@pytest.fixture
def make_scheduler(stub_model_dir, monkeypatch):
    """Build a Scheduler (any class with upstream's constructor) on CPU."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def make(
        scheduler_cls,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        long_prefill_token_threshold: int = 0,
        block_size: int = 16,
        num_blocks: int = 10000,
    ):
        import torch

        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.core.single_type_kv_cache_manager import (
            register_all_kvcache_specs,
        )
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        max_model_len = 8192
        model_config = ModelConfig(
            model=str(stub_model_dir),
            dtype="float16",
            seed=42,
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        )
        cache_config = CacheConfig(
            block_size=block_size,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=True,
        )
        vllm_config = VllmConfig(
            scheduler_config=scheduler_config,
            model_config=model_config,
            cache_config=cache_config,
            # Explicit: vLLM may have resolved its platform before this fixture
            # set VLLM_TARGET_DEVICE (then it finds no device to infer).
            device_config=DeviceConfig(device="cpu"),
        )
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        cache_config.num_gpu_blocks = num_blocks
        register_all_kvcache_specs(vllm_config)
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            block_size=block_size,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(vllm_config),
        )
        return scheduler

    return make
