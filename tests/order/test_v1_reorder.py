"""Model Runner V1: reorder_batch_to_split_decodes_and_prefills against the
contract, case by case, pristine (root commit) and patched.

Pristine V1 honours the contract except for short fresh prompts (no context,
query within the threshold): it ranks them with the prefills, behind the
extends, where the split then counts them as extends with an empty context.
The patched reorder ranks them with the short extends (decode-like, still
prefilling).
"""

from dataclasses import dataclass

import pytest
from order_support import Row, honours_contract, make_cam, truth_counts, v1_order

UTILS = "vllm/v1/attention/backends/utils.py"


@dataclass
class Case:
    rows: list[Row]
    threshold: int
    expected: list[str]  # patched order
    pristine_honours: bool = True


def dec(name, q=1, ctx=100):
    return Row(name, q, ctx, ctx)


def ext(name, q, ctx=50, prompt=5000):
    return Row(name, q, ctx, prompt)


def fresh(name, q, prompt=None):
    return Row(name, q, 0, prompt or q)


CASES = {
    "already_ordered": Case(
        [dec("d0"), dec("d1"), ext("e0", 64), fresh("p0", 64)],
        1,
        ["d0", "d1", "e0", "p0"],
    ),
    "issue_batch": Case(
        [dec("d", ctx=500), fresh("p", 100), ext("e", 2048, 8192, 16384)],
        1,
        ["d", "e", "p"],
    ),
    "decodes_behind_prefills": Case(
        [fresh("p0", 300), dec("d0"), fresh("p1", 30), dec("d1")],
        1,
        ["d1", "d0", "p1", "p0"],
    ),
    "short_extends_after_decodes": Case(
        [ext("s0", 1), dec("d0"), ext("s1", 1), dec("d1"), ext("e0", 9)],
        1,
        ["d1", "d0", "s1", "s0", "e0"],
    ),
    "spec_rows_within_threshold": Case(
        [ext("e0", 40), dec("v0", q=4), dec("d0"), fresh("p0", 40), dec("v1", q=3)],
        4,
        ["v1", "v0", "d0", "e0", "p0"],
    ),
    "spec_rows_above_threshold_are_extends": Case(
        [dec("v0", q=4), dec("d0"), fresh("p0", 40), dec("v1", q=3)],
        1,
        ["d0", "v0", "v1", "p0"],
    ),
    "short_extend_threshold_gt_1": Case(
        [ext("s0", 3), ext("e0", 5), dec("d0", q=4), fresh("p0", 5)],
        4,
        ["d0", "s0", "e0", "p0"],
    ),
    "one_token_prompt_behind_extend": Case(
        [fresh("one", 1), ext("e0", 50), dec("d0")],
        1,
        ["d0", "one", "e0"],
        pristine_honours=False,
    ),
    "fresh_chunk_within_threshold": Case(
        [dec("d0", q=5), ext("s0", 5), fresh("c0", 5, prompt=100), ext("e0", 10)],
        5,
        ["d0", "s0", "c0", "e0"],
        pristine_honours=False,
    ),
    "short_fresh_prompts_only": Case(
        [fresh("a", 1), dec("d0"), fresh("b", 2, prompt=9)], 2, ["d0", "a", "b"]
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_v1_reorder_honours_contract(case: Case, pristine):
    from vllm.v1.attention.backends.utils import (
        reorder_batch_to_split_decodes_and_prefills,
        split_decodes_prefills_and_extends,
    )

    ordered, _ = v1_order(
        reorder_batch_to_split_decodes_and_prefills, case.rows, case.threshold
    )
    assert [r.name for r in ordered] == case.expected
    assert honours_contract(ordered, case.threshold)
    assert split_decodes_prefills_and_extends(
        make_cam(ordered), case.threshold
    ) == truth_counts(ordered, case.threshold)

    module = pristine(UTILS)
    before, _ = v1_order(
        module.reorder_batch_to_split_decodes_and_prefills, case.rows, case.threshold
    )
    assert honours_contract(before, case.threshold) == case.pristine_honours
    if not case.pristine_honours:
        # The pristine split counts the short fresh prompt as an extend.
        split = module.split_decodes_prefills_and_extends(
            make_cam(before), case.threshold
        )
        assert split != truth_counts(before, case.threshold)
        assert split[1] > truth_counts(before, case.threshold)[1]
