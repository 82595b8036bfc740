#!/usr/bin/env python3
"""Tiny random checkpoints for the CPU engine, made here (no download, fixed seeds).

    python tiny_models.py llama DIR [--tokenizer]
    python tiny_models.py deepseek DIR [--q-lora-rank N] [--moe] [--tokenizer]

Run by a Python that has torch and transformers (the CPU tier's venv).  Both are
fp32, vocabulary 512, with a large init (peaked logits, so that greedy near-ties
that a harmless summation-order change could flip are unlikely):

  * ``llama``: 2 layers, hidden 128, 4 heads / 2 KV heads, head_dim 32 (the CPU
    attention kernels have no head_dim 16);
  * ``deepseek``: DeepSeek-V2-style MLA, 2 layers, hidden 64, 4 heads,
    kv_lora_rank 512 + qk_rope_head_dim 64 (the CPU MLA decode kernel's only
    head size, 576), qk_nope_head_dim 32, v_head_dim 32, YaRN RoPE with mscale
    (vLLM builds DeepseekScalingRotaryEmbedding, GPT-J style); q_lora_rank unset
    (q_proj) unless given; dense MLPs, or with ``--moe`` a 4-expert MoE (1 shared
    expert, top-2) in the second layer.

``--tokenizer`` adds a word-level tokenizer (``tokenizer.json``): ids 0-2 are
``<unk> <s> </s>``, the others the words ``w3`` ... ``w511``, so that decoding
random ids and encoding the text again gives the same ids (what ``vllm bench``'s
random dataset does); any other word is ``<unk>``.  Tools that need a tokenizer
(``vllm bench``, ``vllm serve``, ``mixed_batch.py``) then work offline.
"""

from __future__ import annotations

import argparse

VOCAB = 512
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1 (bos), 2 (eos)


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


def tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", model_max_length=4096)
    fast.save_pretrained(out_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="arch", required=True)
    for name in ("llama", "deepseek"):
        s = sub.add_parser(name)
        s.add_argument("dir")
        s.add_argument("--tokenizer", action="store_true")
        if name == "deepseek":
            s.add_argument("--q-lora-rank", type=int, default=None)
            s.add_argument("--moe", action="store_true")
    args = p.parse_args()
    if args.arch == "llama":
        llama(args.dir)
    else:
        deepseek(args.dir, args.q_lora_rank, args.moe)
    if args.tokenizer:
        tokenizer(args.dir)


if __name__ == "__main__":
    main()
