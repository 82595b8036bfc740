# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The batch-order contract: decode-like -> extend -> prefill.

One definition, read by everything that orders a batch (the scheduler's
emission order, Model Runner V2's ``sort_batch_req_ids`` and the standalone CPU
runner's) and everything that splits one
(``split_decodes_prefills_and_extends`` and its callers: the AITER FA metadata
builder, ``vllm/v1/worker/cp_utils.py``).

Classes, from a request's query length ``q`` (tokens scheduled this step, drafts
included), context length ``c`` (tokens already in the KV cache before this
step) and the decode threshold ``t`` (the backend's ``reorder_batch_threshold``):

    DECODE   q <= t            decodes, spec-verification rows, short extends and
                               short fresh prompts; the decode kernels read all
                               keys from the paged cache, which is exact for any
                               such row.
    EXTEND   q > t and c > 0   new tokens over cached context.
    PREFILL  q > t and c == 0  a fresh prompt: attention over the new tokens only.

The contract: every DECODE row precedes every EXTEND row, which precedes every
PREFILL row. Rows with ``q == 0`` are padding and carry no tokens.

Ranks refine the classes into the order the runners and the scheduler use; a
batch sorted by rank satisfies the contract (except that rows with drafts lead
even when ``t`` is below their query length, see ``batch_order_ranks``):

    0 RANK_VERIFY          rows with draft tokens (MRv2's adaptive verification
                           needs them first)
    1 RANK_UNIFORM_DECODE  decode-like, done prefilling, q == decode_query_len
                           (told apart from 2 only when t > 1)
    2 RANK_DECODE          other decode-like rows done prefilling
    3 RANK_SHORT_PREFILL   decode-like rows still prefilling (short extends,
                           one-token prompt tails, short fresh prompts)
    4 RANK_EXTEND
    5 RANK_PREFILL

Within a rank the incoming order is kept (stable), so a batch that already
arrives in order costs no sort and no data movement.
"""

from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

DECODE, EXTEND, PREFILL = 0, 1, 2
CLASS_NAMES = ("decode", "extend", "prefill")

(
    RANK_VERIFY,
    RANK_UNIFORM_DECODE,
    RANK_DECODE,
    RANK_SHORT_PREFILL,
    RANK_EXTEND,
    RANK_PREFILL,
) = range(6)

_RANK_OF_CLASS = np.array([RANK_DECODE, RANK_EXTEND, RANK_PREFILL])

# Rows named in full in an error message; the rest are counted.
_MAX_NAMED_ROWS = 8


class BatchOrderError(RuntimeError):
    """A batch whose order would make the split compute a request wrongly."""

    def __init__(self, message: str, offending: list[int]):
        super().__init__(message)
        self.offending = offending


def classify(query_lens: Any, context_lens: Any, decode_threshold: int) -> np.ndarray:
    """Class (DECODE / EXTEND / PREFILL) of each request."""
    has_context = np.asarray(context_lens) > 0
    return np.where(
        np.asarray(query_lens) <= decode_threshold, DECODE, PREFILL - has_context
    )


def batch_order_ranks(
    query_lens: Any,
    context_lens: Any,
    decode_threshold: int,
    *,
    is_prefilling: np.ndarray | None = None,
    has_drafts: np.ndarray | None = None,
    decode_query_len: int | None = None,
) -> np.ndarray:
    """Sort key (rank, see the module docstring) of each request.

    ``is_prefilling`` separates short extends from decodes; ``decode_query_len``
    groups uniform decodes; ``has_drafts`` moves verification rows to the front.
    Left out, the rank is not refined that way. Only ``c > 0`` of
    ``context_lens`` is read, so the prompt-clipped computed count works too.

    With ``decode_threshold`` below a verification row's query length (e.g. a
    backend without spec-as-decode kernels), that row is an EXTEND yet still
    leads. The decode segment is then empty: decode-like rows with context run
    on the extend path, which is exact (see ``split_decode_extend_prefill``),
    and those without context rank with the prefills, behind every row with
    context.
    """
    q = np.asarray(query_lens)
    classes = classify(q, context_lens, decode_threshold)
    ranks = _RANK_OF_CLASS[classes]
    decode_like = classes == DECODE
    if is_prefilling is not None:
        ranks += decode_like & is_prefilling  # RANK_DECODE -> RANK_SHORT_PREFILL
    if decode_query_len is not None and decode_threshold > 1:
        # (At threshold 1, decode-like rows with tokens share query length 1.)
        ranks -= (ranks == RANK_DECODE) & (q == decode_query_len)
    if has_drafts is not None:
        ranks[has_drafts] = RANK_VERIFY
        if bool((has_drafts & ~decode_like).any()):
            # Verification rows past the threshold lead as extends, so the
            # decode segment is empty: rows without context go last.
            ranks[decode_like & (np.asarray(context_lens) <= 0)] = RANK_PREFILL
    return ranks


def stable_order(ranks: np.ndarray) -> np.ndarray | None:
    """Stable permutation that sorts ``ranks``; None when already sorted."""
    if ranks.size > 1 and bool((ranks[1:] < ranks[:-1]).any()):
        return np.argsort(ranks, kind="stable")
    return None


def min_reorder_batch_threshold(builders: Iterable[Any]) -> int | None:
    """Smallest ``reorder_batch_threshold`` over attention metadata builders.

    A backend handles a threshold lower than the one it asks for (its decode-like
    rows then run on its extend/prefill path), never a higher one.
    """
    thresholds = [
        t for b in builders if (t := getattr(b, "reorder_batch_threshold", None))
    ]
    return min(thresholds) if thresholds else None


def order_scheduled_requests(
    num_scheduled_tokens: dict[str, int],
    running_reqs: Sequence[Any],
    requests: Mapping[str, Any],
    spec_decode_tokens: Mapping[str, list[int]],
    decode_query_len: int,
    decode_threshold: int,
    running_prefilling: bool = True,
) -> dict[str, int] | None:
    """The scheduler's emission order: ``num_scheduled_tokens`` in batch order.

    The first ``len(running_reqs)`` entries are ``running_reqs``, in order: they
    have context, and they are still prefilling when ``is_prefill_chunk`` (their
    previous step left prompt to compute), read only if ``running_prefilling``.
    The other entries, admitted this step, are looked up in ``requests``:
    context ``num_computed_tokens``, prefilling while below ``num_tokens`` (the
    prefill length the runner records for a new or resumed request). Returns
    None when the dict is already in order (the steady state).
    """
    num_reqs = len(num_scheduled_tokens)
    if num_reqs < 2:
        return None
    num_running = len(running_reqs)
    q = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
    context = np.ones(num_reqs, dtype=np.int64)
    prefilling = np.zeros(num_reqs, dtype=bool)
    if running_prefilling:
        flags = map(attrgetter("is_prefill_chunk"), running_reqs)
        prefilling[:num_running] = np.fromiter(flags, dtype=bool, count=num_running)
    if num_running < num_reqs:
        ids = islice(num_scheduled_tokens, num_running, None)
        admitted = list(map(requests.__getitem__, ids))
        count = len(admitted)
        computed = map(attrgetter("num_computed_tokens"), admitted)
        context[num_running:] = np.fromiter(computed, dtype=np.int64, count=count)
        total = np.fromiter(map(attrgetter("num_tokens"), admitted), np.int64, count)
        prefilling[num_running:] = context[num_running:] < total
    has_drafts = None
    if spec_decode_tokens:
        has_drafts = np.fromiter(
            (bool(spec_decode_tokens.get(r)) for r in num_scheduled_tokens),
            dtype=bool,
            count=num_reqs,
        )
    ranks = batch_order_ranks(
        q,
        context,
        decode_threshold,
        is_prefilling=prefilling,
        has_drafts=has_drafts,
        decode_query_len=decode_query_len,
    )
    order = stable_order(ranks)
    if order is None:
        return None
    req_ids = list(num_scheduled_tokens)
    return {req_ids[i]: int(q[i]) for i in order}


def _describe(rows: np.ndarray, q: np.ndarray, c: np.ndarray, threshold: int) -> str:
    named = rows[:_MAX_NAMED_ROWS]
    classes = classify(q[named], c[named], threshold)
    text = ", ".join(
        f"#{i} (query {q[i]}, context {max(int(c[i]), 0)}: {CLASS_NAMES[k]})"
        for i, k in zip(named.tolist(), classes.tolist(), strict=True)
    )
    if rows.size > _MAX_NAMED_ROWS:
        text += f" and {rows.size - _MAX_NAMED_ROWS} more"
    return text


def _out_of_order_segments(
    q: np.ndarray, c: np.ndarray, decode_threshold: int
) -> tuple[int, int]:
    """(num_decodes, prefill_start) of a batch whose classes are out of order."""
    num_reqs = q.size
    long_rows = np.flatnonzero(q > decode_threshold)
    num_decodes = int(long_rows[0]) if long_rows.size else num_reqs
    has_context = np.flatnonzero(c[num_decodes:] > 0)
    tail_start = num_decodes + (int(has_context[-1]) + 1 if has_context.size else 0)
    tail_real = np.flatnonzero(q[tail_start:] > 0)
    prefill_start = tail_start + int(tail_real[0]) if tail_real.size else num_reqs

    ext = slice(num_decodes, prefill_start)
    fresh_in_extend = np.flatnonzero((c[ext] <= 0) & (q[ext] > 0)) + num_decodes
    if fresh_in_extend.size:
        first = int(fresh_in_extend[0])
        behind = np.flatnonzero(c[first:prefill_start] > 0) + first
        raise BatchOrderError(
            "batch violates the decode -> extend -> prefill order "
            f"(decode threshold {decode_threshold}): request(s) "
            f"{_describe(fresh_in_extend, q, c, decode_threshold)} have no cached "
            "context but come before request(s) "
            f"{_describe(behind, q, c, decode_threshold)} that do; splitting it "
            "would attend the latter without their context",
            fresh_in_extend.tolist() + behind.tolist(),
        )
    misplaced = (q[num_decodes:] <= decode_threshold) & (q[num_decodes:] > 0)
    if misplaced.any():
        logger.warning_once(
            "Decode-like requests follow an extend or prefill in the batch "
            "(decode threshold %d); they run on the extend/prefill path, which "
            "is exact but slower. Does the model runner order the batch with a "
            "lower threshold than this backend's?",
            decode_threshold,
        )
    return num_decodes, prefill_start


def split_decode_extend_prefill(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    decode_threshold: int,
    num_tokens: int,
) -> tuple[int, int, int, int, int, int]:
    """Split a batch into [decode | extend | prefill] segments by position.

    Returns (num_decodes, num_extends, num_prefills, num_decode_tokens,
    num_extend_tokens, num_prefill_tokens). ``seq_lens_cpu`` may be an upper
    bound: it is exact where the context is empty, and that is all it decides.

    A batch that honours the contract splits by class. Otherwise the segments
    are: decode = the leading rows with q <= t; prefill = the rows from the
    first non-padding row after the last row with context; extend = the rows
    between (on an ordered batch, the same). Each row then still lands on a
    path that computes it exactly, or the call raises:
      * a decode-like row after the decode prefix runs on the extend path (it
        has context) or the prefill path (it has none): exact, logged once;
      * a row without context ahead of a row with context would run on the
        extend path with an empty context (and, under upstream's argmax split,
        the rows with context behind it on the prefill path, without their
        context): ``BatchOrderError`` names them.
    Permuting rows instead would mean moving q/k/v/output per layer on the GPU;
    the runners order the batch, this only verifies, in O(num_reqs) numpy.
    """
    qsl = query_start_loc_cpu.numpy()
    q = np.diff(qsl)
    num_reqs = q.size
    c = seq_lens_cpu.numpy()[:num_reqs] - q
    classes = classify(q, c, decode_threshold)
    if num_reqs < 2 or not bool((classes[1:] < classes[:-1]).any()):
        num_decodes, prefill_start = np.searchsorted(
            classes, (EXTEND, PREFILL)
        ).tolist()
    else:
        num_decodes, prefill_start = _out_of_order_segments(q, c, decode_threshold)

    num_decode_tokens = int(qsl[num_decodes])
    prefill_token_start = int(qsl[prefill_start])
    return (
        num_decodes,
        prefill_start - num_decodes,
        num_reqs - prefill_start,
        num_decode_tokens,
        prefill_token_start - num_decode_tokens,
        num_tokens - prefill_token_start,
    )


def check_split(
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    num_decodes: int,
    num_extends: int,
    decode_threshold: int,
) -> None:
    """Verify a split against exact ``seq_lens`` (CPU); raise naming bad rows.

    Decode rows need q <= t, extend rows context (or no tokens), prefill rows
    no context. For metadata builders that already hold both CPU tensors.
    """
    q = query_lens.numpy()
    c = seq_lens.numpy()[: q.size] - q
    ext_end = num_decodes + num_extends
    bad = np.concatenate(
        (
            np.flatnonzero(q[:num_decodes] > decode_threshold),
            np.flatnonzero((c[num_decodes:ext_end] <= 0) & (q[num_decodes:ext_end] > 0))
            + num_decodes,
            np.flatnonzero(c[ext_end:] > 0) + ext_end,
        )
    )
    if bad.size:
        raise BatchOrderError(
            f"attention split [decode {num_decodes} | extend {num_extends} | "
            f"prefill {q.size - ext_end}] (decode threshold {decode_threshold}) "
            f"puts request(s) {_describe(bad, q, c, decode_threshold)} on a path "
            "that cannot compute them",
            bad.tolist(),
        )
