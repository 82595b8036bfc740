"""The scheduler emits the batch in the runner's order (issue 3, part 3).

A synthetic steady-state trace (running decodes, a long prompt chunked over
several steps, new arrivals: fresh prompts, prefix-cache hits, one-token
prompts) drives the real Scheduler on CPU, pristine (root commit) and patched,
with the same arrivals. Each step is fed to both runners' real sorts (pristine
runners to the pristine scheduler's steps, patched to patched); moves = rows
whose position the sort changes:
  * Model Runner V2: vllm/v1/worker/gpu/model_runner.py::sort_batch_req_ids,
  * the standalone CPU model runner:
    vllm/v1/worker/cpu/standalone_model_runner.py::sort_batch_req_ids.
"""

import pytest
from order_support import (
    Row,
    cpu_order,
    cpu_sort_as_patched,
    honours_contract,
    mrv2_req_states,
    truth,
)

STEPS = 60
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
RUNNER = "vllm/v1/worker/gpu/model_runner.py"
CPU_RUNNER = "vllm/v1/worker/cpu/standalone_model_runner.py"


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


def moves(ordered: list, rows: list[Row]) -> int:
    """Rows whose position the sort changed (ordered: Rows or request ids)."""
    names = [r if isinstance(r, str) else r.name for r in ordered]
    return sum(a != b.name for a, b in zip(names, rows, strict=True))


def run_trace(scheduler, sort_ids, cpu_sort, patched: bool):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
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
        steps.append(
            (rows, moves(ordered, rows), moves(cpu_order(cpu_sort, rows, 1), rows))
        )

        sampled = [
            [7] if scheduler.requests[r.name].num_computed_tokens >= r.prompt else []
            for r in rows
        ]
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=[r.name for r in rows],
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            ),
        )
    return steps


@pytest.mark.parametrize(
    "long_prefill_token_threshold", [0, 256], ids=["budget_chunking", "capped_chunks"]
)
def test_steady_state_trace_needs_no_reorder(
    long_prefill_token_threshold, make_scheduler, pristine
):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu import standalone_model_runner as cpu_runner
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    def sort_ids_patched(rows):
        num_tokens = {r.name: r.q for r in rows}
        return sort_batch_req_ids(num_tokens, {}, 1, mrv2_req_states(rows))[0]

    pristine_cpu_sort = cpu_sort_as_patched(
        pristine(CPU_RUNNER, only=("sort_batch_req_ids",)).sort_batch_req_ids
    )
    kwargs = dict(long_prefill_token_threshold=long_prefill_token_threshold)
    before = run_trace(
        make_scheduler(pristine(SCHEDULER).Scheduler, **kwargs),
        pristine(RUNNER, only=("sort_batch_req_ids",)).sort_batch_req_ids,
        pristine_cpu_sort,
        patched=False,
    )
    after = run_trace(
        make_scheduler(Scheduler, **kwargs),
        sort_batch_req_ids,
        cpu_runner.sort_batch_req_ids,
        patched=True,
    )

    # Same arrivals, same scheduling decisions: only the emission order differs.
    assert [sorted(r.name for r in s[0]) for s in before] == [
        sorted(r.name for r in s[0]) for s in after
    ]
    kinds = {truth(r.q, r.ctx, 1) for s in after for r in s[0]}
    assert kinds == {"decode", "extend", "prefill"}
    assert any(r.q > 1 and r.ctx > 0 for s in after for r in s[0])  # chunks, hits

    for rows, mrv2_moves, cpu_moves in after:
        assert honours_contract(rows, 1), [(r.name, r.q, r.ctx) for r in rows]
        assert mrv2_moves == 0
        assert cpu_moves == 0
    moves_before = sum(s[1] for s in before)
    cpu_moves_before = sum(s[2] for s in before)
    # The patched runners alone, fed the pristine scheduler's emission order.
    moves_runner_only = sum(moves(sort_ids_patched(rows), rows) for rows, *_ in before)
    cpu_moves_runner_only = sum(
        moves(cpu_order(cpu_runner.sort_batch_req_ids, rows, 1), rows)
        for rows, *_ in before
    )
    out_of_order_before = sum(not honours_contract(s[0], 1) for s in before)
    # Pristine CPU runner: steps its sort left out of order.
    sorted_out_of_order_before = sum(
        not honours_contract(cpu_order(pristine_cpu_sort, rows, 1), 1)
        for rows, *_ in before
    )
    print(
        f"\n{long_prefill_token_threshold=}: {STEPS} steps, "
        f"{sum(len(s[0]) for s in after)} request-steps; before: "
        f"{out_of_order_before} steps emitted out of order, MRv2 moves "
        f"{moves_before}, CPU runner moves {cpu_moves_before} (its sort left "
        f"{sorted_out_of_order_before} steps out of order); patched runners "
        f"alone: MRv2 moves {moves_runner_only}, CPU runner moves "
        f"{cpu_moves_runner_only}; after: 0 out of order, MRv2 moves 0, CPU "
        "runner moves 0"
    )
    assert moves_before > 0
    assert cpu_moves_before > 0
    assert moves_runner_only > 0  # the scheduler part is needed too
    assert cpu_moves_runner_only > 0
    assert sorted_out_of_order_before > 0  # pristine CPU sort breaks the contract


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
