"""Load upstream vLLM's own kernels from the pinned tree at run time.

Benchmarks compare the series' kernels against what upstream runs today.  The
upstream code is never copied into this repository: it is read from the
pinned vLLM tree (``$VLLM_PINNED_TREE``, default ``build/vllm``, the tree the
series applies to), the needed definitions (functions, classes, module-level
constants) are pulled out with ``ast``, and executed in a fresh namespace that
provides only torch / triton / tl (and small stand-ins for what those
definitions import from vLLM).  This works without installing or
importing vLLM, and on CUDA as well as ROCm (upstream keeps these kernels
under ``if current_platform.is_rocm():``).
"""

from __future__ import annotations

import ast
import enum
import linecache
import logging
import os
import typing
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
_AITER_FA = "vllm/v1/attention/backends/rocm_aiter_fa.py"
_GATHER_DEFS = ("block_size", "num_programs", "cp_mha_gather_cache_kernel", "cp_mha_gather_cache")


class UpstreamUnavailable(RuntimeError):
    """The pinned tree, or the definitions a benchmark needs, are not there."""


def pinned_tree() -> Path:
    tree = Path(os.environ.get("VLLM_PINNED_TREE", "build/vllm"))
    return tree if tree.is_absolute() else _REPO / tree


def _defined_name(node: ast.stmt) -> str | None:
    """The one name a function, class or single-name assignment defines, else None."""
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        target = node.target
    else:
        return None
    return target.id if isinstance(target, ast.Name) else None


def _collect_defs(module: ast.Module, names: tuple[str, ...],
                  relpath: str = _AITER_FA) -> list[ast.stmt]:
    """The functions, classes and single-name assignments defining ``names``, at
    module level or inside a module-level ``if``, in the order of ``names``."""
    found: dict[str, ast.stmt] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            name = _defined_name(node)
            if name in names:
                found.setdefault(name, node)
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


def _parse_pinned(relpath: str) -> ast.Module:
    path = pinned_tree() / relpath
    if not path.is_file():
        raise UpstreamUnavailable(
            f"upstream baseline needs {path} (set VLLM_PINNED_TREE to the pinned vLLM 0.34.0 "
            "tree, or build it under build/vllm)"
        )
    return ast.parse(path.read_text(), filename=str(path))


def load_defs(relpath: str, names: tuple[str, ...], extra: dict | None = None) -> dict:
    """Exec the named defs of ``<pinned tree>/<relpath>``; return the namespace.

    ``extra``: further names the definitions refer to (module-level values of
    the upstream file that the namespace below does not provide)."""
    defs = _collect_defs(_parse_pinned(relpath), names, relpath)
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


_UNIFIED = "vllm/v1/attention/ops/triton_unified_attention.py"
_HELPERS = "vllm/v1/attention/ops/triton_attention_helpers.py"
_KV_CACHE_INTERFACE = "vllm/v1/kv_cache_interface.py"
_TRITON_ATTN = "vllm/v1/attention/backends/triton_attn.py"
# What unified_attention runs, from its file: the launch tables, the launch
# helpers, the kernels and the wrapper.
_UNIFIED_DEFS = (
    "MAX_3D_QUERY_LEN", "_GFX1201_2D_CONFIGS", "_GFX1100_2D_CONFIGS",
    "_GFX1201_2D_DECODE_CONFIGS", "_GFX1100_2D_DECODE_CONFIGS", "_GFX1201_3D_HEADS",
    "_GFX1100_3D_CONFIGS", "_GFX1100_SW_2D_MIN_FILL",
    "_prefill_band_config", "_decode_2d_config", "_gfx1201_split_kv_segments",
    "_gfx1201_split_kv_launch", "_gfx1100_split_kv_segments",
    "_cast_kv_tile", "_load_q_td", "_load_kv_tile_td", "_store_output_td",
    "kernel_unified_attention", "reduce_segments",
    "_is_gemma3_attention", "_get_tile_size", "unified_attention",
)


def _gcn_arch() -> str:
    import torch

    if torch.version.hip is None or not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_properties(0).gcnArchName


class _Platform:
    """The ``current_platform`` queries triton_unified_attention.py makes, answered
    as the pinned tree does (platforms/interface.py, cuda.py, rocm.py)."""

    def fp8_dtype(self):
        import torch

        return torch.float8_e4m3fnuz if "gfx94" in _gcn_arch() else torch.float8_e4m3fn

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        import torch

        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        return (major * 10 + minor) // 10 == capability // 10


class _Logger:
    """vLLM's logger as the wrapper uses it (``debug_once``)."""

    def debug_once(self, msg: str, *args) -> None:
        logging.getLogger("upstream_unified_attention").debug(msg, *args)


def _imported_names(relpath: str, module: str) -> tuple[str, ...]:
    """The names ``<pinned tree>/<relpath>`` imports from ``module``."""
    for node in _parse_pinned(relpath).body:
        if isinstance(node, ast.ImportFrom) and node.module == module:
            return tuple(alias.name for alias in node.names)
    return ()


def load_unified_attention():
    """Upstream's ``unified_attention`` (the Triton kernel the ``triton_attn``
    backend runs for every batch), or raise UpstreamUnavailable.

    Its Triton helpers and ``KVQuantMode`` come from their pinned files too;
    what the module reads from vLLM at import (batch-invariant flag, fp8 type,
    RDNA checks, logger) is answered here as vLLM would on this machine."""
    import torch

    helper_names = _imported_names(_UNIFIED, "vllm.v1.attention.ops.triton_attention_helpers")
    if not helper_names:
        raise UpstreamUnavailable(f"{_UNIFIED} in the pinned tree imports no Triton helpers "
                                  "from triton_attention_helpers")
    helpers = load_defs(_HELPERS, helper_names)
    kv_quant_mode = load_defs(_KV_CACHE_INTERFACE, ("KVQuantMode",),
                              {"IntEnum": enum.IntEnum})["KVQuantMode"]
    platform = _Platform()
    arch = _gcn_arch()
    extra = {
        **{name: helpers[name] for name in helper_names},
        "KVQuantMode": kv_quant_mode,
        "Any": typing.Any,
        "current_platform": platform,
        "logger": _Logger(),
        # vllm.envs.VLLM_BATCH_INVARIANT, as vllm/envs.py reads it
        "is_batch_invariant": bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0"))),
        "float8_info": torch.finfo(platform.fp8_dtype()),
        # vllm/platforms/rocm.py on_gfx1201 / on_gfx1100 (False off ROCm)
        "is_gfx1201": "gfx1201" in arch,
        "is_gfx1100": "gfx1100" in arch,
    }
    return load_defs(_UNIFIED, _UNIFIED_DEFS, extra)["unified_attention"]


def triton_attn_split_k_args(num_heads: int, num_kv_heads: int, head_size: int,
                             device) -> dict:
    """The split-K arguments the ``triton_attn`` backend passes ``unified_attention``
    (``seq_threshold_3D``, ``num_par_softmax_segments`` and the three
    ``softmax_segm_*`` scratch buffers), as TritonAttentionMetadataBuilder sets
    them up from its file's constants: no speculative decoding, ``max_num_seqs``
    at least the threshold, a CUDA-graph capture size equal to it, not SM120
    (whose 64-segment layout this does not model)."""
    import torch

    consts = load_defs(_TRITON_ATTN, ("MIN_LAUNCH_GRID_SIZE_2D", "NUM_PAR_SOFTMAX_SEGMENTS"))
    threshold = consts["MIN_LAUNCH_GRID_SIZE_2D"] // num_kv_heads
    segments = consts["NUM_PAR_SOFTMAX_SEGMENTS"]
    rows = threshold  # query tokens of the 3D path: max_num_seqs_3d x 1
    head_padded = 1 << (head_size - 1).bit_length()
    f32 = dict(dtype=torch.float32, device=device)
    return {
        "seq_threshold_3D": threshold,
        "num_par_softmax_segments": segments,
        "softmax_segm_output": torch.empty(rows, num_heads, segments, head_padded, **f32),
        "softmax_segm_max": torch.empty(rows, num_heads, segments, **f32),
        "softmax_segm_expsum": torch.empty(rows, num_heads, segments, **f32),
    }


# Pinned-tree files the benchmark suites read (Triton sources exec'd above, the
# csrc kernels bench_mla_rope_cache.build_pinned_extension compiles).
PINNED_PY = (_AITER_FA, _MERGE, _UNIFIED, _HELPERS, _KV_CACHE_INTERFACE, _TRITON_ATTN)
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
