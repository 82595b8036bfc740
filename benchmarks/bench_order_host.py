"""Host cost of ordering a batch, per step, before vs after the order-contract
patches (issue 3). CPU only: this is Python/numpy work on the host.

"Whole ordering" of one step, on the steady-state batch the scheduler emits
(num_reqs - 2 running decodes, one chunked prefill, one new prompt):

  mrv2-before  pristine sort_batch_req_ids + the two gathers it was followed
               by (num_scheduled_tokens, idx_mapping) + pristine
               split_decodes_prefills_and_extends
  mrv2-after   the scheduler's order_scheduled_requests (already in order) +
               patched sort_batch_req_ids (returns both gathers) + patched split
  cpu-before   the standalone CPU model runner's pristine sort_batch_req_ids +
               the two gathers it was followed by + pristine split
  cpu-after    order_scheduled_requests (already in order) + the CPU runner's
               patched sort_batch_req_ids (returns both gathers) + patched split

Pristine functions come from the build tree's root commit (tests/order/
order_support.py); run with the patched tree on PYTHONPATH, e.g.
``PYTHONPATH=build/vllm .venv/bin/pytest benchmarks/bench_order_host.py``.
Under ``--benchmark-disable`` each case runs once and checks its split.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "order"))
from order_support import (  # noqa: E402
    Row,
    cpu_req_states,
    make_cam,
    mrv2_req_states,
    pristine_module,
    truth_counts,
)

pytest.importorskip("vllm.v1.attention.backends.batch_order")  # patched tree
# ... and all of it: the GPU machine has the overlay (and tests/without_vllm) only.
pytest.importorskip("vllm.v1.attention.backends.utils")

UTILS = "vllm/v1/attention/backends/utils.py"
RUNNER = "vllm/v1/worker/gpu/model_runner.py"
CPU_RUNNER = "vllm/v1/worker/cpu/standalone_model_runner.py"
SIZES = [8, 64, 256]


def steady_state(num_reqs: int) -> list[Row]:
    """Emission order: running decodes, the running chunked prefill, an arrival."""
    rows = [Row(f"d{i}", 1, 900 + 37 * i, 700) for i in range(num_reqs - 2)]
    rows.append(Row("chunk", 256, 4096, 16384))
    rows.append(Row("new", 128, 0, 128))
    return rows


@pytest.mark.parametrize("num_reqs", SIZES)
@pytest.mark.parametrize("variant", ["before", "after"])
def test_mrv2_order_host_cost(benchmark, variant, num_reqs):
    benchmark.group = f"order-host-mrv2-{num_reqs}"
    benchmark.extra_info.update(kernel="order_host", case=f"mrv2_{num_reqs}_reqs",
                                variant=variant, num_reqs=num_reqs, runner="mrv2")
    rows = steady_state(num_reqs)
    num_tokens = {r.name: r.q for r in rows}
    states = mrv2_req_states(rows)

    if variant == "before":
        sort = pristine_module(RUNNER, only=("sort_batch_req_ids",)).sort_batch_req_ids
        split = pristine_module(UTILS).split_decodes_prefills_and_extends
        index = states.req_id_to_index
        by_name = {r.name: r for r in rows}
        cam = make_cam([by_name[r] for r in sort(num_tokens, {}, 1)])

        def step():
            req_ids = sort(num_tokens, {}, 1)
            np.fromiter(map(num_tokens.__getitem__, req_ids), np.int32, num_reqs)
            np.fromiter(map(index.__getitem__, req_ids), np.intp, num_reqs)
            return split(cam, 1)

    else:
        from vllm.v1.attention.backends.batch_order import order_scheduled_requests
        from vllm.v1.attention.backends.utils import split_decodes_prefills_and_extends
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        # Running: the decodes and the chunk (still prefilling); admitted: "new".
        running = [SimpleNamespace(is_prefill_chunk=r.prefilling) for r in rows[:-1]]
        admitted = {"new": SimpleNamespace(num_computed_tokens=0, num_tokens=128)}
        cam = make_cam(rows)

        def step():
            emitted = order_scheduled_requests(num_tokens, running, admitted, {}, 1, 1)
            assert emitted is None
            sort_batch_req_ids(num_tokens, {}, 1, states, 1)
            return split_decodes_prefills_and_extends(cam, 1)

    split_result = benchmark(step)
    if variant == "after":
        assert split_result == truth_counts(rows, 1)
    else:  # upstream MRv2 sorts the chunked prefill behind the new prompt
        assert split_result[1] == 0 and truth_counts(rows, 1)[1] == 1


@pytest.mark.parametrize("num_reqs", SIZES)
@pytest.mark.parametrize("variant", ["before", "after"])
def test_cpu_order_host_cost(benchmark, variant, num_reqs):
    benchmark.group = f"order-host-cpu-{num_reqs}"
    benchmark.extra_info.update(kernel="order_host", case=f"cpu_{num_reqs}_reqs",
                                variant=variant, num_reqs=num_reqs, runner="cpu")
    rows = steady_state(num_reqs)
    num_tokens = {r.name: r.q for r in rows}
    states = cpu_req_states(rows)

    if variant == "before":
        sort = pristine_module(CPU_RUNNER, only=("sort_batch_req_ids",)).sort_batch_req_ids
        split = pristine_module(UTILS).split_decodes_prefills_and_extends
        index = states.req_id_to_index
        by_name = {r.name: r for r in rows}
        cam = make_cam([by_name[r] for r in sort(num_tokens, 1)])

        def step():
            req_ids = sort(num_tokens, 1)
            np.fromiter(map(num_tokens.__getitem__, req_ids), np.int32, num_reqs)
            np.fromiter(map(index.__getitem__, req_ids), np.intp, num_reqs)
            return split(cam, 1)

    else:
        from vllm.v1.attention.backends.batch_order import order_scheduled_requests
        from vllm.v1.attention.backends.utils import split_decodes_prefills_and_extends
        from vllm.v1.worker.cpu.standalone_model_runner import sort_batch_req_ids

        running = [SimpleNamespace(is_prefill_chunk=r.prefilling) for r in rows[:-1]]
        admitted = {"new": SimpleNamespace(num_computed_tokens=0, num_tokens=128)}
        cam = make_cam(rows)

        def step():
            emitted = order_scheduled_requests(num_tokens, running, admitted, {}, 1, 1)
            assert emitted is None
            sort_batch_req_ids(num_tokens, 1, states, 1)
            return split_decodes_prefills_and_extends(cam, 1)

    split_result = benchmark(step)
    if variant == "after":
        assert split_result == truth_counts(rows, 1)
    else:  # upstream's CPU sort puts the chunked prefill behind the new prompt
        assert split_result[1] == 0 and truth_counts(rows, 1)[1] == 1
