#!/usr/bin/env python3
"""make gpu-payload: what the GPU machine needs to import the patched vLLM from source.

The GPU machine (README "Test tiers") has python3 3.12 with torch, triton, numpy
and pytest (and torch's own requirements), no vLLM, no package index, and takes
at most 64 MiB of working tree, carried paths included.  ``build/vllm`` is 200 MB,
so this writes a pruned copy of what TESTS (``tests/aiter_fa``, ``tests/mla``)
import, into the git-ignored ``.gpu_payload/`` (added to ``.git/info/exclude`` when
nothing ignores it):

  vllm-src.zip   the build tree's ``vllm/*.py`` files that importing ROOTS needs
                 (AITER FA's backend, the MLA RoPE + KV-cache fusion,
                 ``vllm.config``, what the tests import): the closure
                 of their module-level imports (function bodies and
                 ``if TYPE_CHECKING:`` blocks skipped), plus RUNTIME_ROOTS, the
                 modules the test's code path imports inside functions.  No csrc,
                 tests, .so or data files.  Extracted on the device (``python3 -m
                 zipfile -e``), not imported from the zip: the test loads the
                 backend with ``spec_from_file_location`` and the model registry
                 hashes model files through ``__file__`` paths.
  whl/           cp312 manylinux x86_64 wheels of WHEELS, the third-party packages
                 importing those modules needs (each a hard import; found by
                 importing them with torch, triton, numpy and pytest alone) at the
                 exact versions ``.venv`` has, from PyPI (``pip download --no-deps``,
                 cached in ``~/.cache/vllm-aiter-series/gpu-wheels/cp312``).  Their
                 members are recompressed with LZMA (same files, so each wheel's
                 RECORD still holds; pip installs them with Python's ``lzma``):
                 52 MiB of wheels become 43.
  MANIFEST.json  the build tree's commit, the modules, and each wheel with the
                 sha256 PyPI served.

``--check`` then imports every root and runs TESTS on the CPU tier with the pruned
tree as the only vLLM (``.venv``'s packages, a fresh ``VLLM_CACHE_ROOT`` so the
model registry's subprocess runs too): the module set is complete for that path.
The roots are imported first, in a process of their own, because most of
``tests/mla`` skips itself (``importorskip``) where the fusion does not import.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import SeriesError, gitrepo, sdist  # noqa: E402

OUT = REPO / ".gpu_payload"
# What the GPU verbs run (tests/aiter_fa whole, tests/mla's `gpu` tests; --check: all of both).
TESTS = ("tests/aiter_fa", "tests/mla")
ROOTS = (
    "vllm.v1.attention.backends.rocm_aiter_fa",  # the backend under test (0200 + 0250)
    "vllm.config",
    # The GPU tier's merge (the test compiles it with the real Triton).
    "vllm.v1.attention.ops.triton_merge_attn_states",
    # The MLA RoPE + KV-cache fusion (overlay + 0301-0304): its layer glue,
    # decision, Triton kernel (tests/mla's CUDA-graph replay test compiles it),
    # AITER cos/sin cache and the workspace manager holding its q_out buffer.
    "vllm._aiter_ops",
    "vllm.model_executor.layers.attention.mla_rope_fusion",
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    "vllm.v1.attention.ops.triton_mla_rope_cache",
    "vllm.v1.worker.workspace",
    # ModelConfig inspects the architecture in a subprocess that imports it.
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.registry",
)
# Imported inside functions on the tests' path (a traced CPU-tier run of
# TESTS, then checked by --check): VllmConfig's post-init and the model
# registry subprocess.  tests/mla adds none: what its harness builds inside
# functions (MLAAttention, the rotary embeddings) the tests import too.
RUNTIME_ROOTS = (
    "vllm.distributed.ec_transfer",
    "vllm.lora.resolver",
    "vllm.model_executor.layers.pooler",
    "vllm.plugins.lora_resolvers.filesystem_resolver",
    "vllm.plugins.lora_resolvers.hf_hub_resolver",
    "vllm.third_party.pynvml",
    "vllm.utils.vmm_driver",  # 0.34.0: VllmConfig._resolve_extensible_kv_cache
    "vllm.v1.executor",
    "vllm.v1.pool.metadata",
    "vllm.v1.worker.worker_base",
)
# Distributions (as `pip freeze` names them), each a hard import of the modules
# above or a requirement transformers checks by metadata (charset-normalizer
# only silences requests' warning).  torch, triton, numpy, pytest and torch's
# requirements (setuptools, sympy, jinja2, ...) are there; of the latter,
# typing-extensions, filelock and fsspec travel anyway, at .venv's versions,
# since pydantic and huggingface-hub need recent ones.
WHEELS = (
    "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc", "annotated-types", "anyio",
    "apache-tvm-ffi", "attrs", "cachetools", "cbor2", "certifi", "charset-normalizer",
    "cloudpickle", "einops", "fastapi", "filelock", "frozenlist", "fsspec", "h11", "httpcore2",
    "httpx2", "huggingface-hub", "idna", "llguidance", "msgspec", "multidict", "openai",
    "oss-harmony", "partial-json-parser", "pillow", "prometheus-client", "propcache", "psutil",
    "py-cpuinfo", "pybase64", "pydantic", "pydantic-core", "pyyaml", "pyzmq", "regex",
    "requests", "safetensors", "sniffio", "starlette", "tokenizers", "tqdm", "transformers",
    "truststore", "typing-extensions", "typing-inspection", "urllib3", "uvloop", "xgrammar",
    "yarl",
)
# The device: CPython 3.12, x86-64, glibc >= 2.31 (llguidance 1.7 is built
# for manylinux_2_31; pip matches each listed tag exactly).
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
CARRY_LIMIT_MIB = 64  # the device tool's working tree, carried paths included


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------
# The module set.
# --------------------------------------------------------------------------


def module_file(pkg_root: Path, module: str) -> Path | None:
    """The .py file of a dotted module under pkg_root (the folder holding vllm/), or None."""
    base = pkg_root.joinpath(*module.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imported_modules(source: str, module: str, is_package: bool, *,
                     module_level: bool = True) -> set[str]:
    """Dotted names a module imports; ``from X import Y`` yields X and X.Y (Y may be a module).

    module_level: only what runs on import (skips function bodies and
    ``if TYPE_CHECKING:`` blocks); else every import statement.
    """
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(nodes) -> None:
        for node in nodes:
            if module_level and isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
                continue
            if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda)):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    name = f"{base}.{node.module}" if node.module else base
                else:
                    name = node.module or ""
                found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(source).body)
    return found


def module_closure(pkg_root: Path, roots: list[str]) -> set[str]:
    """Every vllm module importing ``roots`` executes (and their parent packages).

    A root that is not a .py module of the tree is an error: the tree is not
    what the payload expects (not built, or another vLLM).
    """
    missing = [r for r in roots if module_file(pkg_root, r) is None]
    if missing:
        raise SeriesError(f"{pkg_root} has no module {', '.join(missing)}: is it the patched "
                          "tree (make apply)?")
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        path = module_file(pkg_root, module)
        if module in seen or path is None:  # a name imported from a module, or compiled
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        names = imported_modules(path.read_text(encoding="utf-8"), module,
                                 path.name == "__init__.py")
        todo += [n for n in names if n == "vllm" or n.startswith("vllm.")]
    return seen


def test_imports(pkg_root: Path, paths: list[Path]) -> list[str]:
    """The vllm modules the test files import, anywhere in them (absolute imports).

    ``import vllm.x`` and ``from vllm.x import y`` need vllm.x, which stays in
    the list even when the tree lacks it (module_closure then refuses it);
    vllm.x.y counts only where it is a module of the tree.
    """
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("vllm."))
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.startswith("vllm."):
                    names.add(node.module)
                    names.update(f"{node.module}.{a.name}" for a in node.names
                                 if module_file(pkg_root, f"{node.module}.{a.name}"))
    return sorted(names)


def write_source_zip(pkg_root: Path, modules: set[str], dest: Path) -> int:
    """Zip the modules' files (sorted, fixed dates: the same tree gives the same bytes)."""
    files = sorted(str(module_file(pkg_root, m).relative_to(pkg_root)) for m in modules)
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for rel in files:
            info = zipfile.ZipInfo(rel, date_time=(2026, 11, 2, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, (pkg_root / rel).read_bytes())
    return len(files)


# --------------------------------------------------------------------------
# The wheels.
# --------------------------------------------------------------------------


def venv_versions(venv: Path) -> dict[str, str]:
    python = venv / "bin" / "python"
    if not python.exists():
        raise SeriesError(f"{python} not found: run `make venv` first")
    proc = subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SeriesError(f"pip freeze failed in {venv}: {proc.stderr.strip()}")
    versions = {}
    for line in proc.stdout.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            versions[canonical(name)] = version.strip()
    return versions


def pinned(names, versions: dict[str, str]) -> list[str]:
    missing = [n for n in names if canonical(n) not in versions]
    if missing:
        raise SeriesError(f".venv has no {', '.join(missing)}: run `make venv`")
    return [f"{n}=={versions[canonical(n)]}" for n in names]


def wheel_for(cache: Path, requirement: str) -> Path | None:
    name, _, version = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for path in cache.glob("*.whl"):
        w_name, w_version = path.name.split("-")[:2]
        if canonical(w_name) == canonical(stem) and w_version == version:
            return path
    return None


def download(requirements: list[str], cache: Path, python_version: str) -> list[Path]:
    """The manylinux wheels for CPython python_version, downloading only those the cache lacks."""
    cache.mkdir(parents=True, exist_ok=True)
    todo = [r for r in requirements if wheel_for(cache, r) is None]
    if todo:
        print(f"downloading {len(todo)} wheels into {cache} ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--no-deps", "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "-d", str(cache)]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        proc = subprocess.run(cmd + todo, capture_output=True, text=True)
        if proc.returncode:
            raise SeriesError("pip download failed:\n" + (proc.stderr or proc.stdout).strip())
    wheels = [wheel_for(cache, r) for r in requirements]
    lost = [r for r, w in zip(requirements, wheels, strict=True) if w is None]
    if lost:
        raise SeriesError(f"no cp312 manylinux wheel for {', '.join(lost)} in {cache}")
    return wheels


def recompress(src: Path, dest: Path, method: int) -> None:
    """The same wheel, every member recompressed with ``method`` (names, order, dates kept)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = method if data else zipfile.ZIP_STORED
            zout.writestr(out, data)


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------


def ensure_ignored(out: Path) -> None:
    """The payload must stay out of commits, and travel only as a carried path."""
    if not out.is_relative_to(REPO):
        return
    rel = out.relative_to(REPO).as_posix()
    proc = gitrepo.git(REPO, "check-ignore", "-q", rel, check=False)
    if proc.returncode == 0:
        return
    exclude = Path(gitrepo.out(REPO, "rev-parse", "--git-path", "info/exclude"))
    exclude = exclude if exclude.is_absolute() else REPO / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as f:
        f.write(f"/{rel}/\n")
    print(f"added /{rel}/ to {exclude.relative_to(REPO)}")


def travelling_bytes() -> int:
    """The working tree the device tool sends without carry: tracked + untracked-not-ignored."""
    names = gitrepo.out(REPO, "ls-files", "-z", "-c", "-o", "--exclude-standard").split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def check(src_zip: Path, venv: Path, roots: list[str], tree: Path) -> int:
    """TESTS on the CPU tier with the pruned tree as the only vLLM, after importing every root."""
    with tempfile.TemporaryDirectory(prefix="gpu-payload-check-") as tmp:
        site = Path(tmp) / "site"
        with zipfile.ZipFile(src_zip) as zf:
            zf.extractall(site)
        env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}",
                   VLLM_CACHE_ROOT=str(Path(tmp) / "vllm-cache"))
        env.pop("VLLM_BUILD_TREE", None)
        if "VLLM_PRISTINE_TREE" not in env and gitrepo.is_repo(tree):
            # tests/mla compares flags off with upstream, found through the git
            # history of vllm.__file__'s tree: the pruned copy here has none.
            pristine, tar = Path(tmp) / "pristine", Path(tmp) / "pristine.tar"
            gitrepo.git(tree, "archive", "-o", str(tar), gitrepo.root_commit(tree), "vllm")
            with tarfile.open(tar) as archive:
                archive.extractall(pristine, filter="data")
            env["VLLM_PRISTINE_TREE"] = str(pristine)
        python = str((venv / "bin" / "python").absolute())  # run from tmp too
        # A root that does not import fails here, not as a module-level skip.
        print(f"checking: importing the {len(roots)} roots from {src_zip.name}", flush=True)
        code = f"import importlib\nfor name in {roots!r}:\n    importlib.import_module(name)\n"
        if subprocess.run([python, "-c", code], cwd=tmp, env=env).returncode:
            print("error: a root does not import from the pruned tree", file=sys.stderr)
            return 1
        cmd = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TESTS]
        print(f"checking: {' '.join(cmd[2:])} with only {src_zip.name} as vLLM", flush=True)
        return subprocess.run(cmd, cwd=REPO, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=REPO / "build" / "vllm")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--cache", type=Path, default=None,
                        help="wheel download cache (default ~/.cache/vllm-aiter-series/gpu-wheels)")
    parser.add_argument("--compression", choices=("lzma", "deflate"), default="lzma",
                        help="the wheels' member compression (deflate: as PyPI serves them)")
    parser.add_argument("--no-wheels", action="store_true", help="only the vLLM sources")
    parser.add_argument("--python-version", default="3.12",
                        help="the device's CPython (another one simulates the device here)")
    parser.add_argument("--check", action="store_true",
                        help="then import the roots and run TESTS against the pruned tree (CPU tier)")
    args = parser.parse_args()
    try:
        tree = args.tree.resolve()
        if module_file(tree, "vllm") is None:
            raise SeriesError(f"{tree} holds no vllm package: run `make apply` first")
        test_files = sorted(p for t in TESTS for p in (REPO / t).rglob("*.py"))
        roots = sorted(set(ROOTS) | set(RUNTIME_ROOTS) | set(test_imports(tree, test_files)))
        modules = module_closure(tree, roots)
        out = args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        ensure_ignored(out)
        src_zip = out / "vllm-src.zip"
        count = write_source_zip(tree, modules, src_zip)
        manifest = {
            "tree": str(tree),
            "tree_commit": gitrepo.head(tree) if gitrepo.is_repo(tree) else None,
            "python_version": args.python_version,
            "compression": args.compression,
            "roots": roots,
            "modules": sorted(modules),
            "wheels": [],
        }
        wheel_dir = out / "whl"
        if wheel_dir.exists():
            shutil.rmtree(wheel_dir)
        if not args.no_wheels:
            requirements = pinned(WHEELS, venv_versions(args.venv))
            cache = ((args.cache or sdist.cache_dir() / "gpu-wheels")
                     / f"cp{args.python_version.replace('.', '')}")
            wheel_dir.mkdir()
            wheels = download(requirements, cache, args.python_version)
            for req, wheel in zip(requirements, wheels, strict=True):
                if args.compression == "deflate":
                    shutil.copyfile(wheel, wheel_dir / wheel.name)
                else:  # recompressing takes a minute: keep each result next to the download
                    packed = cache / "lzma" / wheel.name
                    if not packed.exists() or packed.stat().st_mtime < wheel.stat().st_mtime:
                        recompress(wheel, packed.with_suffix(".tmp"), zipfile.ZIP_LZMA)
                        packed.with_suffix(".tmp").replace(packed)
                    shutil.copyfile(packed, wheel_dir / wheel.name)
                manifest["wheels"].append({
                    "requirement": req, "file": wheel.name, "pypi_sha256": sdist.sha256_of(wheel),
                    "pypi_bytes": wheel.stat().st_size,
                    "bytes": (wheel_dir / wheel.name).stat().st_size,
                })
        (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        # What the GPU verbs carry: not MANIFEST.json, nor .gpu_payload/triton/
        # (make gpu-triton-payload's parts travel in commands of their own).
        carried = [src_zip, *sorted(wheel_dir.glob("*.whl"))]
        payload = sum(p.stat().st_size for p in carried)
        total = payload + travelling_bytes()
        mib = 1 << 20
        shown = out.relative_to(REPO) if out.is_relative_to(REPO) else out
        print(f"{shown}: {count} vLLM modules ({src_zip.stat().st_size / mib:.1f} MiB zipped), "
              f"{len(manifest['wheels'])} wheels, {payload / mib:.1f} MiB in all; "
              f"with the working tree {total / mib:.1f} of the device's {CARRY_LIMIT_MIB} MiB "
              f"(carry {shown}/vllm-src.zip and {shown}/whl)")
        if total > CARRY_LIMIT_MIB * mib:
            raise SeriesError(f"payload + working tree is {total / mib:.1f} MiB, over the "
                              f"device's {CARRY_LIMIT_MIB} MiB")
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        return check(src_zip, args.venv, roots, tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
