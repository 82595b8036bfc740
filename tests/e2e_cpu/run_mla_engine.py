"""Helper for test_cpu_mla_engine.py, run in a subprocess (one vLLM tree per process).

    python run_mla_engine.py make-model DIR [--q-lora-rank N] [--moe]
        Write the tiny random DeepSeek-V2-style checkpoint of
        tests/e2e_cpu/tiny_models.py to DIR: MLA (kv_lora_rank 512 + rope 64, the
        CPU MLA decode kernel's only head size), YaRN RoPE with mscale (vLLM's
        DeepseekScalingRotaryEmbedding, GPT-J style); q_lora_rank unset unless
        given; dense MLPs, or a tiny MoE in the second layer.
    python run_mla_engine.py run MODEL_DIR OUT_JSON [--dtype D] [--fake-aiter]
        Run the vLLM tree on PYTHONPATH (CPU platform, CPU_MLA backend,
        in-process engine core) on a fixed set of prompts with staggered output
        lengths; write the generated token ids, every step's composition, each
        MLA layer's RoPE + KV-cache path, the fused kernels' call counts and the
        KV-cache rows of every finished request whose blocks no later request
        reused (OUT_JSON, and OUT_JSON with .pt for the rows).

The CPU platform turns chunked prefill and prefix caching off for MLA, but
``long_prefill_token_threshold`` still splits the long prompt into chunks, so
steps are pure prefill (the first), pure decode, or mixed: decodes with the long
prompt's extends and fresh prompts admitted as slots free up (max_num_seqs <
number of prompts, staggered max_tokens).  No tokenizer: prompts and outputs are
token ids.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import random
import sys
import time
from pathlib import Path

VOCAB = 512  # tiny_models.VOCAB
MAX_NUM_SEQS = 4
BLOCK_SIZE = 16  # the CPU MLA backend's only block size
# (prompt length, max_tokens): more prompts than slots, finishing at different steps;
# the 100-token prompt is prefilled in LONG_PREFILL_CHUNK-token chunks, each after the
# first an extend over the chunks already cached.
REQUESTS = ((5, 8), (17, 5), (9, 11), (100, 6), (12, 9), (7, 4), (21, 7), (3, 10), (26, 5))
LONG_PREFILL_CHUNK = 32


def make_model(out_dir: str, q_lora_rank: int | None, moe: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tiny_models

    tiny_models.deepseek(out_dir, q_lora_rank, moe)


def prompts() -> list[list[int]]:
    rng = random.Random(4321)
    # Avoid the EOS id so that no request stops early by chance.
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n, _ in REQUESTS]


class StepRecorder:
    """Scheduler.schedule wrapped: each step's requests, and each request's blocks."""

    def __init__(self):
        self.steps: list[list] = []  # [req_id, kind, num_tokens, num_computed]
        self.blocks: dict[str, list[int]] = {}
        self.block_owner: dict[int, str] = {}  # last request given the block

    def engine_id(self, request_id: str) -> str:
        """The scheduler's id of a request (the engine appends a random suffix)."""
        (match,) = [r for r in self.blocks if r == request_id or r.startswith(request_id + "-")]
        return match

    def install(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        original = Scheduler.schedule
        recorder = self

        def schedule(sched, *args, **kwargs):
            out = original(sched, *args, **kwargs)
            recorder.record(sched, out)
            return out

        Scheduler.schedule = schedule

    def _add_blocks(self, req_id: str, block_ids) -> None:
        if not block_ids:
            return
        (group,) = block_ids  # one KV-cache group (all layers are MLA)
        self.blocks.setdefault(req_id, []).extend(group)
        for b in group:
            self.block_owner[b] = req_id

    def record(self, sched, out) -> None:
        computed = {}
        for r in out.scheduled_new_reqs:
            computed[r.req_id] = r.num_computed_tokens
            self.blocks[r.req_id] = []
            self._add_blocks(r.req_id, r.block_ids)
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            self._add_blocks(req_id, new_blocks)
        step = []
        for req_id, n in out.num_scheduled_tokens.items():
            c = computed[req_id]
            prompt_len = sched.requests[req_id].num_prompt_tokens
            kind = "decode" if c >= prompt_len else "extend" if c > 0 else "prefill"
            step.append([req_id, kind, n, c])
        if step:
            self.steps.append(step)


def chunk_long_prompts() -> None:
    """vLLM 0.34.0+: let ``long_prefill_token_threshold`` cut the long prompt.

    The CPU platform turns chunked prefill off for MLA
    (``CpuPlatform.check_and_update_config``), and since 0.34.0 the scheduler
    applies ``long_prefill_token_threshold`` only with chunked prefill on
    (0.33.0 applied it regardless), so the long prompt would be prefilled in one
    step and no extend would run.  After the platform's check this turns chunked
    prefill back on for the scheduler (prefix caching stays off; the token budget
    stays the platform's, larger than any prompt, so the threshold is the only
    cut).  The CPU_MLA backend runs the extends as 0.33.0 did: the MLA prefill's
    context path over the chunks already cached.  Same in both trees."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        model_config = vllm_config.model_config
        if model_config is not None and getattr(model_config, "use_mla", False):
            vllm_config.scheduler_config.enable_chunked_prefill = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def count_calls(module, names: list[str], counts: dict[str, int]) -> None:
    """Wrap module.<name> to count calls (the fused paths import them per call)."""
    for name in names:
        original = getattr(module, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(module, name, wrapper)


def layer_state(model) -> list[dict]:
    """Per MLA layer: name, RoPE + KV-cache path, and its cache tensor."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layers = []
    for module in model.modules():
        if isinstance(module, MLAAttention):
            fusion = getattr(module, "rope_kv_fusion", None)
            layers.append({"name": module.layer_name,
                           "path": fusion.decision.path.value if fusion else "unfused",
                           "reason": fusion.decision.reason if fusion else None,
                           "kv_cache": module.kv_cache})
    return layers


# Set by test_cpu_mla_engine.py for the fused runs: the fused paths are refused
# off CUDA/ROCm, so this helper makes the layers' facts say "GPU" (below).
FUSE_ON_CPU = "VLLM_TEST_MLA_ROPE_KV_FUSION_ON_CPU"


def fuse_on_cpu() -> None:
    """Let the fused paths run on the CPU engine (in-process, so this reaches
    every layer): the layers' RopeKVFacts say "GPU", CPU_MLA's cache writer
    counts as the standard one (it stores the rows concat_and_cache_mla
    stores; its only cache dtype is "auto"), and the AITER flags are read
    without @if_aiter_supported's ROCm check.  The decision itself
    (mla_rope_fusion.py) is unchanged."""
    import dataclasses

    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.layers.attention import mla_rope_kv_cache
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    flags = rocm_aiter_ops.is_mla_rope_kv_fusion_enabled.__func__.__wrapped__
    rocm_aiter_ops.is_mla_rope_kv_fusion_enabled = classmethod(lambda cls: flags(cls))
    facts_of = mla_rope_kv_cache.rope_kv_facts

    def rope_kv_facts(layer, rotary_emb):
        facts = facts_of(layer, rotary_emb)
        cpu_writer = type(layer.impl).do_kv_cache_update is CPUMLAImpl.do_kv_cache_update
        return dataclasses.replace(
            facts, gpu=True, backend_cache_writer=facts.backend_cache_writer and not cpu_writer)

    mla_rope_kv_cache.rope_kv_facts = rope_kv_facts


def run(model_dir: str, out_json: str, dtype: str, fake_aiter: bool) -> None:
    # BRIEF §2: torchvision/torchaudio/torchcodec builds that do not match the
    # CPU torch break vLLM's imports; none is needed for a text-only model.
    for name in ("torchvision", "torchaudio", "torchcodec"):
        sys.modules.setdefault(name, None)
    if fake_aiter:
        # The strict AITER fakes (tests/fakes), installed as real AITER would be.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes"))
        import fake_aiter

        aiter = fake_aiter.install()
        # An imported package has a __spec__; vLLM modules call find_spec("aiter")
        # at import (vllm/_aiter_ops.py, vllm/kernels/aiter_ops.py), which raises
        # ValueError for a sys.modules entry without one.
        for name, module in list(sys.modules.items()):
            if (name == "aiter" or name.startswith("aiter.")) and module.__spec__ is None:
                module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    # The fused kernels run under TRITON_INTERPRET=1 (tests/fakes/vllm_from_source.py).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes"))
    import vllm_from_source

    vllm_from_source.bind()
    t0 = time.time()
    recorder = StepRecorder()
    recorder.install()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    chunk_long_prompts()
    if os.environ.get(FUSE_ON_CPU) == "1":
        fuse_on_cpu()
    calls: dict[str, int] = {}
    try:
        from vllm.v1.attention.ops import triton_mla_rope_cache
    except ImportError:  # the pristine tree has no fused kernels
        triton_mla_rope_cache = None
    if triton_mla_rope_cache is not None:
        count_calls(triton_mla_rope_cache,
                    ["mla_rope_concat_and_cache", "mla_rope_and_cache"], calls)

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=256,
        block_size=BLOCK_SIZE,
        attention_backend="CPU_MLA",  # not AMX_MLA where the host has AMX
        # The CPU platform turns chunked prefill off for MLA, but the scheduler still
        # caps a long prompt's tokens per step at this threshold: extends.
        long_prefill_token_threshold=LONG_PREFILL_CHUNK,
        seed=0,
    )
    t_init = time.time() - t0
    ps = prompts()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False)
              for _, m in REQUESTS]
    t1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
    t_gen = time.time() - t1
    if fake_aiter:
        calls["aiter.fused_qk_rope_concat_and_cache_mla"] = len(aiter.mla_op.calls)

    (layers,) = llm.apply_model(layer_state)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    # KV rows of finished requests whose blocks no later request took over.
    # Tokens with a cache row: the prompt and every output token but the last.
    rows = {}
    intact = []
    for i, out in enumerate(outs):
        req_id = recorder.engine_id(out.request_id)
        blocks = recorder.blocks[req_id]
        if any(recorder.block_owner[b] != req_id for b in blocks):
            continue
        n = len(out.prompt_token_ids) + len(outputs[i]) - 1
        slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(n)])
        rows[str(i)] = torch.stack([layer["kv_cache"].flatten(0, 1)[slots] for layer in layers])
        intact.append(i)
    torch.save(rows, Path(out_json).with_suffix(".pt"))
    result = {
        "vllm_file": vllm.__file__,
        "dtype": dtype,
        "prompt_lens": [len(p) for p in ps],
        "outputs": outputs,
        "steps": recorder.steps,
        "blocks": [recorder.blocks[recorder.engine_id(o.request_id)] for o in outs],
        "intact_requests": intact,
        "layers": [{k: v for k, v in layer.items() if k != "kv_cache"} for layer in layers],
        "calls": calls,
        "init_s": round(t_init, 1),
        "generate_s": round(t_gen, 1),
    }
    with open(out_json, "w") as f:
        json.dump(result, f)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("dir")
    m.add_argument("--q-lora-rank", type=int, default=None)
    m.add_argument("--moe", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("out")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--fake-aiter", action="store_true")
    args = p.parse_args()
    if args.cmd == "make-model":
        make_model(args.dir, args.q_lora_rank, args.moe)
    else:
        run(args.model, args.out, args.dtype, args.fake_aiter)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip slow/hanging interpreter teardown of the engine
