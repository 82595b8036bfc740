"""The fused RoPE + KV-cache custom ops: opcheck and torch.compile.

``torch.ops.vllm.mla_rope_concat_and_cache`` (decode form) and
``torch.ops.vllm.mla_rope_and_cache`` (prefill form) are registered by
``mla_rope_kv_cache.py`` with fake implementations.  ``opcheck`` checks the
declared mutations against what the kernels write, the fake implementations
and AOT dispatch; a ``torch.compile(fullgraph=True)`` trace goes through the
fake implementations and must read the positions at run time (a second call
with other positions reuses the graph and follows them).
"""

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

import _mla_rope_harness as h
import vllm.model_executor.layers.attention.mla_rope_kv_cache  # noqa: F401
from torch._dynamo.testing import CompileCounterWithBackend

DECODE_OP = torch.ops.vllm.mla_rope_concat_and_cache.default
PREFILL_OP = torch.ops.vllm.mla_rope_and_cache.default
NUM_DECODE, NUM_TOKENS = 2, 5


def _batch(seed: int = 0, positions: torch.Tensor | None = None) -> dict:
    """[2 decode | 3 prefill] tokens, the last one padding (slot -1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(NUM_TOKENS, h.N, h.P + h.R, generator=g)
    kv_lora = torch.randn(NUM_TOKENS, h.L + h.R, generator=g)
    slots = torch.randperm((h.NUM_BLOCKS - 1) * h.BLOCK_SIZE, generator=g)[:NUM_TOKENS]
    slots = slots + h.BLOCK_SIZE
    slots[-1] = -1
    if positions is None:
        positions = torch.randint(0, h.MAX_POS, (NUM_TOKENS,), generator=g)
    batch = {
        "q": q,
        "k_pe": kv_lora[:, h.L:].unsqueeze(1),  # strided, as the wrapper hands it over
        "kv_c": torch.randn(NUM_TOKENS, h.L, generator=g),
        "ql_nope": torch.randn(NUM_DECODE, h.N, h.L, generator=g),
        "kv_cache": torch.randn(h.NUM_BLOCKS, h.BLOCK_SIZE, h.L + h.R, generator=g),
        "q_out": torch.empty(NUM_DECODE, h.N, h.L + h.R),
        "slots": slots,
        "positions": positions,
        "cos_sin_cache": h.make_rope("deepseek_yarn").cos_sin_cache,
        "k_scale": torch.tensor(1.0),
    }
    return {k: v.to(h.DEVICE) for k, v in batch.items()}


def _decode_args(b: dict) -> tuple:
    d = NUM_DECODE
    return (b["ql_nope"], b["q"][:d, :, h.P:], b["kv_c"][:d], b["k_pe"][:d], b["kv_cache"],
            b["q_out"], b["slots"][:d], b["positions"][:d], b["cos_sin_cache"], False, "auto",
            b["k_scale"], None, False, False)


def _prefill_args(b: dict) -> tuple:
    d = NUM_DECODE
    return (b["q"][d:, :, h.P:], b["kv_c"][d:], b["k_pe"][d:], b["kv_cache"], b["slots"][d:],
            b["positions"][d:], b["cos_sin_cache"], False, "auto", b["k_scale"])


@pytest.mark.parametrize("op, args", [(DECODE_OP, _decode_args), (PREFILL_OP, _prefill_args)],
                         ids=["decode_form", "prefill_form"])
def test_opcheck(op, args):
    torch.library.opcheck(op, args(_batch()))


def _both_forms(q, kv_c, k_pe, kv_cache, ql_nope, q_out, slots, positions, cos_sin_cache,
                k_scale):
    """What forward_impl does on a mixed batch: prefill rows, then decode rows."""
    d = ql_nope.shape[0]
    torch.ops.vllm.mla_rope_and_cache(q[d:, :, h.P:], kv_c[d:], k_pe[d:], kv_cache, slots[d:],
                                      positions[d:], cos_sin_cache, False, "auto", k_scale)
    # The step's kv_c / k_pe: the decode form reads their first d rows.
    torch.ops.vllm.mla_rope_concat_and_cache(ql_nope, q[:d, :, h.P:], kv_c, k_pe,
                                             kv_cache, q_out, slots[:d], positions[:d],
                                             cos_sin_cache, False, "auto", k_scale, None, False,
                                             False)
    return q_out.sum(dim=-1)


_STATE = ("q", "k_pe", "kv_cache", "q_out")


def _call(fn, b: dict) -> dict:
    b = {k: (v.clone() if k in _STATE else v) for k, v in b.items()}
    out = fn(b["q"], b["kv_c"], b["k_pe"], b["kv_cache"], b["ql_nope"], b["q_out"], b["slots"],
             b["positions"], b["cos_sin_cache"], b["k_scale"])
    return {"out": out, **{k: b[k] for k in _STATE}}


def test_compile_traces_fake_impls_and_reads_positions_at_run_time():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_both_forms, backend=counter, fullgraph=True, dynamic=False)
    first = _batch(seed=1)
    # Same shapes, other positions: must reuse the graph and follow them.
    second = {**first, "positions": torch.roll(first["positions"], 1)}
    assert not torch.equal(first["positions"], second["positions"])
    results = []
    for b in (first, second):
        eager, comp = _call(_both_forms, b), _call(compiled, b)
        for key in eager:
            assert torch.equal(eager[key], comp[key]), key
        results.append(eager)
    assert counter.frame_count == 1, "a new graph for new positions: positions were frozen"
    code = counter.graphs[0].code
    assert "mla_rope_and_cache" in code and "mla_rope_concat_and_cache" in code
    assert not torch.equal(results[0]["q_out"], results[1]["q_out"])
