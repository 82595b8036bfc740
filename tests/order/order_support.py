"""Shared pieces of the batch-order tests: request rows, runner stubs, and the
ground truth, written here from the issue's definitions (not from the code
under test).

Ground truth for a request with query length q, context c (tokens cached
before the step) and decode threshold t:
    decode  if q <= t
    extend  if q > t and c > 0
    prefill if q > t and c == 0
A batch honours the contract when its classes never decrease along the batch.
The exact paths of a row: decode needs q <= t, extend needs c > 0, prefill
needs c == 0.

The unpatched functions come from the build tree's root commit (pristine vLLM
0.34.0), read with ``git show`` and executed as a module of their own. Tree:
``$VLLM_BUILD_TREE``, default ``build/vllm`` under the repository.
"""

import ast
import os
import subprocess
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

ORDER = {"decode": 0, "extend": 1, "prefill": 2}


@dataclass(frozen=True)
class Row:
    """One scheduled request."""

    name: str
    q: int  # tokens scheduled this step (drafts included)
    ctx: int  # tokens already in the KV cache
    prompt: int  # prompt length
    drafts: int = 0  # draft tokens among q (spec verification row when > 0)

    @property
    def prefilling(self) -> bool:
        return self.ctx < self.prompt


def truth(q: int, ctx: int, threshold: int) -> str:
    if q <= threshold:
        return "decode"
    return "extend" if ctx > 0 else "prefill"


def honours_contract(rows: list[Row], threshold: int) -> bool:
    ranks = [ORDER[truth(r.q, r.ctx, threshold)] for r in rows]
    return all(a <= b for a, b in zip(ranks, ranks[1:], strict=False))


def truth_counts(rows: list[Row], threshold: int) -> tuple[int, ...]:
    """(decodes, extends, prefills, decode tokens, extend tokens, prefill tokens)."""
    counts = {k: [0, 0] for k in ORDER}
    for r in rows:
        c = counts[truth(r.q, r.ctx, threshold)]
        c[0] += 1
        c[1] += r.q
    return tuple(counts[k][0] for k in ORDER) + tuple(counts[k][1] for k in ORDER)


def exact_paths(row: Row, threshold: int) -> set[str]:
    paths = {"decode"} if row.q <= threshold else set()
    paths.add("extend" if row.ctx > 0 else "prefill")
    return paths


def segments(num_decodes: int, num_extends: int, num_reqs: int) -> list[str]:
    num_prefills = num_reqs - num_decodes - num_extends
    return (
        ["decode"] * num_decodes + ["extend"] * num_extends + ["prefill"] * num_prefills
    )


def make_cam(rows: list[Row]):
    """CommonAttentionMetadata of the batch, seq_lens exact (= upper bound)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor([r.q for r in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(q, 0, out=qsl[1:])
    seq = q + torch.tensor([r.ctx for r in rows], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        seq_lens_cpu_upper_bound=seq,
        num_reqs=len(rows),
        num_actual_tokens=num_tokens,
        max_query_len=int(q.max()),
        max_seq_len=int(seq.max()),
        block_table_tensor=torch.zeros(len(rows), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
    )


def mrv2_req_states(rows: list[Row]) -> SimpleNamespace:
    """The parts of MRv2's RequestState the batch order reads.

    State indices are deliberately not the emission order (reversed).
    """
    n = len(rows)
    index = {r.name: n - 1 - i for i, r in enumerate(rows)}
    prefill_len = np.zeros(n, dtype=np.int32)
    computed = np.zeros(n, dtype=np.int32)
    for r in rows:
        prefill_len[index[r.name]] = r.prompt
        computed[index[r.name]] = r.ctx
    return SimpleNamespace(
        req_id_to_index=index,
        num_computed_prefill_tokens=np.minimum(computed, prefill_len),
        prefill_len=SimpleNamespace(np=prefill_len),
    )


def mrv2_order(sort_batch_req_ids, rows: list[Row], decode_query_len: int, threshold):
    """Batch order from MRv2's real ``sort_batch_req_ids`` (patched signature)."""
    by_name = {r.name: r for r in rows}
    req_ids, num_tokens, idx = sort_batch_req_ids(
        {r.name: r.q for r in rows},
        {r.name: [7] * r.drafts for r in rows if r.drafts},
        decode_query_len,
        mrv2_req_states(rows),
        threshold,
    )
    ordered = [by_name[r] for r in req_ids]
    assert num_tokens.tolist() == [r.q for r in ordered]
    states = mrv2_req_states(rows)
    assert idx.tolist() == [states.req_id_to_index[r] for r in req_ids]
    return ordered


def cpu_req_states(rows: list[Row]) -> SimpleNamespace:
    """The parts of the standalone CPU runner's CPURequestState its sort reads.

    State indices are deliberately not the emission order (reversed).
    """
    states = mrv2_req_states(rows)
    return SimpleNamespace(
        req_id_to_index=states.req_id_to_index,
        num_computed_prefill_tokens=states.num_computed_prefill_tokens,
        prefill_len_np=states.prefill_len.np,
    )


def cpu_order(sort_batch_req_ids, rows: list[Row], threshold=None) -> list[Row]:
    """Batch order from the standalone CPU runner's ``sort_batch_req_ids``
    (patched signature; the runner supports decode_query_len 1 only)."""
    by_name = {r.name: r for r in rows}
    states = cpu_req_states(rows)
    req_ids, num_tokens, idx = sort_batch_req_ids(
        {r.name: r.q for r in rows}, 1, states, threshold
    )
    ordered = [by_name[r] for r in req_ids]
    assert num_tokens.tolist() == [r.q for r in ordered]
    assert idx.tolist() == [states.req_id_to_index[r] for r in req_ids]
    return ordered


def cpu_sort_as_patched(pristine_sort):
    """Pristine 0.34.0's CPU ``sort_batch_req_ids(num_tokens_per_req,
    decode_query_len) -> req_ids`` behind the patched signature, gathering
    token counts and state indices as the pristine runner does after it."""

    def sort(num_tokens_per_req, decode_query_len, req_states, decode_threshold=None):
        req_ids = pristine_sort(num_tokens_per_req, decode_query_len)
        num_tokens = np.array([num_tokens_per_req[r] for r in req_ids], np.int32)
        index = req_states.req_id_to_index
        return req_ids, num_tokens, np.array([index[r] for r in req_ids], np.intp)

    return sort


def build_tree() -> Path:
    tree = Path(os.environ.get("VLLM_BUILD_TREE", REPO / "build" / "vllm"))
    return tree if tree.is_absolute() else REPO / tree


def _git(tree: Path, *args: str) -> str:
    # The tree may belong to another user (unpacked archive): trust it here only.
    cmd = ["git", "-c", "safe.directory=*", "-C", str(tree), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


_MODULES: dict[str, types.ModuleType] = {}


def pristine_source(relpath: str) -> str:
    """Text of ``relpath`` in the build tree's root (pristine upstream) commit."""
    tree = build_tree()
    if not (tree / ".git").exists():
        raise RuntimeError(
            f"no build tree at {tree} (run `make apply` or set VLLM_BUILD_TREE)"
        )
    root = _git(tree, "rev-list", "--max-parents=0", "HEAD").split()[0]
    return _git(tree, "show", f"{root}:{relpath}")


def pristine_module(relpath: str, only: tuple[str, ...] = ()) -> types.ModuleType:
    """Execute the pristine ``relpath`` as a module of its own (cached).

    ``only`` keeps just the module's imports and the named top-level functions
    (for files whose module-level code should not run twice, e.g. the model
    runner).
    """
    key = f"{relpath}:{','.join(only)}"
    if key not in _MODULES:
        tree = ast.parse(pristine_source(relpath), filename=relpath)
        if only:
            tree.body = [
                node
                for node in tree.body
                if isinstance(node, (ast.Import, ast.ImportFrom))
                or (isinstance(node, ast.FunctionDef) and node.name in only)
            ]
            found = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert found == set(only), f"{relpath} lacks {set(only) - found}"
        name = "pristine_" + relpath.removesuffix(".py").replace("/", "_")
        module = types.ModuleType(name)
        module.__file__ = f"<pristine {relpath}>"
        exec(compile(tree, module.__file__, "exec"), module.__dict__)
        _MODULES[key] = module
    return _MODULES[key]
