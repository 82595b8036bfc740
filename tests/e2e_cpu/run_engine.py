"""Helper for test_cpu_engine.py, run in a subprocess (one vLLM tree per process).

    python run_engine.py make-model DIR
        Write the tiny random Llama of tests/e2e_cpu/tiny_models.py to DIR.
    python run_engine.py run MODEL_DIR OUT_JSON
        Run the vLLM tree on PYTHONPATH (CPU platform, in-process engine core)
        on a fixed mix of long and short prompts with chunked prefill and prefix
        caching; write the generated token ids and every scheduler step's
        composition to OUT_JSON.

No tokenizer: prompts are token ids (skip_tokenizer_init=True), outputs are
compared as token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

VOCAB = 512
BLOCK_SIZE = 32
MAX_BATCHED_TOKENS = 64
MAX_NUM_SEQS = 8
MAX_TOKENS = 16


def make_model(out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tiny_models

    tiny_models.llama(out_dir)


def prompts() -> list[list[int]]:
    """Short prompts first, then a long one that is chunked while the short ones
    decode, then a fresh prompt followed by prompts that share the long one's
    first blocks (prefix-cache hits: their first step is an extend), then more
    arrivals as slots free up (max_num_seqs=8 < 13 prompts)."""
    import random

    rng = random.Random(1234)

    def toks(n: int) -> list[int]:
        # Avoid the EOS id so that no request stops early by chance.
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    long_prompt = toks(300)
    shared = long_prompt[:160]
    out = [toks(7), toks(12), toks(5)]
    out.append(long_prompt)
    # A fresh prompt admitted in the same step as, and ahead of, prefix hits:
    # upstream's scheduler emits it before them (prefill before extend).
    out.append(toks(6))
    out.append(shared + toks(9))
    out.append(shared[:96] + toks(40))
    out += [toks(3), toks(21), toks(9), toks(130), toks(4)]
    out.append(long_prompt[:200] + toks(17))
    return out


def classify(computed: int, scheduled: int, prompt_len: int) -> str:
    if computed >= prompt_len:
        return "decode"
    kind = "extend" if computed > 0 else "prefill"
    if computed + scheduled < prompt_len:
        kind += "-chunk"  # this step does not finish the prompt
    return kind


def install_step_recorder(steps: list) -> None:
    """Wrap Scheduler.schedule to record each step's requests in emitted order."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        step = []
        for req_id, n in out.num_scheduled_tokens.items():
            prompt_len = self.requests[req_id].num_prompt_tokens
            c = computed[req_id]
            step.append([req_id, classify(c, n, prompt_len), n, c])
        if step:
            steps.append(step)
        return out

    Scheduler.schedule = schedule


def install_batch_recorder(batches: list) -> None:
    """Record the batch order the standalone CPU model runner makes of each step (its
    ``sort_batch_req_ids``; scripts/cpu_site/sitecustomize.py selects the runner).
    Upstream's returns the sorted req_ids; 0106's ``(req_ids, num_tokens, idx_mapping)``."""
    from vllm.v1.worker.cpu import standalone_model_runner as runner

    original = runner.sort_batch_req_ids

    def sort_batch_req_ids(*args, **kwargs):
        out = original(*args, **kwargs)
        batches.append(list(out[0] if isinstance(out, tuple) else out))
        return out

    runner.sort_batch_req_ids = sort_batch_req_ids


def model_runner_name(llm) -> str:
    try:
        return llm.collective_rpc(lambda worker: type(worker.model_runner).__name__)[0]
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"unknown ({exc!r})"


def run(model_dir: str, out_json: str) -> None:
    # BRIEF §2: torchvision/torchaudio/torchcodec builds that do not match the
    # CPU torch break vLLM's imports; none is needed for a text-only Llama.
    for name in ("torchvision", "torchaudio", "torchcodec"):
        sys.modules.setdefault(name, None)  # import raises ImportError, find_spec is None
    t0 = time.time()
    steps: list = []
    batches: list = []
    install_step_recorder(steps)
    install_batch_recorder(batches)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        seed=0,
    )
    t_init = time.time() - t0
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False
    )
    ps = prompts()
    t1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params)
    t_gen = time.time() - t1
    result = {
        "vllm_file": vllm.__file__,
        "model_runner": model_runner_name(llm),
        "prompt_lens": [len(p) for p in ps],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [o.num_cached_tokens for o in outs],
        "steps": steps,
        "batches": batches,
        "init_s": round(t_init, 1),
        "generate_s": round(t_gen, 1),
    }
    with open(out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make-model":
        make_model(sys.argv[2])
    elif cmd == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd!r}")
    sys.stdout.flush()
    os._exit(0)  # skip slow/hanging interpreter teardown of the engine
