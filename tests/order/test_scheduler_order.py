"""The scheduler emits the batch in the runner's order (issue 3, part 3).

A synthetic steady-state trace (running decodes, a long prompt chunked over
several steps, new arrivals: fresh prompts, prefix-cache hits, one-token
prompts) drives the real Scheduler on CPU, pristine (root commit) and patched,
with the same arrivals. Each step is fed to the runners' reorders:
  * Model Runner V2: moves = rows whose position the runner's sort changes,
  * Model Runner V1: swap_states calls of the real reorder on a model of its
    persistent batch (removals leave holes, additions fill the lowest hole,
    condense moves the last row into holes), as in _update_states.
"""

import pytest
from order_support import Row, honours_contract, mrv2_req_states, truth

STEPS = 60
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
UTILS = "vllm/v1/attention/backends/utils.py"
RUNNER = "vllm/v1/worker/gpu/model_runner.py"


def arrivals(step: int) -> list[tuple[str, list[int], int]]:
    """(request id, prompt token ids, max_tokens) arriving before ``step``."""
    shared = list(range(1000, 1064))  # 4 blocks of 16: a prefix-cache hit
    new = []
    if step == 0:
        new += [(f"dec{i}", [i] * 24, 30 + 7 * i) for i in range(12)]
        new.append(("seed", shared + [1] * 8, 4))
    if step % 4 == 2:
        new.append((f"long{step}", [step] * 1500, 20))
    if step % 3 == 1:
        new.append((f"fresh{step}", [step + 7] * 40, 25))
    if step % 5 == 3:
        new.append((f"hit{step}", shared + [step] * 30, 15))
    if step % 7 == 5:
        new.append((f"one{step}", [step + 11], 10))
    return new


def run_trace(scheduler, sort_ids, reorder, patched: bool):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    v1 = V1PersistentBatch()
    steps = []
    for step in range(STEPS):
        for req_id, prompt, max_tokens in arrivals(step):
            params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
            scheduler.add_request(
                Request(
                    req_id, prompt, params, pooling_params=None, block_hasher=hasher
                )
            )
        out = scheduler.schedule()
        # schedule() has applied the step: context = computed - scheduled.
        rows = []
        for req_id, q in out.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            rows.append(
                Row(req_id, q, req.num_computed_tokens - q, req.num_prompt_tokens)
            )

        if patched:
            ordered, _, _ = sort_ids(
                out.num_scheduled_tokens, {}, 1, mrv2_req_states(rows)
            )
        else:
            ordered = sort_ids(out.num_scheduled_tokens, {}, 1)
        mrv2_moves = sum(a != b.name for a, b in zip(ordered, rows, strict=True))
        new_ids = [r.req_id for r in out.scheduled_new_reqs]
        v1_swaps = v1.step(out.finished_req_ids, new_ids, rows, reorder)
        steps.append((rows, mrv2_moves, v1_swaps))

        sampled = [
            [7] if scheduler.requests[r.name].num_computed_tokens >= r.prompt else []
            for r in rows
        ]
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=[r.name for r in rows],
                req_id_to_index={r.name: i for i, r in enumerate(rows)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            ),
        )
    return steps


class V1PersistentBatch:
    """Model Runner V1's slot policy, driving the real reorder function."""

    def __init__(self):
        self.slots: list[str | None] = []
        self.rows: dict[str, Row] = {}
        self.swaps = 0

    # What reorder_batch_to_split_decodes_and_prefills reads and calls.
    @property
    def req_ids(self):
        return list(self.slots)

    @property
    def num_computed_tokens_cpu(self):
        import numpy as np

        return np.array([self.rows[r].ctx for r in self.slots], dtype=np.int64)

    @property
    def num_prompt_tokens(self):
        import numpy as np

        return np.array([self.rows[r].prompt for r in self.slots], dtype=np.int64)

    def swap_states(self, i: int, j: int) -> None:
        self.slots[i], self.slots[j] = self.slots[j], self.slots[i]
        self.swaps += 1

    def step(self, finished, new_ids, rows, reorder) -> int:
        from types import SimpleNamespace

        scheduled = {r.name for r in rows}
        holes = []
        for i, req_id in enumerate(self.slots):
            if req_id in finished or req_id not in scheduled:
                self.slots[i] = None
                holes.append(i)
        for req_id in new_ids + [r.name for r in rows if r.name not in self.slots]:
            if req_id in self.slots:
                continue
            if holes:
                self.slots[holes.pop(0)] = req_id
            else:
                self.slots.append(req_id)
        # condense(): move the last row into the lowest hole.
        while None in self.slots:
            hole = self.slots.index(None)
            while self.slots and self.slots[-1] is None:
                self.slots.pop()
            if hole < len(self.slots):
                self.slots[hole] = self.slots.pop()
        self.rows = {r.name: r for r in rows}
        self.swaps = 0
        output = SimpleNamespace(num_scheduled_tokens={r.name: r.q for r in rows})
        reorder(self, output, decode_threshold=1)
        return self.swaps


@pytest.mark.parametrize(
    "long_prefill_token_threshold", [0, 256], ids=["budget_chunking", "capped_chunks"]
)
def test_steady_state_trace_needs_no_reorder(
    long_prefill_token_threshold, make_scheduler, pristine
):
    from vllm.v1.attention.backends.utils import (
        reorder_batch_to_split_decodes_and_prefills,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    def sort_ids_patched(rows):
        num_tokens = {r.name: r.q for r in rows}
        return sort_batch_req_ids(num_tokens, {}, 1, mrv2_req_states(rows))[0]

    kwargs = dict(long_prefill_token_threshold=long_prefill_token_threshold)
    before = run_trace(
        make_scheduler(pristine(SCHEDULER).Scheduler, **kwargs),
        pristine(RUNNER, only=("sort_batch_req_ids",)).sort_batch_req_ids,
        pristine(UTILS).reorder_batch_to_split_decodes_and_prefills,
        patched=False,
    )
    after = run_trace(
        make_scheduler(Scheduler, **kwargs),
        sort_batch_req_ids,
        reorder_batch_to_split_decodes_and_prefills,
        patched=True,
    )

    # Same arrivals, same scheduling decisions: only the emission order differs.
    assert [sorted(r.name for r in s[0]) for s in before] == [
        sorted(r.name for r in s[0]) for s in after
    ]
    kinds = {truth(r.q, r.ctx, 1) for s in after for r in s[0]}
    assert kinds == {"decode", "extend", "prefill"}
    assert any(r.q > 1 and r.ctx > 0 for s in after for r in s[0])  # chunks, hits

    for rows, mrv2_moves, _ in after:
        assert honours_contract(rows, 1), [(r.name, r.q, r.ctx) for r in rows]
        assert mrv2_moves == 0
    moves_before = sum(s[1] for s in before)
    # The patched runner alone, fed the pristine scheduler's emission order.
    moves_runner_only = sum(
        sum(a != b.name for a, b in zip(sort_ids_patched(rows), rows, strict=True))
        for rows, _, _ in before
    )
    out_of_order_before = sum(not honours_contract(s[0], 1) for s in before)
    swaps_before, swaps_after = sum(s[2] for s in before), sum(s[2] for s in after)
    print(
        f"\n{long_prefill_token_threshold=}: {STEPS} steps, "
        f"{sum(len(s[0]) for s in after)} request-steps; before: "
        f"{out_of_order_before} steps emitted out of order, MRv2 moves "
        f"{moves_before}, V1 swaps {swaps_before}; patched runner alone: MRv2 "
        f"moves {moves_runner_only}; after: 0 out of order, MRv2 moves 0, V1 "
        f"swaps {swaps_after}"
    )
    assert moves_before > 0
    assert moves_runner_only > 0  # the scheduler part is needed too
    assert swaps_after <= swaps_before


# Rows: running (id, q, is_prefill_chunk) then admitted (id, q, computed,
# num_tokens); running_prefilling; spec tokens; expected order (None: as emitted).
EMISSION_CASES = {
    "decode_only_step": ([("a", 1, 0), ("b", 1, 0), ("c", 1, 0)], [], False, {}, None),
    "hit_behind_fresh_prompt": (
        [("a", 1, 0)],
        [("fresh", 40, 0, 40), ("hit", 30, 64, 94)],
        False,
        {},
        ["a", "hit", "fresh"],
    ),
    "one_token_prompt_behind_fresh_prompt": (
        [("a", 1, 0)],
        [("fresh", 40, 0, 40), ("one", 1, 0, 1)],
        False,
        {},
        ["a", "one", "fresh"],
    ),
    "capped_chunk_ahead_of_decode": (
        [("chunk", 256, 1), ("a", 1, 0)],
        [],
        True,
        {},
        ["a", "chunk"],
    ),
    "one_token_chunk_tail_behind_decodes": (
        [("tail", 1, 1), ("a", 1, 0), ("b", 1, 0)],
        [],
        True,
        {},
        ["a", "b", "tail"],
    ),
    "verification_rows_lead": (
        [("a", 1, 0), ("v", 3, 0)],
        [("fresh", 40, 0, 40)],
        False,
        {"v": [5, 6]},
        ["v", "a", "fresh"],
    ),
}


@pytest.mark.parametrize(
    "running,admitted,running_prefilling,spec,expected",
    EMISSION_CASES.values(),
    ids=EMISSION_CASES.keys(),
)
def test_scheduler_emission_order(
    running, admitted, running_prefilling, spec, expected
):
    """Running rows are read from the running list, never looked up by id."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.batch_order import order_scheduled_requests

    emitted = {r[0]: r[1] for r in running + admitted}
    running_reqs = [SimpleNamespace(is_prefill_chunk=bool(r[2])) for r in running]
    requests = {
        r[0]: SimpleNamespace(num_computed_tokens=r[2], num_tokens=r[3])
        for r in admitted
    }
    threshold = 3 if spec else 1
    order = order_scheduled_requests(
        emitted,
        running_reqs,
        requests,
        spec,
        threshold,
        threshold,
        running_prefilling=running_prefilling,
    )
    if expected is None:
        assert order is None
    else:
        assert list(order) == expected
        assert order == {k: emitted[k] for k in expected}
