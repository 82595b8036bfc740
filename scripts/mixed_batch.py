#!/usr/bin/env python3
"""The order-contract case of scripts/e2e.py (docs/sweeps-and-e2e.md), run by an install's Python.

With the engine core in this process, steps hold a decode, an extend (a later chunk of a
long prompt that starts with a secret number and ends asking for it) and a fresh prefill
together; ``--mode reference`` runs each prompt alone, unchunked.  Writes ``--out``: each
request's text, whether the answer holds the number, each step's kinds.  Other arguments are
vLLM's engine flags (``--attention-backend`` overrides ROCM_AITER_FA).
"""

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
SHORT_PROMPTS = ("Count from one to twenty in words: one, two, three,",
                 "The days of the week, starting on Monday: Monday, Tuesday,",
                 "The months of the year: January, February, March,",
                 "The first ten prime numbers: 2, 3, 5,")
ANSWER_TOKENS = 16
DECODER_PROMPT = "Write the numbers from 1 to 200 separated by commas: 1, 2, 3, 4,"
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
        if rid not in prompt_lens:
            kinds[rid] = "other"
        elif done >= prompt_lens[rid]:
            kinds[rid] = "decode"
        else:
            kinds[rid] = "extend" if done > 0 else "prefill"
    return kinds


def parse_engine_args(tokens: list[str]) -> dict:
    """['--max-num-seqs', '64', '--enforce-eager', '--dtype=half'] -> {'max_num_seqs': 64,
    'enforce_eager': True, 'dtype': 'half'}: the LLM(...) keywords of vLLM's flags."""
    out: dict = {}
    name = None
    for tok in tokens:
        if tok.startswith("--"):
            flag, sep, value = tok[2:].partition("=")
            name = flag.replace("-", "_")
            out[name] = True  # a flag without a value
            if not sep:
                continue
        elif name is None:
            raise ValueError(f"engine argument {tok!r} does not follow a --flag")
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
    parser.add_argument("--mode", choices=("mixed", "reference"), required=True)
    parser.add_argument("--out", required=True)
    args, engine_tokens = parser.parse_known_args(argv)
    # In-process engine core: a request added between two steps joins the next schedule.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams

    max_model_len = LONG_PROMPT_LEN + 512
    kwargs = dict(model=args.model, max_model_len=max_model_len, enable_prefix_caching=False,
                  seed=0, attention_backend="ROCM_AITER_FA")
    if args.mode == "mixed":
        kwargs.update(enable_chunked_prefill=True,
                      max_num_batched_tokens=CHUNK + 2048,  # room for the short ones
                      long_prefill_token_threshold=CHUNK)
    else:  # every prompt whole in one step: no chunking, no extend
        kwargs.update(max_num_batched_tokens=max_model_len, long_prefill_token_threshold=0)
    kwargs.update(parse_engine_args(engine_tokens))
    llm = LLM(**kwargs)
    tokenizer = llm.get_tokenizer()

    def encode(text: str, special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=special)

    code = str(random.Random(0).randint(100000, 999999))
    long_steps = -(-LONG_PROMPT_LEN // CHUNK)
    requests = {"decoder": (encode(DECODER_PROMPT, True), long_steps + 16),
                "long": (build_long_prompt(encode, LONG_PROMPT_LEN, code), ANSWER_TOKENS)}
    for i, prompt in enumerate(SHORT_PROMPTS):
        requests[f"fresh-{i}"] = (encode(prompt, True), ANSWER_TOKENS)
    prompt_lens = {rid: len(ids) for rid, (ids, _) in requests.items()}

    def params(max_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    outputs: dict[str, str] = {}  # the text of each request
    steps: list[dict] = []          # each step's kind of each request (the engine's ids)
    if args.mode == "reference":
        for rid, (ids, max_tokens) in requests.items():  # one at a time: whole, unchunked
            out = llm.generate([{"prompt_token_ids": ids}], params(max_tokens), use_tqdm=False)
            outputs[rid] = out[0].outputs[0].text
    else:
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler  # vLLM 0.34.0's in-process layout
        original = scheduler.schedule

        def schedule(*a, **k):
            result = original(*a, **k)
            if result.total_num_scheduled_tokens:
                steps.append(step_kinds(result, prompt_lens))
            return result

        scheduler.schedule = schedule
        fresh = [rid for rid in requests if rid.startswith("fresh-")]
        internal: dict[str, str] = {}   # vLLM appends a random suffix to request ids

        def add(rid: str) -> str:
            ids, max_tokens = requests[rid]
            engine_id = engine.add_request(rid, {"prompt_token_ids": ids}, params(max_tokens))
            internal[engine_id] = rid
            prompt_lens[engine_id] = prompt_lens[rid]
            return engine_id

        def collect(results) -> None:
            for out in results:
                if out.finished:
                    outputs[internal.get(out.request_id, out.request_id)] = out.outputs[0].text

        add("decoder")
        collect(engine.step())          # the decoder's prefill: from now on it decodes
        long_id = add("long")
        while engine.has_unfinished_requests():
            collect(engine.step())
            if fresh and steps and steps[-1].get(long_id) in ("prefill", "extend"):
                add(fresh.pop(0))       # arrives while the long prompt is mid-prefill
        scheduler.schedule = original
    mixed = [s for s in steps if {"decode", "extend", "prefill"} <= set(s.values())]
    result = {"mode": args.mode, "model": args.model, "vllm": vllm.__version__,
              "engine_kwargs": {k: v for k, v in kwargs.items() if k != "model"},
              "needle": code, "needle_found": code in outputs.get("long", ""),
              "outputs": outputs, "steps": steps, "mixed_steps": len(mixed)}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"[mixed_batch] {args.mode}: needle found: {result['needle_found']}; mixed steps: "
          f"{len(mixed)}; {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
