"""What a custom op's dispatch costs on the host, by how it is called (any machine).

vLLM calls its attention-side custom ops through ``torch.ops.vllm`` with a
Python implementation (``direct_register_custom_op``).  This times one call of
ops registered with the schemas of 0303's ``mla_rope_concat_and_cache`` (16
parameters, two mutated) and of upstream's ``unified_mla_kv_cache_update`` (5),
each with an implementation that does nothing but return, called with keyword
arguments and positionally; beside them a plain Python call of the same
function.  Host µs per call, 3000 calls, median of 9 rounds interleaved across
the ways.  Not a pytest suite: a diagnostic, logged in
``results/logs/*-dispatch-cost.log``.

Run: ``python3 benchmarks/dispatch_cost.py``
"""

from __future__ import annotations

import statistics
import time

import torch

CALLS, ROUNDS = 3000, 9

FUSED_DECODE = (
    "fused_decode(Tensor ql_nope, Tensor q_pe, Tensor kv_c, Tensor k_pe, "
    "Tensor(a!) kv_cache, Tensor(b!) q_out, Tensor slot_mapping, Tensor positions, "
    "Tensor cos_sin_cache, bool is_neox, str kv_cache_dtype, Tensor k_scale, "
    "Tensor? q_scale, bool use_aiter, bool all_q_rope, str layer_name) -> ()"
)
CACHE_UPDATE = (
    "cache_update(Tensor kv_c, Tensor k_pe, str layer_name, str kv_cache_dtype, "
    "Tensor k_scale) -> Tensor"
)


def _nothing(*args, **kwargs):
    return None


def _empty(kv_c, k_pe, layer_name, kv_cache_dtype, k_scale):
    return torch.empty(0, device=kv_c.device, dtype=kv_c.dtype)


def host_us(fns: dict) -> dict:
    samples: dict = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            samples[name].append((time.perf_counter() - start) / CALLS * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    lib = torch.library.Library("dispatch_cost", "FRAGMENT")
    lib.define(FUSED_DECODE)
    lib.define(CACHE_UPDATE)
    for key in ("CPU", "CUDA"):
        lib.impl("fused_decode", _nothing, key)
        lib.impl("cache_update", _empty, key)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.zeros(4, device=dev)
    index = torch.zeros(2, dtype=torch.long, device=dev)
    decode = dict(
        ql_nope=t, q_pe=t, kv_c=t, k_pe=t, kv_cache=t, q_out=t, slot_mapping=index,
        positions=index, cos_sin_cache=t, is_neox=False, kv_cache_dtype="auto", k_scale=t,
        q_scale=None, use_aiter=False, all_q_rope=False,
        layer_name="model.layers.0.self_attn.attn",
    )
    update = dict(kv_c=t, k_pe=t, layer_name="model.layers.0.self_attn.attn",
                  kv_cache_dtype="auto", k_scale=t)
    ops = torch.ops.dispatch_cost
    decode_args, update_args = tuple(decode.values()), tuple(update.values())
    times = host_us({
        "python_call": lambda: _nothing(**decode),
        "fused_decode_keywords": lambda: ops.fused_decode(**decode),
        "fused_decode_positional": lambda: ops.fused_decode(*decode_args),
        "cache_update_keywords": lambda: ops.cache_update(**update),
        "cache_update_positional": lambda: ops.cache_update(*update_args),
    })
    print("torch", torch.__version__, "device", dev, flush=True)
    for name, us in times.items():
        print(f"  {name:26s} {us:6.2f} us")


if __name__ == "__main__":
    main()
