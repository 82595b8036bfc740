"""split_decodes_prefills_and_extends, case by case: ordered batches split by
class, tolerated disorders stay exact, the rest is refused with the rows named.

Rows are (query_len, context_len); the threshold is 1 unless a case says so.
"""

import pytest
from order_support import Row, make_cam

UTILS = "vllm/v1/attention/backends/utils.py"


def rows(*pairs):
    return [Row(f"r{i}", q, c, q + c) for i, (q, c) in enumerate(pairs)]


# name: (rows, threshold, expected split or offending rows, pristine split)
CASES = {
    "ordered_decode_extend_prefill": (
        rows((1, 9), (1, 7), (64, 100), (32, 0)),
        1,
        (2, 1, 1, 2, 64, 32),
        (2, 1, 1, 2, 64, 32),
    ),
    "all_decode_like": (
        rows((1, 9), (1, 0)),
        1,
        (2, 0, 0, 2, 0, 0),
        (2, 0, 0, 2, 0, 0),
    ),
    "short_fresh_prompt_leads": (
        rows((1, 0), (64, 100)),
        1,
        (1, 1, 0, 1, 64, 0),
        (1, 1, 0, 1, 64, 0),
    ),
    "padding_after_extend": (
        rows((1, 9), (64, 100), (0, 0)),
        1,
        (1, 2, 0, 1, 64, 0),
        (1, 2, 0, 1, 64, 0),
    ),
    "padding_after_prefill": (
        rows((1, 9), (32, 0), (0, 0)),
        1,
        (1, 0, 2, 1, 0, 32),
        (1, 0, 2, 1, 0, 32),
    ),
    # Tolerated (exact, logged): a runner ordered by a smaller threshold than
    # this backend's (runners order by the smallest builder threshold).
    "spec_row_behind_extend_runs_as_extend": (
        rows((1, 9), (64, 100), (3, 50), (32, 0)),
        4,
        (1, 2, 1, 1, 67, 32),
        (1, 2, 1, 1, 67, 32),
    ),
    "short_fresh_prompt_behind_extend_runs_as_prefill": (
        rows((1, 9), (64, 100), (1, 0)),
        1,
        (1, 1, 1, 1, 64, 1),
        (1, 2, 0, 1, 65, 0),  # the prompt on the extend path, empty context
    ),
    # Refused: a row with context would lose it.
    "issue_batch_mrv2_order": (
        rows((1, 500), (100, 0), (2048, 8192)),
        1,
        [1, 2],
        (1, 0, 2, 1, 0, 2148),
    ),
    "fresh_prompt_between_extends": (
        rows((64, 100), (32, 0), (1, 0), (16, 5)),
        1,
        [1, 2, 3],
        (0, 1, 3, 0, 64, 49),
    ),
}


@pytest.mark.parametrize(
    "batch,threshold,expected,before", CASES.values(), ids=CASES.keys()
)
def test_split_cases(batch, threshold, expected, before, pristine):
    from vllm.v1.attention.backends.batch_order import BatchOrderError
    from vllm.v1.attention.backends.utils import split_decodes_prefills_and_extends

    cam = make_cam(batch)
    pristine_split = pristine(UTILS).split_decodes_prefills_and_extends
    assert pristine_split(cam, threshold) == before
    if isinstance(expected, list):
        with pytest.raises(BatchOrderError) as err:
            split_decodes_prefills_and_extends(cam, threshold)
        assert err.value.offending == expected
        return
    assert split_decodes_prefills_and_extends(cam, threshold) == expected
