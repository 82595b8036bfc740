"""Load upstream vLLM's own kernels from the pinned tree at run time.

Benchmarks compare the series' kernels against what upstream runs today.  The
upstream code is never copied into this repository: it is read from the
pinned vLLM tree (``$VLLM_PINNED_TREE``, default ``build/vllm``, the tree the
series applies to), the needed definitions are pulled out with ``ast``, and
executed in a fresh namespace that provides only torch / triton / tl (and the
tiny helpers those definitions refer to).  This works without installing or
importing vLLM, and on CUDA as well as ROCm (upstream keeps these kernels
under ``if current_platform.is_rocm():``).
"""

from __future__ import annotations

import ast
import linecache
import os
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
_AITER_FA = "vllm/v1/attention/backends/rocm_aiter_fa.py"
_GATHER_DEFS = ("block_size", "num_programs", "cp_mha_gather_cache_kernel", "cp_mha_gather_cache")


class UpstreamUnavailable(RuntimeError):
    """The pinned tree, or the definitions a benchmark needs, are not there."""


def pinned_tree() -> Path:
    tree = Path(os.environ.get("VLLM_PINNED_TREE", "build/vllm"))
    return tree if tree.is_absolute() else _REPO / tree


def _collect_defs(module: ast.Module, names: tuple[str, ...],
                  relpath: str = _AITER_FA) -> list[ast.FunctionDef]:
    """Function defs named ``names`` at module level or inside a module-level ``if``."""
    found: dict[str, ast.FunctionDef] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                found.setdefault(node.name, node)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)

    visit(module.body)
    missing = [n for n in names if n not in found]
    if missing:
        raise UpstreamUnavailable(f"{relpath} in the pinned tree has no {', '.join(missing)}")
    return [found[n] for n in names]


def _num_compute_units() -> int:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def load_defs(relpath: str, names: tuple[str, ...], extra: dict | None = None) -> dict:
    """Exec the named defs of ``<pinned tree>/<relpath>``; return the namespace.

    ``extra``: further names the definitions refer to (module-level values of
    the upstream file that the namespace below does not provide)."""
    path = pinned_tree() / relpath
    if not path.is_file():
        raise UpstreamUnavailable(
            f"upstream baseline needs {path} (set VLLM_PINNED_TREE to the pinned vLLM 0.34.0 "
            "tree, or build it under build/vllm)"
        )
    defs = _collect_defs(ast.parse(path.read_text(), filename=str(path)), names, relpath)
    source = ast.unparse(ast.Module(body=defs, type_ignores=[])) + "\n"
    # triton.jit reads the kernel's source through inspect/linecache: register
    # the generated module under a name that says where it came from.
    filename = f"<upstream {relpath}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)

    import torch
    import triton
    import triton.language as tl

    namespace = {
        "__name__": "upstream_" + Path(relpath).stem,
        "torch": torch,
        "triton": triton,
        "tl": tl,
        "num_compute_units": _num_compute_units,
        **(extra or {}),
    }
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 (pinned tree's code)
    return namespace


def load_cp_mha_gather_cache():
    """Upstream's ``cp_mha_gather_cache`` (AITER FA's KV gather), or raise UpstreamUnavailable."""
    return load_defs(_AITER_FA, _GATHER_DEFS)["cp_mha_gather_cache"]


_MERGE = "vllm/v1/attention/ops/triton_merge_attn_states.py"


def load_triton_merge_attn_states():
    """Upstream's Triton ``merge_attn_states`` (the merge on CUDA-less / CDNA2
    platforms), or raise UpstreamUnavailable."""
    import torch

    # The kernel's FP8 bounds default to the platform fp8 type's (e4m3fn here).
    extra = {"float8_info": torch.finfo(torch.float8_e4m3fn)}
    return load_defs(_MERGE, ("merge_attn_states", "merge_attn_states_kernel"),
                     extra)["merge_attn_states"]


# Pinned-tree files the benchmark suites read (Triton sources exec'd above, the
# csrc kernels bench_mla_rope_cache.build_pinned_extension compiles).
PINNED_PY = (_AITER_FA, _MERGE)
PINNED_CSRC = ("cache_kernels_fused.cu", "attention/merge_attn_states.cu")


def stage_pinned(tree: Path, dest: Path) -> list[str]:
    """Copy what the suites need from the pinned tree ``tree`` to ``dest`` (the
    same layout), for a GPU machine that gets this checkout without build/:
    run the suites there with ``VLLM_PINNED_TREE=<dest>``."""
    import shutil

    from benchmarks.bench_mla_rope_cache import csrc_closure

    copied = []
    for rel in PINNED_PY:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / rel, dest / rel)
        copied.append(rel)
    for start in PINNED_CSRC:
        for rel in csrc_closure(tree / "csrc", start):
            (dest / "csrc" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tree / "csrc" / rel, dest / "csrc" / rel)
            copied.append(f"csrc/{rel}")
    return sorted(set(copied))


if __name__ == "__main__":
    import sys

    # python3 benchmarks/upstream_kernels.py stage <pinned tree> <dest>
    if len(sys.argv) == 4 and sys.argv[1] == "stage":
        sys.path.insert(0, str(_REPO))
        print("\n".join(stage_pinned(Path(sys.argv[2]), Path(sys.argv[3]))))
    else:
        sys.exit("usage: python3 benchmarks/upstream_kernels.py stage <pinned tree> <dest>")
