"""MLAAttention with RoPE + KV-cache write fused vs upstream's unfused path.

The layer is built with ``object.__new__`` and a stub backend (see
``_mla_rope_harness.py``): vLLM's own ``forward`` / ``forward_impl`` /
``update_kv_cache`` run, the fused path through the Triton kernel (the
interpreter on the CPU tier), so only the RoPE / cache / query plumbing is
compared.  Rules: the ``kv_c`` part of every cache row bit-exact, the rotated
part within one ulp of the model dtype (one code for an fp8 cache), outputs
within the rounding that one ulp of RoPE can propagate through the stubs, and
untouched cache rows untouched.
"""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

import _mla_rope_harness as h
from vllm.model_executor.layers.attention.mla_rope_fusion import (
    RopeKVDecision,
    RopeKVPath,
)
from vllm.model_executor.layers.attention.mla_rope_kv_cache import (
    MLARopeKVFusion,
)

TRITON = RopeKVDecision(RopeKVPath.TRITON, "test", requested=True)


def _fuse(layer, rope):
    layer.rope_kv_fusion = MLARopeKVFusion(TRITON, rope, layer)
    return layer


def assert_same_output(fused: dict, unfused: dict, case: h.Case) -> None:
    # fp32 throughout; a one-ulp difference in a rotated value moves the stub
    # outputs (sums of a few dozen products) by far less than this.
    torch.testing.assert_close(fused["output"], unfused["output"], rtol=1e-5, atol=1e-6)
    assert len(fused["mqa_q"]) == len(unfused["mqa_q"]) == (1 if case.num_decode else 0)
    for qf, qu in zip(fused["mqa_q"], unfused["mqa_q"]):
        assert qf.dtype == qu.dtype and qf.shape == qu.shape
        p = h.L  # [ql_nope | rope(q_pe)]: the ql_nope part is a copy / the same quant
        assert torch.equal(qf[..., :p].contiguous().view(torch.uint8),
                           qu[..., :p].contiguous().view(torch.uint8)), "ql_nope part differs"
        h.assert_within_one_ulp(qf[..., p:].contiguous(), qu[..., p:].contiguous(),
                              "rotated q_pe of the MQA query")


@pytest.mark.parametrize("case", h.CASES, ids=lambda c: c.name)
def test_forward_impl_fused_matches_unfused(case):
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    unfused_layer = h.make_layer(case)
    unfused = h.run(unfused_layer, rope, inputs, via="impl", fused=False)
    fused_layer = _fuse(h.make_layer(case), rope)
    fused = h.run(fused_layer, rope, inputs, via="impl", fused=True)
    h.assert_same_cache(fused["cache"], unfused["cache"], inputs["slot_mapping"])
    assert_same_output(fused, unfused, case)
    if case.quant_query:
        assert h.is_fp8(fused["mqa_q"][0])
    # The fused layer wrote its cache itself: vLLM's cache write never ran.
    assert fused["cache_writes"] == 0 and unfused["cache_writes"] == 1


@pytest.mark.parametrize("via", ["forward", "op"])
def test_forward_paths_skip_the_separate_cache_update(via):
    """MLAAttention.forward, direct and through the custom ops, with positions."""
    case = h.CASES_BY_NAME["mixed_decode_first"]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    unfused_layer = h.make_layer(case)
    unfused = h.run(unfused_layer, rope, inputs, via=via, fused=False)
    fused_layer = _fuse(h.make_layer(case), rope)
    fused = h.run(fused_layer, rope, inputs, via=via, fused=True)
    h.assert_same_cache(fused["cache"], unfused["cache"], inputs["slot_mapping"])
    assert_same_output(fused, unfused, case)
    assert fused["cache_writes"] == 0 and unfused["cache_writes"] == 1


def test_compiled_forward_takes_positions_at_run_time():
    """torch.compile of MLAAttention.forward on the custom-op path: positions are
    a graph input (the attention op's positions argument; no kv_cache_dummy_dep:
    no cache update precedes it), one graph serves new positions, and the graph
    holds no RoPE and no unified_mla_kv_cache_update, so upstream's
    fuse_rope_kvcache_cat_mla pass has nothing to fuse a second time."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = h.CASES_BY_NAME["mixed_decode_first"]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    layer = _fuse(h.make_layer(case), rope)
    layer.use_direct_call = False

    def forward(q, kv_c, k_pe, positions):
        return layer.forward(q, kv_c, k_pe, output_shape=(q.shape[0], h.N * h.V),
                             positions=positions)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(forward, backend=counter, fullgraph=True, dynamic=False)
    for positions in (inputs["positions"], torch.roll(inputs["positions"], 1)):
        results = []
        for fn in (forward, compiled):
            layer.kv_cache = inputs["kv_cache"].clone()
            with h.forward_context(layer, inputs):
                out = fn(inputs["q"].clone(), inputs["kv_c"],
                         inputs["kv_lora"].clone()[:, h.L:].unsqueeze(1), positions)
            results.append((out, layer.kv_cache.clone()))
        assert torch.equal(results[0][0], results[1][0])
        assert torch.equal(results[0][1], results[1][1])
    assert counter.frame_count == 1
    graph = counter.graphs[0].graph
    (attn,) = [n for n in graph.nodes if "unified_mla_attention_with_output" in str(n.target)]
    positions = attn.kwargs["positions"]
    assert positions.op == "placeholder" and "positions" in positions.name
    assert attn.kwargs["kv_cache_dummy_dep"] is None
    targets = " ".join(str(n.target) for n in graph.nodes)
    assert "unified_mla_kv_cache_update" not in targets and "rotary" not in targets


def test_positions_without_a_fusing_layer_are_refused():
    case = h.CASES_BY_NAME["decode_only"]
    layer = h.make_layer(case)
    inputs = h.make_inputs(case)
    with pytest.raises(AssertionError):
        layer.forward(inputs["q"], inputs["kv_c"], inputs["kv_lora"][:, h.L:].unsqueeze(1),
                      output_shape=(inputs["q"].shape[0], h.N * h.V),
                      positions=inputs["positions"])


def test_positions_with_a_prepared_mqa_query_are_refused():
    """A prepared MQA query (0.34.0's early cache write for indexer models) has
    its cache rows written and its RoPE applied already; with positions the
    fused layer would rotate and write them a second time."""
    case = h.CASES_BY_NAME["decode_only"]
    rope = h.make_rope(case.rope)
    layer = _fuse(h.make_layer(case), rope)
    inputs = h.make_inputs(case)
    cache = inputs["kv_cache"].clone()
    layer.kv_cache = cache
    with pytest.raises(AssertionError, match="mqa_q_prepared"):
        layer.forward(inputs["q"], inputs["kv_c"], inputs["kv_lora"][:, h.L:].unsqueeze(1),
                      output_shape=(inputs["q"].shape[0], h.N * h.V),
                      positions=inputs["positions"],
                      mqa_q_prepared=torch.zeros_like(inputs["q"]))
    assert torch.equal(layer.kv_cache, inputs["kv_cache"])


def test_no_slot_mapping_applies_plain_rope():
    """No cache to write this step: RoPE only, then upstream's path."""
    case = h.CASES_BY_NAME["mixed_decode_first"]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    layer = _fuse(h.make_layer(case), rope)
    q = inputs["q"].clone()
    k_pe = inputs["kv_lora"].clone()[:, h.L:].unsqueeze(1)
    step, k_pe_out = layer.rope_kv_fusion.begin(layer, q, k_pe, inputs["kv_cache"],
                                                inputs["positions"], None, None)
    assert step is None
    q_ref, k_ref = rope.forward_native(inputs["positions"], inputs["q"][..., h.P:].clone(),
                                       inputs["kv_lora"][:, h.L:].unsqueeze(1).clone())
    assert torch.equal(q[..., h.P:], q_ref) and torch.equal(k_pe_out, k_ref)
    assert torch.equal(q[..., : h.P], inputs["q"][..., : h.P])


def test_two_layers_of_one_step_read_the_rows_the_builder_made(monkeypatch):
    """The step's rows are built once, with the metadata: two fused layers of
    one step build none and launch on the metadata's decode / prefill rows."""
    from vllm.model_executor.layers.attention import mla_attention, mla_rope_kv_cache
    from vllm.v1.attention.ops import triton_mla_rope_cache

    case = h.CASES_BY_NAME["mixed_decode_first"]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)  # the builder's work: the rows, once
    rows = inputs["metadata"].mla_rope_rows
    built = []

    def no_rows(*args):
        built.append(args)
        raise AssertionError("rows built per layer")

    monkeypatch.setattr(mla_attention, "build_mla_rope_step_rows", no_rows)
    monkeypatch.setattr(mla_rope_kv_cache, "build_mla_rope_step_rows", no_rows)
    launched = []
    for name in ("mla_rope_concat_and_cache", "mla_rope_and_cache"):
        kernel_fn = getattr(triton_mla_rope_cache, name)

        def spy(*args, _fn=kernel_fn, _name=name, **kwargs):
            launched.append((_name, args[-4], args[-3]))  # slot_mapping, positions
            return _fn(*args, **kwargs)

        monkeypatch.setattr(triton_mla_rope_cache, name, spy)
    for _ in range(2):
        h.run(_fuse(h.make_layer(case), rope), rope, inputs, via="impl", fused=True)
    assert not built
    want = [("mla_rope_and_cache", rows.prefill), ("mla_rope_concat_and_cache", rows.decode)]
    assert len(launched) == 2 * len(want)
    for (name, slots, positions), (want_name, want_rows) in zip(launched, want * 2):
        assert name == want_name
        assert slots is want_rows.slot_mapping and positions is want_rows.positions


def test_builder_makes_the_rows_once_per_step(monkeypatch):
    """MLACommonMetadataBuilder.build() splits the step's positions and slot
    mapping at num_decode_tokens, once, into the metadata."""
    import types

    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.backend import CommonAttentionMetadata

    calls = []
    real = mla_attention.build_mla_rope_step_rows
    monkeypatch.setattr(mla_attention, "build_mla_rope_step_rows",
                        lambda *a: calls.append(a) or real(*a))
    num_reqs = 3
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq_lens = torch.tensor([5, 9, 2], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens,
        num_reqs=num_reqs, num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=9,
        block_table_tensor=torch.zeros(num_reqs, 1, dtype=torch.int32),
        slot_mapping=torch.tensor([4, 8, 1, -1]), positions=torch.tensor([4, 8, 1, 0]),
        seq_lens_cpu_upper_bound=seq_lens,
    )
    builder = types.SimpleNamespace(
        metadata_cls=mla_attention.MLACommonMetadata, device=torch.device("cpu"),
        reorder_batch_threshold=1, query_len_support=mla_attention.QueryLenSupport.SINGLE_ONLY,
        use_pcp=False, dcp_world_size=1, build_mla_rope_rows=True,
        model_config=types.SimpleNamespace(get_head_size=lambda: 576),
        _build_decode=lambda **kwargs: None,
    )
    md = mla_attention.MLACommonMetadataBuilder.build(builder, 0, cm)
    assert len(calls) == 1 and md.num_decode_tokens == num_reqs
    rows = md.mla_rope_rows
    assert rows.decode.positions.tolist() == [4, 8, 1]
    assert rows.decode.slot_mapping.tolist() == [4, 8, 1]
    assert rows.prefill.positions.numel() == rows.prefill.slot_mapping.numel() == 0
    builder.build_mla_rope_rows = False  # no fused layer can be on: no rows
    assert mla_attention.MLACommonMetadataBuilder.build(builder, 0, cm).mla_rope_rows is None


@pytest.mark.parametrize("bad, error", [
    (dict(positions=torch.zeros(6)), "positions must be int32 or int64"),
    (dict(slot_mapping=torch.zeros(6, 2, dtype=torch.int64)), "slot_mapping must be a contig"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int64)), "slot_mapping has 4 rows"),
])
def test_step_rows_refuse_bad_indices(bad, error):
    from vllm.model_executor.layers.attention.mla_rope_kv_cache import (
        build_mla_rope_step_rows,
    )

    args = {"positions": torch.zeros(6, dtype=torch.int64),
            "slot_mapping": torch.zeros(6, dtype=torch.int32), **bad}
    with pytest.raises((TypeError, ValueError), match=error):
        build_mla_rope_step_rows(args["positions"], args["slot_mapping"], 2, 5)


def test_cache_without_rows_is_refused():
    """A runner that gave the builder no positions: the fused layer refuses
    to run rather than skip its cache write."""
    case = h.CASES_BY_NAME["mixed_decode_first"]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    layer = _fuse(h.make_layer(case), rope)
    with pytest.raises(RuntimeError, match="CommonAttentionMetadata.positions"):
        layer.rope_kv_fusion.begin(layer, inputs["q"].clone(), inputs["kv_lora"][:, h.L:],
                                   inputs["kv_cache"], inputs["positions"],
                                   inputs["slot_mapping"], None)


# --- flags off: byte-for-byte upstream --------------------------------------

def _pristine_tree(tmp_path_factory) -> Path | None:
    """A pristine tree of the pinned vLLM: $VLLM_PRISTINE_TREE, or the root
    commit (upstream) of the patched tree's git history."""
    env = os.environ.get("VLLM_PRISTINE_TREE")
    if env:
        return Path(env)
    import vllm

    tree = Path(vllm.__file__).resolve().parents[1]
    try:
        root = subprocess.run(["git", "-C", str(tree), "rev-list", "--max-parents=0", "HEAD"],
                              check=True, capture_output=True, text=True).stdout.split()[0]
        archive = subprocess.run(["git", "-C", str(tree), "archive", root, "vllm"],
                                 check=True, capture_output=True).stdout
    except (subprocess.CalledProcessError, IndexError, FileNotFoundError):
        return None
    out = tmp_path_factory.mktemp("pristine")
    tar_path = out / "vllm.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(out, filter="data")
    return out


@pytest.fixture(scope="module", autouse=True)
def _upstream_run(request, tmp_path_factory):
    """Start the pristine tree's run early, so that it overlaps the fused tests
    (only when a flags-off test is selected)."""
    if not any("flags_off" in item.name for item in request.session.items):
        yield None
        return
    tree = _pristine_tree(tmp_path_factory)
    if tree is None:
        yield "no pristine vLLM tree found (set VLLM_PRISTINE_TREE)"
        return
    out = tmp_path_factory.mktemp("upstream") / "results.pt"
    harness = Path(h.__file__).resolve()
    proc = subprocess.Popen([sys.executable, str(harness), str(out)], cwd=harness.parent,
                            env=dict(os.environ, PYTHONPATH=str(tree)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def upstream(_upstream_run):
    if isinstance(_upstream_run, str):
        pytest.skip(_upstream_run)
    proc, out = _upstream_run
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-6000:]
    return torch.load(out)


@pytest.mark.parametrize("via", ["forward", "op"])
@pytest.mark.parametrize("case", h.CASES, ids=lambda c: c.name)
def test_flags_off_is_upstream_byte_for_byte(upstream, case, via):
    layer = h.make_layer(case)
    assert layer.rope_kv_fusion is None
    got = h.run(layer, h.make_rope(case.rope), h.make_inputs(case), via=via, fused=False)
    want = upstream[f"{case.name}/{via}"]
    for key in ("output", "cache"):
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
        assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key
    assert len(got["mqa_q"]) == len(want["mqa_q"])
    for a, b in zip(got["mqa_q"], want["mqa_q"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
