# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host cost of 0302's AITER wrapper beside a plain call of AITER's op.

``models/kimi_k3/amd/mla.py`` calls AITER's ``fused_qk_rope_concat_and_cache_mla``
plainly: its inputs are already in the op's layouts and its cos / sin are its
own.  Dense MLA reaches the op from vLLM's layouts (a 3-D ``k_pe`` view, the
fp8 cache allocated as uint8, vLLM's ``cat(cos, sin)`` rotary cache), which
0302's wrapper maps; docs/topics.md says why that is needed.  This suite shows
what the mapping costs on the host.  Per case (MLA decode at DeepSeek-V3's
dims on 8 GPUs: 16 heads, L 512, R 64, bf16 model; ``T`` decode tokens; a bf16
or an fp8 cache with an fp8 query), host µs per call (``graphs.host_rounds``:
calls back to back, median of rounds interleaved across the calls, as
``bench_host_cost.py`` times) of:

  * ``plain``   -- ``aiter.ops.cache.fused_qk_rope_concat_and_cache_mla``
                   positionally, on inputs already in its layouts (the floor
                   every caller pays);
  * ``kimi_k3`` -- the op as ``models/kimi_k3/amd/mla.py`` calls it, with its
                   per-call work: the fp8 cache viewed as fp8 and as
                   ``[blocks, -1, L + R]``, ``q_out`` allocated, the slot
                   mapping flattened, ``k_pe`` squeezed, the positions sliced,
                   ``is_neox`` / ``is_nope_first`` by keyword (its cos / sin
                   are its own: here the same tables);
  * ``wrapper`` -- ``rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla`` by
                   keyword, as the fused layer's op calls it, on vLLM's layouts
                   and the step's cos / sin tables (``mla_rope_cos_sin``, built
                   once);
  * ``op``      -- ``torch.ops.vllm.mla_rope_concat_and_cache`` on the AITER
                   path: what a fused layer's decode calls once per layer
                   (``MLARopeKVStep.decode``), the dispatcher included.

With AITER on a ROCm GPU the op is AITER's.  Elsewhere it is a stand-in
registered with AITER's schema and export (``tests/fakes/aiter_export.py``,
``aiter_mla.py``) whose kernel does nothing, so the numbers are the host Python
of each way to the same op; each case records which (``op``).

Run (the patched tree): ``PYTHONPATH=build/vllm python3 -m pytest -q -s
benchmarks/bench_aiter_mla_host.py`` (``make bench-host`` runs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
aiter_ops = pytest.importorskip("vllm._aiter_ops")
if not hasattr(aiter_ops.rocm_aiter_ops, "mla_rope_cos_sin"):
    pytest.skip("needs the patched tree (make apply; PYTHONPATH=build/vllm)",
                allow_module_level=True)

from benchmarks import graphs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H, P, L, R = 16, 128, 512, 64  # heads per GPU (128 / TP 8), nope, latent, rotary
BLOCK_SIZE, NUM_BLOCKS, MAX_POS = 64, 64, 4096
TOKENS = (1, 16, 64)
CACHES = ("auto", "fp8")
CALLS, ROUNDS = 300, 7


def make_case(num_tokens: int, kv_cache_dtype: str, device, seed: int = 0) -> dict:
    """One layer's decode inputs in vLLM's layouts, the same in AITER's, and
    the four calls (each writes ``kv_cache`` and returns the ``q_out`` it
    wrote: the inputs' own, or for ``kimi_k3`` a new one)."""
    # Importing it registers torch.ops.vllm.mla_rope_concat_and_cache.
    import vllm.model_executor.layers.attention.mla_rope_kv_cache  # noqa: F401

    rocm_aiter_ops = aiter_ops.rocm_aiter_ops
    fp8 = kv_cache_dtype == "fp8"
    model, fp8_dtype = torch.bfloat16, aiter_ops.FP8_DTYPE
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=model)

    q = randn(num_tokens, H, P + R)
    kv = randn(num_tokens, L + R)
    inv = 1.0 / 10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    freqs = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv
    rotary_cache = torch.cat((freqs.cos(), freqs.sin()), -1).float().to(device)
    x = dict(
        # forward_impl: the bmm writes a dense [T, H, L]; q_pe a view of q.
        ql_nope=randn(num_tokens, H, L),
        q_pe=q[..., P:],
        kv_c=kv[:, :L],
        k_pe=kv[:, L:].unsqueeze(1),
        kv_cache=torch.zeros(NUM_BLOCKS, BLOCK_SIZE, L + R, device=device,
                             dtype=torch.uint8 if fp8 else model),
        q_out=torch.empty(num_tokens, H, L + R, device=device,
                          dtype=fp8_dtype if fp8 else model),
        slot_mapping=torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:num_tokens]
        .to(device),
        positions=torch.randint(0, MAX_POS, (num_tokens,), generator=g).to(device),
        tables=rocm_aiter_ops.mla_rope_cos_sin(rotary_cache, model),
        k_scale=torch.tensor([0.5], device=device),
        q_scale=torch.tensor([0.25], device=device) if fp8 else None,
    )
    unit = torch.ones(1, device=device)
    q_scale = x["q_scale"] if fp8 else unit

    from aiter.ops.cache import fused_qk_rope_concat_and_cache_mla as aiter_op

    plain_args = (
        x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"].squeeze(1),
        x["kv_cache"].view(fp8_dtype) if fp8 else x["kv_cache"], x["q_out"],
        x["slot_mapping"], x["k_scale"], q_scale, x["positions"],
        x["tables"][0], x["tables"][1], False, True,
    )  # fmt: skip

    def plain():
        aiter_op(*plain_args)
        return x["q_out"]

    def kimi_k3():  # mla.py (0.34.0) _fused_decode, from the cache view to the call
        kv_cache = x["kv_cache"]
        if fp8 and kv_cache.dtype != fp8_dtype:
            kv_cache = kv_cache.view(fp8_dtype)
        q_out = torch.empty((num_tokens, H, L + R), dtype=x["q_out"].dtype, device=device)
        slot_mapping = x["slot_mapping"].flatten()
        num_slots = slot_mapping.shape[0]
        aiter_op(
            x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"].squeeze(1),
            kv_cache.view(kv_cache.shape[0], -1, L + R), q_out, slot_mapping,
            x["k_scale"], q_scale, x["positions"][:num_slots],
            x["tables"][0], x["tables"][1], is_neox=False, is_nope_first=True,
        )  # fmt: skip
        return q_out

    def wrapper():
        rocm_aiter_ops.fused_qk_rope_concat_and_cache_mla(
            ql_nope=x["ql_nope"], q_pe=x["q_pe"], kv_c=x["kv_c"], k_pe=x["k_pe"],
            kv_cache=x["kv_cache"], q_out=x["q_out"], slot_mapping=x["slot_mapping"],
            positions=x["positions"], cos_sin=x["tables"], is_neox=False,
            k_scale=x["k_scale"], q_scale=q_scale, all_q_rope=False,
        )  # fmt: skip
        return x["q_out"]

    def op():
        torch.ops.vllm.mla_rope_concat_and_cache(
            x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"], x["kv_cache"],
            x["q_out"], x["slot_mapping"], x["positions"], x["tables"], False,
            kv_cache_dtype, x["k_scale"], x["q_scale"], True, False, "",
        )  # fmt: skip
        return x["q_out"]

    calls = {"plain": plain, "kimi_k3": kimi_k3, "wrapper": wrapper, "op": op}
    return dict(inputs=x, calls=calls)


@pytest.fixture(scope="module")
def aiter_op():
    """(what the op is, the device): AITER's on a ROCm GPU with AITER installed,
    else the no-op stand-in, installed for this module."""
    from vllm.platforms import current_platform

    try:
        import aiter  # noqa: F401

        real = current_platform.is_rocm()
    except ImportError:
        real = False
    if real:
        yield "aiter", torch.device("cuda")
        return
    sys.path.insert(0, str(REPO / "tests" / "fakes"))
    from aiter_export import AiterExport
    from aiter_mla import MLA_OP
    from aiter_mla import fused_qk_rope_concat_and_cache_mla as stub

    export = AiterExport()
    fn = export.register_guarded("aiter.ops.cache", stub, lambda *args: None)
    export.export_plain("aiter", MLA_OP, fn)
    export.install()
    aiter_ops._aiter_mla_rope_kv_op.cache_clear()
    try:
        yield "no-op stand-in", torch.device("cpu")
    finally:
        export.uninstall()
        aiter_ops._aiter_mla_rope_kv_op.cache_clear()


@pytest.mark.parametrize("kv_cache_dtype", CACHES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_aiter_mla_host(benchmark, aiter_op, num_tokens, kv_cache_dtype):
    what, device = aiter_op
    calls = make_case(num_tokens, kv_cache_dtype, device)["calls"]
    for fn in calls.values():  # warm up
        fn()
        fn()
    samples = graphs.host_rounds(calls, CALLS, ROUNDS)
    medians = {name: (graphs.median(v), min(v)) for name, v in samples.items()}
    results = {name: {"us": round(med, 2), "min_us": round(low, 2)}
               for name, (med, low) in medians.items()}
    case = f"d{num_tokens}_{kv_cache_dtype}"
    benchmark.extra_info.update(
        kernel="aiter_mla_host", case=case, op=what, device=str(device),
        results=results, shapes=dict(num_tokens=num_tokens, num_heads=H, kv_lora_rank=L,
                                     rope_dim=R, kv_cache_dtype=kv_cache_dtype),
        wrapper_over_plain_us=round(results["wrapper"]["us"] - results["plain"]["us"], 2),
    )
    benchmark.group = "aiter_mla_host"
    benchmark.pedantic(calls["wrapper"], rounds=3, iterations=100)
    line = "  ".join(f"{k}={v['us']}us" for k, v in results.items())
    print(f"\n[bench] aiter_mla_host/{case}: {line} (op: {what}, {device})", flush=True)
