# SPDX-License-Identifier: Apache-2.0
"""Fused MLA RoPE + KV-cache write: ours vs what vLLM runs today (GPU).

DeepSeek-V3 shapes: kv_lora_rank L = 512, rotary dim R = 64 (GPT-J style,
YaRN cache in bf16 as vLLM hands it to kernels), q = [q_nope 128 | q_pe 64]
per head, cache block 64, bf16 model; caches bf16 ("auto") or fp8 (uint8,
e4m3, per-tensor k_scale).  Every size is timed as CUDA-graph replays; sizes
whose calls touch enough bytes are timed cold (the graph rotates over buffer
sets holding 4x the L2, benchmarks/timing.py; each set its own inputs,
outputs, cache blocks and RoPE rows), the smallest decode sizes warm (each
case records its ``mode``).

Cases and what each impl does (all produce the same results):

  * ``decode_*`` -- ``q_out = [ql_nope | rope(q_pe)]`` + cache write:
      ours              ``mla_rope_concat_and_cache`` (one launch)
      baseline          vLLM's CUDA ``concat_and_cache_mla_rope_fused``
                        (rotates q_pe / k_pe in place, writes the cache) +
                        ``torch.cat([ql_nope, q_pe])``
      compiled_unfused  RoPE through ``torch.compile`` (the graph also builds
                        the cache rows, ``[kv_c | k_pe]``, fp8-quantised),
                        then the cache scatter (eager ``index_copy_``), then
                        the eager ``torch.cat``: vLLM's compiled model + MLA
                        layer, with a two-kernel stand-in (row build fused
                        into the compiled graph + scatter) for its
                        one-kernel ``concat_and_cache_mla``
  * ``rope_inplace_*`` -- the decode sizes, job of the CUDA kernel alone
    (rotate q_pe / k_pe in place, write the cache):
      ours              ``mla_rope_and_cache``
      baseline          vLLM's CUDA ``concat_and_cache_mla_rope_fused``
      compiled_unfused  compiled RoPE (in place into q, as ``mla.py``) + the
                        same cache write
  * ``prefill_*`` -- same job as ``rope_inplace_*`` at 2K / 8K / 32K tokens.

vLLM's CUDA kernel is compiled here from the pinned tree's ``csrc/`` (env
``VLLM_PINNED_TREE``, default ``build/vllm``; ``.pinned`` when the needed
files were copied there by ``python benchmarks/bench_mla_rope_cache.py
stage <tree> .pinned``): the kernel file and the headers it includes are
copied into a scratch build folder (``$TMPDIR/vllm_mla_rope_fused_bench_build``)
together with our ``benchmarks/csrc/
torch_utils.h`` (the pinned one calls a stable-ABI shim newer than the
benchmark machine's torch) and built with ``-DENABLE_FP8`` for the local GPU
architecture.  When the build fails the baseline is recorded as unavailable,
with the error.

``nbytes`` counts what the op must read and write once: q / ql_nope / kv_c /
k_pe reads, q_out / q_pe / k_pe / cache-row writes.
"""

import math
import os
import re
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

# What "baseline" is in this suite (recorded with every case by kernel_bench).
BASELINE = (
    "vLLM's CUDA concat_and_cache_mla_rope_fused (compiled at run time from the pinned csrc) followed by the q concat; compiled_unfused = torch.compile RoPE, cache write, concat"
)

REPO = Path(__file__).resolve().parent.parent
L, R, QK_NOPE = 512, 64, 128
BLOCK_SIZE = 64
MAX_POS = 163840  # DeepSeek-V3: 4096 original positions x YaRN factor 40
FP8_MAX = 448.0  # e4m3fn (the CUDA benchmark machine)
DECODE_TOKENS = (1, 8, 64, 256)
DECODE_HEADS = (16, 128)
PREFILL_TOKENS = (2048, 8192, 32768)
PREFILL_HEADS = 16
CACHE_DTYPES = ("auto", "fp8")

FUSED_KERNEL_FILE = "cache_kernels_fused.cu"
OUR_CSRC = REPO / "benchmarks" / "csrc"


# ---------------------------------------------------------------------------
# vLLM's CUDA kernel, built from the pinned tree
# ---------------------------------------------------------------------------


def pinned_csrc() -> Path:
    tree = Path(os.environ.get("VLLM_PINNED_TREE", "build/vllm"))
    return (tree if tree.is_absolute() else REPO / tree) / "csrc"


def csrc_closure(csrc: Path, start: str = FUSED_KERNEL_FILE) -> list[str]:
    """``start`` and the csrc headers it includes (quoted), transitively.

    ``torch_utils.h`` is left out: ours (``benchmarks/csrc``) replaces it.
    """
    seen: set[str] = set()
    todo = [start]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        text = (csrc / rel).read_text()
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE):
            if Path(inc).name == "torch_utils.h":
                continue
            for base in (Path(rel).parent, Path()):
                cand = os.path.normpath(base / inc)
                if (csrc / cand).is_file():
                    todo.append(cand)
                    break
    return sorted(seen)


def stage_csrc(csrc: Path, dest: Path, start: str = FUSED_KERNEL_FILE) -> None:
    """Copy ``start``'s file closure from ``csrc`` to ``dest`` (same layout)."""
    for rel in csrc_closure(csrc, start):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(csrc / rel, dest / rel)


def build_pinned_extension(name: str, kernel_file: str, binding: str):
    """Compile ``csrc/<kernel_file>`` of the pinned tree with our
    ``benchmarks/csrc/<binding>``; returns the extension module or raises."""
    from torch.utils.cpp_extension import load

    csrc = pinned_csrc()
    if not (csrc / kernel_file).is_file():
        raise FileNotFoundError(f"{csrc / kernel_file} not found (set VLLM_PINNED_TREE)")
    # A fixed scratch folder: a second build with unchanged sources is a no-op.
    build_dir = Path(tempfile.gettempdir()) / f"{name}_build"
    stage = build_dir / "csrc"
    stage.mkdir(parents=True, exist_ok=True)
    stage_csrc(csrc, stage, kernel_file)
    shutil.copy2(OUR_CSRC / "torch_utils.h", stage / "torch_utils.h")
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    os.environ.setdefault("MAX_JOBS", "16")
    # As vLLM's CMake builds its stable-ABI CUDA sources (target torch 2.11,
    # fp8 on, without torch's no-half-operator defines).  The binding (.cpp)
    # uses ATen and gets plain flags.
    cuda_flags = ["-O3", "-DENABLE_FP8", "-DUSE_CUDA",
                  "-DTORCH_TARGET_VERSION=0x020B000000000000ULL", "--expt-relaxed-constexpr",
                  "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
    return load(name=name, sources=[str(stage / kernel_file), str(OUR_CSRC / binding)],
                extra_include_paths=[str(stage)], extra_cflags=["-O3"],
                extra_cuda_cflags=cuda_flags, build_directory=str(build_dir), verbose=False)


def build_cuda_fused():
    """Compile vLLM's ``concat_and_cache_mla_rope_fused``; returns the op or raises."""
    return build_pinned_extension("vllm_mla_rope_fused_bench", FUSED_KERNEL_FILE,
                                  "mla_rope_fused_binding.cpp").concat_and_cache_mla_rope_fused


@pytest.fixture(scope="module")
def cuda_fused():
    """(op, None) when vLLM's kernel built, else (None, error text)."""
    try:
        return build_cuda_fused(), None
    except Exception as exc:  # noqa: BLE001 -- record the baseline as unavailable
        err = f"CUDA baseline build failed: {type(exc).__name__}: {exc}"
        traceback.print_exc()
        return None, err[-1500:]


# ---------------------------------------------------------------------------
# The unfused sequence as vLLM runs it when compiled
# ---------------------------------------------------------------------------


def _rope_gptj(positions, x, cos_sin):
    """vLLM's native rotary embedding (model dtype), GPT-J style."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _rope_qk(positions, q_pe, k_pe, cos_sin):
    return _rope_gptj(positions, q_pe, cos_sin), _rope_gptj(positions, k_pe, cos_sin)


def _cache_rows(kv_c, k_rot, k_scale, fp8: bool):
    """``concat_and_cache_mla``'s row values: ``[kv_c | k_pe]`` (fp8: / k_scale, saturated)."""
    row = torch.cat([kv_c, k_rot], dim=-1)
    if fp8:
        row = (row.float() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        row = row.view(torch.uint8)
    return row


def _unfused_decode_graph(positions, q_pe, k_pe, kv_c, cos_sin, k_scale, fp8: bool):
    q_rot, k_rot = _rope_qk(positions, q_pe, k_pe, cos_sin)
    return q_rot, _cache_rows(kv_c, k_rot, k_scale, fp8)


def _unfused_prefill_graph(positions, q_pe, k_pe, kv_c, cos_sin, k_scale, fp8: bool):
    # mla.py: q[..., P:], k_pe = rotary_emb(positions, q[..., P:], k_pe)
    q_rot, k_rot = _rope_qk(positions, q_pe, k_pe, cos_sin)
    q_pe.copy_(q_rot)
    k_pe.copy_(k_rot)
    return _cache_rows(kv_c, k_rot, k_scale, fp8)


@pytest.fixture(scope="module")
def compiled():
    # The compiled graphs are pure apart from the q_pe / k_pe updates; the
    # cache scatter runs eagerly (index_copy_ into the cache), as vLLM's
    # concat_and_cache_mla custom op sits outside the compiled graph.
    return {
        "decode": torch.compile(_unfused_decode_graph, dynamic=True),
        "prefill": torch.compile(_unfused_prefill_graph, dynamic=True),
    }


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def cos_sin_cache(device) -> torch.Tensor:
    """DeepSeek-V3 YaRN ``cat(cos, sin)`` cache (mscale ratio 1), bf16."""
    base, factor, orig, half = 10000.0, 40.0, 4096, R // 2
    exps = torch.arange(0, R, 2, dtype=torch.float64, device=device) / R
    extra = base**-exps
    def correction_dim(rotations):  # YaRN, beta_fast 32 / beta_slow 1
        return R * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(correction_dim(32)), math.ceil(correction_dim(1))
    ramp = ((torch.arange(half, dtype=torch.float64, device=device) - low) / (high - low))
    keep = 1 - ramp.clamp(0, 1)
    inv_freq = extra / factor * (1 - keep) + extra * keep
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float64, device=device), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.bfloat16)


def make_input_sets(T: int, H: int, cache_dtype: str, decode: bool, sets: int = 1,
                    seed: int = 0, cos_sin: torch.Tensor | None = None,
                    device: str = "cuda") -> list[dict]:
    """``sets`` buffer sets of one case: each its own q / kv / ql_nope / q_out,
    slots in disjoint cache blocks of one shared cache and (prefill) its own
    positions, so that no set reads or writes another's bytes; the RoPE cache is
    shared (each set reads its own rows of it)."""
    dev = device
    gen = torch.Generator(device=dev).manual_seed(seed)
    bf16 = torch.bfloat16
    blocks_per_set = T if decode else -(-T // BLOCK_SIZE)
    num_blocks = max(4096, 2 * T, 1 + sets * blocks_per_set)
    # Block ids 1..: each set its own slice, randomly permuted.
    perm = torch.randperm(num_blocks - 1, device=dev, generator=gen)[: sets * blocks_per_set] + 1
    fp8 = cache_dtype == "fp8"
    kv_cache = torch.zeros(num_blocks, BLOCK_SIZE, L + R, device=dev,
                           dtype=torch.uint8 if fp8 else bf16)
    cos_sin = cos_sin_cache(dev) if cos_sin is None else cos_sin
    k_scale = torch.tensor([0.37], device=dev)
    out = []
    for index in range(sets):
        blocks = perm[index * blocks_per_set : (index + 1) * blocks_per_set]
        if decode:  # each token a different request: random block and position
            positions = torch.randint(0, MAX_POS, (T,), device=dev, generator=gen)
            slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        else:  # one prompt: consecutive tokens fill randomly permuted blocks
            tok = torch.arange(T, device=dev)
            slots = blocks[tok // BLOCK_SIZE] * BLOCK_SIZE + tok % BLOCK_SIZE
            start = (1000 + index * T) % (MAX_POS - T)  # each set its own RoPE rows
            positions = torch.arange(T, device=dev) + start
        q = torch.randn(T, H, QK_NOPE + R, device=dev, dtype=bf16, generator=gen)
        kv = torch.randn(T, L + R, device=dev, dtype=bf16, generator=gen)
        out.append(dict(
            q=q, q_pe=q[..., QK_NOPE:],
            ql_nope=torch.randn(H, T, L, device=dev, dtype=bf16, generator=gen).transpose(0, 1),
            kv_c=kv[:, :L], k_pe=kv[:, L:], kv_cache=kv_cache,
            slots=slots.long(), positions=positions.long(), cos_sin=cos_sin, k_scale=k_scale,
            q_out=torch.empty(T, H, L + R, device=dev, dtype=bf16), fp8=fp8,
        ))
    return out


def make_inputs(T: int, H: int, cache_dtype: str, decode: bool, seed: int = 0) -> dict:
    """One buffer set (``make_input_sets`` with ``sets=1``)."""
    return make_input_sets(T, H, cache_dtype, decode, seed=seed)[0]


def decode_bytes(T, H, fp8):
    cache_elem = 1 if fp8 else 2
    reads = 2 * T * (H * L + H * R + L + R) + 16 * T
    writes = 2 * T * H * (L + R) + cache_elem * T * (L + R)
    return reads + writes


def inplace_bytes(T, H, fp8):
    cache_elem = 1 if fp8 else 2
    return 2 * 2 * T * (H * R + R) + 2 * T * L + 16 * T + cache_elem * T * (L + R)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


def _impls_inplace(x, cuda_op, compiled):
    from vllm.v1.attention.ops.triton_mla_rope_cache import mla_rope_and_cache

    kv_dtype = "fp8" if x["fp8"] else "auto"

    def ours():
        mla_rope_and_cache(x["q_pe"], x["kv_c"], x["k_pe"], x["kv_cache"], x["slots"],
                           x["positions"], x["cos_sin"], False, kv_cache_dtype=kv_dtype,
                           k_scale=x["k_scale"])

    def baseline():
        cuda_op(x["positions"], x["q_pe"], x["k_pe"], x["kv_c"], x["cos_sin"], False,
                x["slots"], x["kv_cache"], kv_dtype, x["k_scale"])

    def compiled_unfused():
        rows = compiled["prefill"](x["positions"], x["q_pe"], x["k_pe"], x["kv_c"], x["cos_sin"],
                                   x["k_scale"], x["fp8"])
        x["kv_cache"].view(-1, L + R).index_copy_(0, x["slots"], rows)

    return {"ours": ours, "baseline": baseline if cuda_op else None,
            "compiled_unfused": compiled_unfused}


def _impls_decode(x, cuda_op, compiled):
    from vllm.v1.attention.ops.triton_mla_rope_cache import mla_rope_concat_and_cache

    kv_dtype = "fp8" if x["fp8"] else "auto"

    def ours():
        mla_rope_concat_and_cache(x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"], x["kv_cache"],
                                  x["slots"], x["positions"], x["cos_sin"], False,
                                  kv_cache_dtype=kv_dtype, k_scale=x["k_scale"],
                                  q_out=x["q_out"])

    def baseline():
        cuda_op(x["positions"], x["q_pe"], x["k_pe"], x["kv_c"], x["cos_sin"], False,
                x["slots"], x["kv_cache"], kv_dtype, x["k_scale"])
        torch.cat([x["ql_nope"], x["q_pe"]], dim=-1, out=x["q_out"])

    def compiled_unfused():
        q_rot, rows = compiled["decode"](x["positions"], x["q_pe"], x["k_pe"], x["kv_c"],
                                         x["cos_sin"], x["k_scale"], x["fp8"])
        x["kv_cache"].view(-1, L + R).index_copy_(0, x["slots"], rows)
        torch.cat([x["ql_nope"], q_rot], dim=-1, out=x["q_out"])

    return {"ours": ours, "baseline": baseline if cuda_op else None,
            "compiled_unfused": compiled_unfused}


DECODE_PARAMS = [pytest.param(T, H, c, id=f"T{T}_h{H}_{c}")
                 for c in CACHE_DTYPES for H in DECODE_HEADS for T in DECODE_TOKENS]
PREFILL_PARAMS = [pytest.param(T, c, id=f"T{T}_{c}") for c in CACHE_DTYPES
                  for T in PREFILL_TOKENS]


def _shapes(T, H, cache):
    return {"T": T, "H": H, "L": L, "R": R, "block_size": BLOCK_SIZE, "model_dtype": "bf16",
            "kv_cache_dtype": cache, "rope": "gptj", "cos_sin_dtype": "bf16"}


def _sets(T, H, cache, decode, impls_of, op, compiled):
    """buffer_sets for kernel_bench: ``sets`` input sets, one impls dict each."""
    cos_sin = cos_sin_cache("cuda")
    return lambda sets: [impls_of(x, op, compiled) for x in
                         make_input_sets(T, H, cache, decode, sets=sets, cos_sin=cos_sin)]


@pytest.mark.parametrize("T,H,cache", DECODE_PARAMS)
def test_decode(kernel_bench, cuda_fused, compiled, T, H, cache):
    op, err = cuda_fused
    kernel_bench(kernel="mla_rope_cache", case=f"decode_T{T}_h{H}_{cache}",
                 shapes=_shapes(T, H, cache), nbytes=decode_bytes(T, H, cache == "fp8"),
                 buffer_sets=_sets(T, H, cache, True, _impls_decode, op, compiled), graph=True,
                 notes=err or "")


@pytest.mark.parametrize("T,H,cache", DECODE_PARAMS)
def test_rope_inplace(kernel_bench, cuda_fused, compiled, T, H, cache):
    op, err = cuda_fused
    kernel_bench(kernel="mla_rope_cache", case=f"rope_inplace_T{T}_h{H}_{cache}",
                 shapes=_shapes(T, H, cache), nbytes=inplace_bytes(T, H, cache == "fp8"),
                 buffer_sets=_sets(T, H, cache, True, _impls_inplace, op, compiled), graph=True,
                 notes=err or "")


@pytest.mark.parametrize("T,cache", PREFILL_PARAMS)
def test_prefill(kernel_bench, cuda_fused, compiled, T, cache):
    op, err = cuda_fused
    kernel_bench(kernel="mla_rope_cache", case=f"prefill_T{T}_h{PREFILL_HEADS}_{cache}",
                 shapes=_shapes(T, PREFILL_HEADS, cache),
                 nbytes=inplace_bytes(T, PREFILL_HEADS, cache == "fp8"),
                 buffer_sets=_sets(T, PREFILL_HEADS, cache, False, _impls_inplace, op, compiled),
                 graph=True, notes=err or "")


if __name__ == "__main__":
    # python benchmarks/bench_mla_rope_cache.py stage <vllm tree> <dest tree>
    # copies the fused kernel's csrc files to <dest tree>/csrc (e.g. .pinned).
    if len(sys.argv) == 4 and sys.argv[1] == "stage":
        stage_csrc(Path(sys.argv[2]) / "csrc", Path(sys.argv[3]) / "csrc")
        print("\n".join(csrc_closure(Path(sys.argv[3]) / "csrc")))
    else:
        sys.exit(__doc__)
