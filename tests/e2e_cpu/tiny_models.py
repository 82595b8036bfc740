"""Tiny random checkpoints for tests/e2e_cpu, made here (no download, fixed seeds).

Called by a Python with torch and transformers (the CPU tier's venv).  Both are
fp32, vocabulary 512, with a large init (peaked logits, so that greedy near-ties
that a harmless summation-order change could flip are unlikely):

  * ``llama``: 2 layers, hidden 128, 4 heads / 2 KV heads, head_dim 32 (the CPU
    attention kernels have no head_dim 16);
  * ``deepseek``: DeepSeek-V2-style MLA, 2 layers, hidden 64, 4 heads,
    kv_lora_rank 512 + qk_rope_head_dim 64 (the CPU MLA decode kernel's only
    head size, 576), YaRN RoPE with mscale; q_lora_rank unset (q_proj) unless
    given; dense MLPs, or with ``moe`` a 4-expert MoE (1 shared, top-2) in layer 2.
"""

from __future__ import annotations

VOCAB = 512


def llama(out_dir: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)


def deepseek(out_dir: str, q_lora_rank: int | None = None, moe: bool = False) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        # YaRN as DeepSeek-V2 ships it; vLLM maps it to "deepseek_yarn" (mscale
        # folded into the cos/sin cache and the softmax scale).
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        first_k_dense_replace=1 if moe else 2,  # layers from this index are MoE
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
