"""The AMD compile tier: the series' Triton kernels compiled for gfx942 and gfx950 on
this CPU, through the wrappers' own config selection, against their resource budgets
(docs/compile-tier.md); and ``make compile-report`` end to end.  Facts are cached by kernel
source hash outside the checkout: an unchanged kernel costs seconds.  Deselect with ``-m "not
compile"``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from compile_tier.cases import BLOCK_SIZES, GROUPS, HEAD_SIZES  # noqa: E402
from compile_tier.run import run  # noqa: E402
from compile_tier.targets import TARGETS  # noqa: E402

pytestmark = pytest.mark.compile

NAMES = tuple(TARGETS)

# The occupancy each kernel's design needs, in waves per SIMD.  Every kernel is written for at
# least two co-resident programs per CU, or two waves per SIMD, so that one's memory latency
# hides behind the other's work (paged_context_attention sizes its context split for two
# programs per CU); the copy kernels move whole pages per program, so two programs' worth of
# tiles in flight is the least that keeps HBM busy.
FLOOR_AMD_WAVES = 2


def _no_amd_backend() -> str:
    try:
        from triton.backends import backends
    except ImportError:
        return "no triton"
    return "" if "amd" in backends else "triton has no amd backend"


@pytest.fixture(scope="session")
def tier():
    if reason := _no_amd_backend():
        pytest.skip(reason)
    result = run(NAMES)
    print(f"\ncompile tier: {len(result['records'])} cases, unique {result['unique']}, "
          f"compiled {result['compiled']}, {result['seconds']} s")
    return result


def _records(tier, target, kernel=None):
    return [r for r in tier["records"] if r["target"] == target
            and (kernel is None or r["kernel"] == kernel)]


def _failures(lines: list[str]) -> str:
    return "\n  ".join([f"{len(lines)} cases:"] + lines[:40])


@pytest.mark.parametrize("target", NAMES)
def test_every_config_compiles(tier, target):
    bad = [f"{r['kernel']} {r['case']}: {r['facts']['error'][:300]}"
           for r in _records(tier, target) if "error" in r["facts"]]
    assert not bad, _failures(bad)


@pytest.mark.parametrize("target", NAMES)
def test_no_register_spills(tier, target):
    """No VGPR spill and no scratch."""
    bad = [f"{r['kernel']} {r['case']} {r['config']}: {r['facts']['vgpr_spill']} VGPR spills, "
           f"{r['facts']['scratch_bytes']} B scratch"
           for r in _records(tier, target) if "error" not in r["facts"] and r["facts"]["spills"]]
    assert not bad, _failures(bad)


@pytest.mark.parametrize("target", NAMES)
def test_occupancy_floors(tier, target):
    bad = []
    for r in _records(tier, target):
        f = r["facts"]
        if "error" not in f and f["waves_per_simd"] < FLOOR_AMD_WAVES:
            bad.append(f"{r['kernel']} {r['case']} {r['config']}: {f['waves_per_simd']} "
                       f"waves/SIMD (VGPR {f['vgpr']} + AGPR {f['agpr']}, LDS "
                       f"{f['lds_bytes']} B) < {FLOOR_AMD_WAVES}")
    assert not bad, _failures(bad)


@pytest.mark.parametrize("target", NAMES)
def test_fetch_kv_moves_16_byte_vectors(tier, target):
    """Every layout fetch_kv's docstring claims moves its pages in 16-byte
    vectors: the 16-byte loads and stores in the generated code (dwordx4)
    carry all of each thread's K and V bytes, and no
    narrower store exists (loads narrower than 16 bytes are the request
    metadata and plan rows)."""
    records = _records(tier, target, "fetch_kv")
    assert {r["case"].split("_")[0] for r in records} == {"nhd", "shuffle"}
    bad = []
    for r in records:
        f, want = r["facts"], r["expect"]
        if "error" in f:
            continue
        width = want["vector_bytes"]
        loads = f["memory_ops"]["load"].get(str(width), 0) * width
        stores = f["memory_ops"]["store"]
        narrow = {w: n for w, n in stores.items() if int(w) != width}
        if loads < want["load_bytes_per_thread"] or narrow or \
                stores.get(str(width), 0) * width != want["store_bytes_per_thread"]:
            bad.append(f"{r['case']} {r['config']}: loads {f['memory_ops']['load']}, stores "
                       f"{stores} (bytes by width); each thread moves "
                       f"{want['load_bytes_per_thread']} B in, "
                       f"{want['store_bytes_per_thread']} B out")
    assert not bad, _failures(bad)


def test_the_matrix_is_covered_and_deduplicated(tier):
    """Every value of every axis reaches the compiler for every target, and
    identical compiles are compiled once."""
    for target in NAMES:
        paged = {r["case"] for r in _records(tier, target, "paged_context_attention")}
        for d in HEAD_SIZES:
            assert any(c.startswith(f"d{d}_") for c in paged), (target, d)
        for bs in BLOCK_SIZES:
            assert any(f"_b{bs}_" in c for c in paged), (target, bs)
        for g in GROUPS:
            assert any(f"_g{g}_" in c for c in paged), (target, g)
        fp8 = TARGETS[target].fp8_e4m3.removeprefix("float8_")
        for kernel in ("paged_context_attention", "fetch_kv"):
            cases = {r["case"] for r in _records(tier, target, kernel)}
            assert any(fp8 in c for c in cases), (target, kernel, fp8)
            assert any("fp16" in c for c in cases) and any("bf16" in c for c in cases)
        assert tier["unique"][target] < len(_records(tier, target))


GENERATED = {"benchmarks/results/compile/gfx942.json", "benchmarks/results/compile/gfx950.json",
             "docs/compile-tier.md", "docs/roofline-amd.md"}


def _changed(repo: Path) -> set[str]:
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"],
                            check=True, capture_output=True, text=True).stdout
    return {line[3:] for line in status.splitlines()}


def test_compile_report_writes_only_its_files_and_a_rerun_changes_none(tier, tmp_path):
    """In a clone of this checkout as it is (HEAD + local changes), so the checkout is never written."""
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(clone)], check=True)
    local = subprocess.run(["git", "-C", str(REPO), "ls-files", "-m", "-o", "--exclude-standard"],
                           check=True, capture_output=True, text=True).stdout.splitlines()
    for rel in local:
        if (REPO / rel).is_file():
            shutil.copy2(REPO / rel, clone / rel, follow_symlinks=False)
    ours, before = _changed(REPO), _changed(clone)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(clone / "scripts" / "compile_tier.py"), "report"]
    runs, texts = [], []
    for _ in range(2):
        runs.append(subprocess.run(cmd, cwd=clone, env=dict(env, TMPDIR=str(scratch)),
                                   capture_output=True, text=True, timeout=3600))
        assert runs[-1].returncode == 0, runs[-1].stdout + runs[-1].stderr
        texts.append({rel: (clone / rel).read_text() for rel in GENERATED})
    assert texts[0] == texts[1], "a rerun changed its files"
    assert _changed(clone) - before <= GENERATED, _changed(clone) - before
    region = (clone / "docs" / "roofline-amd.md").read_text().split("<!-- roofline:begin")[1]
    assert "### fetch_kv" in region and "### paged_context" in region and "MI300X bound µs" in region
    assert list(scratch.iterdir()) == [], "scratch folder left behind"
    assert _changed(REPO) == ours, "the test wrote into the checkout"
