"""Where the eager MLA decode step's host time goes, call by call (GPU machine).

``bench_eager_step.py``'s decode-only MLA steps: the whole step of each side
per layer, and each call a layer makes (``MlaStep.parts``) on its own: one
torch op, the CUDA-graph piece of each side, our decode op through the
dispatcher and its implementation called directly, upstream's cache write op
and its decode query ``cat``.  Host µs per layer: a call repeated 61 times
with no synchronisation inside (a step, 61 times one layer's call), median
of 15 rounds interleaved across the calls.  Not a pytest suite: a
diagnostic, logged in ``results/logs/*-eager-mla-parts*.log``.

Run: ``PYTHONPATH=$T:vllm_overlay:tests/without_vllm:. python3 benchmarks/eager_mla_parts.py``
"""

from __future__ import annotations

import torch
import triton

from benchmarks import eager_ops, graphs

DECODES = (1, 16, 64)
ROUNDS = 15


def main() -> None:
    print("triton", triton.__version__, "torch", torch.__version__, flush=True)
    model, ops = eager_ops.DEEPSEEK_V3, eager_ops.upstream_ops()
    print("cache write:", ops.notes["cache_mla"], flush=True)
    caches = eager_ops.mla_caches(model, num_blocks=1024)
    layers = model["layers"]
    for decodes in DECODES:
        step = eager_ops.mla_step(model, caches, ops, decodes, 0)
        calls = {"step, ours": step.ours, "step, upstream": step.upstream}
        for fn in (*calls.values(), *step.parts.values()):  # compile, capture, warm up
            fn()
            fn()
        steps = graphs.host_rounds(calls, repeats=1, rounds=ROUNDS)
        parts = graphs.host_rounds(step.parts, repeats=layers, rounds=ROUNDS)
        print(f"== d{decodes}: host us per layer ({layers} layers)", flush=True)
        for name, samples in steps.items():
            print(f"  {name:32s} {graphs.median(samples) / layers:8.2f}", flush=True)
        for name, samples in parts.items():
            print(f"  {name:32s} {graphs.median(samples):8.2f}", flush=True)


if __name__ == "__main__":
    main()
