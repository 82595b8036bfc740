#!/usr/bin/env python3
"""The order-contract case of scripts/e2e.py, run by an install's Python: a long prompt asking
for the secret number it starts with, prefilled in chunks alone (the reference), then in steps
that also hold a decode and a fresh prefill (docs/sweeps-and-e2e.md).  Writes --out: the verdict,
both answers, each step's kinds.  Other arguments are vLLM engine flags."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

NEEDLE = "Remember this carefully: the secret code is {code}.\n"
FILLER = ("Note {i}: the river passes the old mill, turns east near the orchard of "
          "house {j}, and reaches the harbour before dusk.\n")
QUESTION = ("\nQuestion: what is the secret code given at the very beginning of this text? "
            "Answer with the number only.\nAnswer: The secret code is")
DECODER_PROMPT = "Write the numbers from 1 to 200 separated by commas: 1, 2, 3, 4,"
FRESH_PROMPT = "The months of the year: January, February, March,"
FRESH = 4  # fresh prompts, one per step while the long prompt is prefilled
LONG_PROMPT_LEN = 12288
CHUNK = 2048  # long_prefill_token_threshold: the long prompt's tokens per step


def build_long_prompt(encode, length: int, code: str) -> list[int]:
    """Token ids: needle sentence, filler lines, question; exactly ``length`` tokens."""
    head = list(encode(NEEDLE.format(code=code), True))
    tail = list(encode(QUESTION, False))
    room = length - len(head) - len(tail)
    filler: list[int] = []
    i = 0
    while len(filler) < room:
        filler += list(encode(FILLER.format(i=i, j=(i * 7919) % 1000), False))
        i += 1
    return head + filler[:room] + tail


def step_kinds(out, prompt_lens: dict[str, int]) -> dict[str, str]:
    """Each request of a SchedulerOutput: decode (prompt done), extend (part cached), prefill."""
    computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    kinds = {}
    for rid in out.num_scheduled_tokens:
        done = computed.get(rid, 0)
        kinds[rid] = "decode" if done >= prompt_lens[rid] else "extend" if done else "prefill"
    return kinds


def verdict(mixed_steps: int, reference_found: bool, found: bool) -> str:
    if not mixed_steps:
        return "not-triggered"  # no step held decode + extend + prefill
    if not reference_found:
        return "inconclusive"   # the model cannot answer even without mixed steps
    return "pass" if found else "fail"


def parse_engine_args(tokens: list[str]) -> dict:
    """['--max-num-seqs', '64', '--enforce-eager', '--dtype=half'] -> {'max_num_seqs': 64,
    'enforce_eager': True, 'dtype': 'half'}: the LLM(...) keywords of vLLM's flags."""
    out: dict = {}
    for tok in tokens:
        if tok.startswith("--"):
            flag, sep, value = tok[2:].partition("=")
            name = flag.replace("-", "_")
            out[name] = True  # a flag without a value, unless one follows
            if not sep:
                continue
        else:
            value = tok
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args, engine_tokens = parser.parse_known_args(argv)
    # In-process engine core: a request added between two steps joins the next schedule.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, __version__

    kwargs = dict(model=args.model, max_model_len=LONG_PROMPT_LEN + 512, seed=0,
                  enable_prefix_caching=False, attention_backend="ROCM_AITER_FA",
                  enable_chunked_prefill=True, long_prefill_token_threshold=CHUNK,
                  max_num_batched_tokens=CHUNK + 2048)  # room for the short prompts
    kwargs.update(parse_engine_args(engine_tokens))
    llm = LLM(**kwargs)

    def encode(text: str, special: bool) -> list[int]:
        return llm.get_tokenizer().encode(text, add_special_tokens=special)

    def params(max_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    code = str(random.Random(0).randint(100000, 999999))
    long_prompt = {"prompt_token_ids": build_long_prompt(encode, LONG_PROMPT_LEN, code)}
    reference = llm.generate([long_prompt], params(16), use_tqdm=False)[0].outputs[0].text

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # vLLM 0.34.0's in-process layout
    original = scheduler.schedule
    prompt_lens: dict[str, int] = {}  # by the engine's request id
    steps: list[dict] = []

    def schedule(*a, **k):
        result = original(*a, **k)
        if result.total_num_scheduled_tokens:
            steps.append(step_kinds(result, prompt_lens))
        return result

    def add(rid: str, prompt: dict, max_tokens: int) -> str:
        engine_id = engine.add_request(rid, prompt, params(max_tokens))
        prompt_lens[engine_id] = len(prompt["prompt_token_ids"])
        return engine_id

    scheduler.schedule = schedule
    answers: dict[str, str] = {}
    decoder = {"prompt_token_ids": encode(DECODER_PROMPT, True)}
    add("decoder", decoder, LONG_PROMPT_LEN // CHUNK + 16)  # decodes while "long" is prefilled
    engine.step()                       # the decoder's prefill: from now on it decodes
    long_id = add("long", long_prompt, 16)
    fresh = FRESH
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                answers[out.request_id] = out.outputs[0].text
        if fresh and steps and steps[-1].get(long_id) in ("prefill", "extend"):
            add(f"fresh-{fresh}", {"prompt_token_ids": encode(FRESH_PROMPT, True)}, 16)
            fresh -= 1                  # it arrives while the long prompt is mid-prefill
    mixed = sum({"decode", "extend", "prefill"} <= set(step.values()) for step in steps)
    result = {"verdict": verdict(mixed, code in reference, code in answers.get(long_id, "")),
              "mixed_steps": mixed, "steps": len(steps), "needle": code,
              "reference_answer": reference, "answer": answers.get(long_id),
              "vllm": __version__, "engine_kwargs": kwargs, "step_kinds": steps}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"[mixed_batch] {result['verdict']}: {mixed} mixed steps; {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
