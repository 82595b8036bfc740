"""The batch from issue 3, before (pristine 0.34.0 functions) and after.

{decode: 1 token on 500 cached; fresh prefill: 100 tokens; extend: 2,048 tokens
on 8,192 cached}. Upstream Model Runner V2 and the standalone CPU model runner
both sort it [decode, prefill, extend] (decodes, then ascending token count) and
the split then reports 0 extends and 2 prefills: the extend would be attended
as a pure prefill, without its 8,192 cached tokens.
"""

from types import SimpleNamespace

import pytest
import torch
from order_support import (
    Row,
    cpu_order,
    cpu_req_states,
    cpu_sort_as_patched,
    honours_contract,
    make_cam,
    mrv2_order,
    mrv2_req_states,
    truth_counts,
)

DECODE = Row("dec", q=1, ctx=500, prompt=480)
PREFILL = Row("pre", q=100, ctx=0, prompt=100)
EXTEND = Row("ext", q=2048, ctx=8192, prompt=16384)
# The scheduler's emission: running (decode, chunked prefill), then the arrival.
EMITTED = [DECODE, EXTEND, PREFILL]
UPSTREAM_MRV2_ORDER = [DECODE, PREFILL, EXTEND]
UPSTREAM_CPU_ORDER = [DECODE, PREFILL, EXTEND]

UTILS = "vllm/v1/attention/backends/utils.py"
RUNNER = "vllm/v1/worker/gpu/model_runner.py"
CPU_RUNNER = "vllm/v1/worker/cpu/standalone_model_runner.py"


def test_issue_batch_misclassified_by_pristine_functions(pristine):
    sort = pristine(RUNNER, only=("sort_batch_req_ids",)).sort_batch_req_ids
    split = pristine(UTILS).split_decodes_prefills_and_extends

    order = sort({r.name: r.q for r in EMITTED}, {}, 1)
    assert order == [r.name for r in UPSTREAM_MRV2_ORDER]
    # 1 decode, 0 extends, 2 prefills: the extend is computed as a prefill.
    assert split(make_cam(UPSTREAM_MRV2_ORDER), 1) == (1, 0, 2, 1, 0, 2148)
    assert truth_counts(UPSTREAM_MRV2_ORDER, 1) == (1, 1, 1, 1, 2048, 100)


def test_issue_batch_patched_order_and_split():
    from vllm.v1.attention.backends.utils import split_decodes_prefills_and_extends
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    ordered = mrv2_order(sort_batch_req_ids, EMITTED, decode_query_len=1, threshold=1)
    assert ordered == [DECODE, EXTEND, PREFILL]
    assert split_decodes_prefills_and_extends(make_cam(ordered), 1) == truth_counts(
        ordered, 1
    )


def test_issue_batch_through_mrv2_gather_batch_req_state():
    """The runner's own gather: batch order, token counts and state indices."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.__dict__.update(
        decode_query_len=1, adaptive_verification=None, pcp_manager=None, use_pp=False
    )
    runner.req_states = mrv2_req_states(EMITTED)
    scheduler_output = SimpleNamespace(
        num_scheduled_tokens={r.name: r.q for r in EMITTED},
        total_num_scheduled_tokens=sum(r.q for r in EMITTED),
        scheduled_spec_decode_tokens={},
    )
    state, uniform_token_count = runner.gather_batch_req_state(scheduler_output, False)
    assert state.req_ids == ["dec", "ext", "pre"]
    assert state.num_scheduled_tokens.tolist() == [1, 2048, 100]
    index = runner.req_states.req_id_to_index
    assert state.idx_mapping_np.tolist() == [index[r] for r in state.req_ids]
    assert state.is_prefilling_np.tolist() == [False, True, True]
    assert uniform_token_count is None


@pytest.mark.parametrize("threshold", [None, 1], ids=["no_builder", "t1"])
def test_issue_batch_cpu_runner_before_and_after(threshold, pristine):
    """Standalone CPU runner: pristine misorders the batch, patched orders it
    decode -> extend -> prefill and the split finds one of each."""
    from vllm.v1.attention.backends.utils import split_decodes_prefills_and_extends
    from vllm.v1.worker.cpu.standalone_model_runner import sort_batch_req_ids

    pristine_sort = pristine(CPU_RUNNER, only=("sort_batch_req_ids",))
    order = pristine_sort.sort_batch_req_ids({r.name: r.q for r in EMITTED}, 1)
    assert order == [r.name for r in UPSTREAM_CPU_ORDER]
    before = cpu_order(
        cpu_sort_as_patched(pristine_sort.sort_batch_req_ids), EMITTED, threshold
    )
    assert before == UPSTREAM_CPU_ORDER
    assert not honours_contract(before, 1)
    pristine_split = pristine(UTILS).split_decodes_prefills_and_extends
    assert pristine_split(make_cam(before), 1) == (1, 0, 2, 1, 0, 2148)

    ordered = cpu_order(sort_batch_req_ids, EMITTED, threshold)
    assert ordered == [DECODE, EXTEND, PREFILL]
    split = split_decodes_prefills_and_extends(make_cam(ordered), 1)
    assert split == truth_counts(ordered, 1) == (1, 1, 1, 1, 2048, 100)


def test_issue_batch_through_cpu_runner_gather_batch_req_state():
    """The CPU runner's own gather: batch order, token counts, state indices."""
    from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner

    runner = StandaloneCPUModelRunner.__new__(StandaloneCPUModelRunner)
    runner.__dict__.update(decode_query_len=1, use_pp=False)
    runner.req_states = cpu_req_states(EMITTED)
    scheduler_output = SimpleNamespace(
        num_scheduled_tokens={r.name: r.q for r in EMITTED},
        total_num_scheduled_tokens=sum(r.q for r in EMITTED),
    )
    state, uniform_token_count = runner.gather_batch_req_state(scheduler_output, False)
    assert state.req_ids == ["dec", "ext", "pre"]
    assert state.num_scheduled_tokens.tolist() == [1, 2048, 100]
    index = runner.req_states.req_id_to_index
    assert state.idx_mapping_np.tolist() == [index[r] for r in state.req_ids]
    assert state.is_prefilling_np.tolist() == [False, True, True]
    assert uniform_token_count is None


BUILDERS = {
    "min_of_spec_and_plain": ([4, None, 1], 1),
    "spec_as_decode_only": ([4, 4], 4),
    "no_reordering_builder": ([None], None),
    "no_builders": ([], None),
}


@pytest.mark.parametrize("thresholds,expected", BUILDERS.values(), ids=BUILDERS.keys())
def test_mrv2_orders_by_smallest_builder_threshold(thresholds, expected):
    from vllm.v1.attention.backends.batch_order import min_reorder_batch_threshold

    builders = [SimpleNamespace(reorder_batch_threshold=t) for t in thresholds]
    assert min_reorder_batch_threshold(builders) == expected


def test_issue_batch_out_of_order_split_names_requests():
    from vllm.v1.attention.backends.batch_order import BatchOrderError
    from vllm.v1.attention.backends.utils import split_decodes_prefills_and_extends

    with pytest.raises(BatchOrderError, match=r"#1 \(query 100, context 0") as err:
        split_decodes_prefills_and_extends(make_cam(UPSTREAM_MRV2_ORDER), 1)
    assert err.value.offending == [1, 2]
    assert "#2 (query 2048, context 8192: extend)" in str(err.value)


def test_issue_batch_cp_utils_before_and_after(pristine, monkeypatch):
    from vllm.v1.attention.backends.batch_order import BatchOrderError
    from vllm.v1.worker import cp_utils

    def dcp_split(rows):
        cam = make_cam(rows)
        return cp_utils.split_dcp_context_queries(
            cam.query_start_loc_cpu,
            cam.seq_lens_cpu_upper_bound,
            cam.max_query_len,
            cam.num_actual_tokens,
        )

    # After: the ordered batch has one context-bearing extend; the misordered
    # one is refused instead of skipping the extend's context attention.
    assert dcp_split([DECODE, EXTEND, PREFILL]) == (1, 1, 1, 2048)
    with pytest.raises(BatchOrderError):
        dcp_split(UPSTREAM_MRV2_ORDER)

    # Before: with the pristine split, cp_utils reports no context-bearing row.
    pristine_split = pristine(UTILS).split_decodes_prefills_and_extends
    monkeypatch.setattr(cp_utils, "split_decodes_prefills_and_extends", pristine_split)
    assert dcp_split(UPSTREAM_MRV2_ORDER) == (1, 0, 1, 0)


@pytest.fixture
def aiter_builder(monkeypatch):
    """AITER FA's metadata builder with only what build() reads, on CPU."""
    import vllm.utils.torch_utils as torch_utils
    from vllm.v1.attention.backends.rocm_aiter_fa import (
        AiterFlashAttentionMetadataBuilder as Builder,
    )

    # build() stages through pinned host memory, which a CPU-only torch lacks.
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    zeros = torch.zeros
    monkeypatch.setattr(
        torch, "zeros", lambda *a, pin_memory=False, **kw: zeros(*a, **kw)
    )
    builder = Builder.__new__(Builder)
    builder.__dict__.update(
        reorder_batch_threshold=1,
        k_scale={},
        v_scale={},
        kv_sharing_workspace=None,
        aot_sliding_window=None,
        _swa_block_table=None,
        device=torch.device("cpu"),
        extend_workspace=torch.empty(0),
        # fetch-kv topic (0250): 0 keeps extends on the gather route.
        paged_context_max_tokens=0,
    )
    return builder


def test_aiter_builder_builds_the_ordered_issue_batch(aiter_builder):
    meta = aiter_builder.build(0, make_cam([DECODE, EXTEND, PREFILL]))
    assert (meta.num_decodes, meta.num_extends, meta.num_prefills) == (1, 1, 1)
    assert (meta.num_decode_tokens, meta.num_extend_tokens) == (1, 2048)
    chunks = meta.extend_metadata.chunk_context_metadata
    assert sum(chunks.total_token_per_batch) == EXTEND.ctx


def test_aiter_builder_refuses_the_misordered_issue_batch(aiter_builder):
    from vllm.v1.attention.backends.batch_order import BatchOrderError

    with pytest.raises(BatchOrderError) as err:
        aiter_builder.build(0, make_cam(UPSTREAM_MRV2_ORDER))
    assert err.value.offending == [1, 2]


def test_aiter_builder_rechecks_split_with_exact_seq_lens(aiter_builder, monkeypatch):
    """A split that disagrees with the exact seq_lens is refused in build()."""
    from vllm.v1.attention.backends import rocm_aiter_fa
    from vllm.v1.attention.backends.batch_order import BatchOrderError

    # E.g. an upper bound that claimed context for the fresh prompt.
    stale = (1, 2, 0, 1, 2148, 0)
    monkeypatch.setattr(
        rocm_aiter_fa, "split_decodes_prefills_and_extends", lambda *a, **k: stale
    )
    with pytest.raises(BatchOrderError, match=r"#2 \(query 100, context 0: prefill\)"):
        aiter_builder.build(0, make_cam([DECODE, EXTEND, PREFILL]))
