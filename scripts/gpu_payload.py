#!/usr/bin/env python3
"""make gpu-payload: what the GPU machine (python3 3.12 with torch, triton, numpy and pytest;
no vLLM, no package index, at most 64 MiB of working tree) needs to import the patched vLLM,
in ``.gpu_payload/``: ``vllm-src.zip``, the build tree's ``vllm/*.py`` files that importing
ROOTS, RUNTIME_ROOTS and what TESTS import executes (module-level imports only); ``whl/``,
cp312 wheels of WHEELS at .venv's versions, recompressed with LZMA (52 MiB become 43); and
``MANIFEST.json`` (the tree's commit, the modules, each wheel with PyPI's sha256)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from seriestool import SeriesError, gitrepo, sdist

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".gpu_payload"
# What the GPU verbs run (tests/aiter_fa whole, tests/mla's `gpu` tests).
TESTS = ("tests/aiter_fa", "tests/mla")
ROOTS = (
    "vllm.v1.attention.backends.rocm_aiter_fa",  # the backend under test (0200 + 0250)
    "vllm.config",
    # The GPU tier's merge (the test compiles it with the real Triton).
    "vllm.v1.attention.ops.triton_merge_attn_states",
    # The MLA RoPE + KV-cache fusion (overlay + 0301-0304): its layer glue, decision, Triton
    # kernel, AITER cos/sin cache and the workspace manager holding its q_out buffer.
    "vllm._aiter_ops",
    "vllm.model_executor.layers.attention.mla_rope_fusion",
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    "vllm.v1.attention.ops.triton_mla_rope_cache",
    "vllm.v1.worker.workspace",
    # ModelConfig inspects the architecture in a subprocess that imports it.
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.registry",
)
# Imported inside functions on the tests' path (found by a traced CPU-tier run of TESTS):
# VllmConfig's post-init and the model registry subprocess.
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
# Distributions, each a hard import of the modules above or a requirement transformers checks
# by metadata.  The device has torch's requirements; typing-extensions, filelock and fsspec
# travel anyway, since pydantic and huggingface-hub need recent ones.
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
# The device: CPython 3.12, x86-64, glibc >= 2.31 (pip matches each listed tag exactly).
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
CARRY_LIMIT_MIB = 64  # the device tool's working tree, carried paths included
MIB = 1 << 20


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def module_file(pkg_root: Path, module: str) -> Path | None:
    """The .py file of a dotted module under pkg_root (the folder holding vllm/), or None."""
    base = pkg_root.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Dotted names a module imports when it runs (not in function bodies or
    ``if TYPE_CHECKING:`` blocks); ``from X import Y`` yields X and X.Y (Y may be a module)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                name = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(source).body)
    return found


def module_closure(pkg_root: Path, roots: list[str]) -> set[str]:
    """Every vllm module importing ``roots`` executes (and their parent packages); a root
    the tree lacks is an error (not the patched tree)."""
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
    """The vllm modules the test files import anywhere in them (``from vllm.x import y``:
    vllm.x, and vllm.x.y where the tree has that module)."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("vllm."))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names
                             if module_file(pkg_root, f"{node.module}.{a.name}"))
    return sorted(names)


def write_source_zip(pkg_root: Path, modules: set[str], dest: Path) -> int:
    """Zip the modules' files (sorted, fixed dates: the same tree gives the same bytes)."""
    files = sorted(str(module_file(pkg_root, m).relative_to(pkg_root)) for m in modules)
    with zipfile.ZipFile(dest, "w") as zf:
        for rel in files:
            info = zipfile.ZipInfo(rel, date_time=(2026, 11, 2, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, (pkg_root / rel).read_bytes(), zipfile.ZIP_DEFLATED)
    return len(files)


def recompress(src: Path, dest: Path) -> None:
    """The same wheel, every member recompressed with LZMA (names, order, dates kept)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_LZMA if data else zipfile.ZIP_STORED
            zout.writestr(out, data)


def venv_requirements(venv: Path) -> list[str]:
    """``name==version`` of WHEELS as .venv has them."""
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--all"],
                            capture_output=True, text=True)
    if freeze.returncode:
        raise SeriesError(f"pip freeze failed in {venv} (make venv first?): {freeze.stderr.strip()}")
    versions = {canonical(n): v for n, _, v in (ln.partition("==") for ln in freeze.stdout.split())}
    missing = [n for n in WHEELS if not versions.get(canonical(n))]
    if missing:
        raise SeriesError(f".venv has no {', '.join(missing)}: run `make venv`")
    return [f"{n}=={versions[canonical(n)]}" for n in WHEELS]


def cp312_wheels(requirements: list[str], cache: Path) -> list[Path]:
    """The cp312 manylinux wheel of each ``name==version`` in ``cache``, downloading what is
    missing (also gpu_triton_payload's)."""
    def cached(requirement: str) -> Path | None:
        name, _, version = requirement.partition("==")
        return next((p for p in cache.glob("*.whl") if p.name.split("-")[1] == version
                     and canonical(p.name.split("-")[0]) == canonical(name)), None)

    todo = [r for r in requirements if cached(r) is None]
    if todo:
        print(f"downloading {len(todo)} wheels into {cache} ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "-d", str(cache)]
        cmd += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        proc = subprocess.run(cmd + todo, capture_output=True, text=True)
        if proc.returncode:
            raise SeriesError("pip download failed:\n" + (proc.stderr or proc.stdout).strip())
    found = [cached(r) for r in requirements]
    lost = [r for r, wheel in zip(requirements, found) if wheel is None]
    if lost:
        raise SeriesError(f"no cp312 manylinux wheel for {', '.join(lost)} in {cache}")
    return found


def build(tree: Path, venv: Path, out: Path) -> None:
    """Write out/vllm-src.zip, out/whl/ and out/MANIFEST.json."""
    if module_file(tree, "vllm") is None:
        raise SeriesError(f"{tree} holds no vllm package: run `make apply` first")
    test_files = sorted(p for t in TESTS for p in (REPO / t).rglob("*.py"))
    roots = sorted(set(ROOTS) | set(RUNTIME_ROOTS) | set(test_imports(tree, test_files)))
    modules = module_closure(tree, roots)
    out.mkdir(parents=True, exist_ok=True)
    count = write_source_zip(tree, modules, out / "vllm-src.zip")
    shutil.rmtree(out / "whl", ignore_errors=True)
    (out / "whl").mkdir()
    cache = sdist.cache_dir() / "gpu-wheels" / "cp312"
    cache.mkdir(parents=True, exist_ok=True)
    listed = []
    requirements = venv_requirements(venv)
    print(f"packing {len(requirements)} wheels with LZMA (a minute) ...", flush=True)
    for requirement, wheel in zip(requirements, cp312_wheels(requirements, cache)):
        recompress(wheel, out / "whl" / wheel.name)
        listed.append({"requirement": requirement, "file": wheel.name,
                       "pypi_sha256": sdist.sha256_of(wheel)})
    manifest = {"tree_commit": gitrepo.head(tree), "roots": roots, "modules": sorted(modules),
                "wheels": listed}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    # What the GPU verbs carry, beside the working tree (tracked + untracked, not ignored).
    payload = sum(p.stat().st_size for p in [out / "vllm-src.zip", *(out / "whl").glob("*.whl")])
    names = gitrepo.out(REPO, "ls-files", "-z", "-c", "-o", "--exclude-standard").split("\0")
    total = payload + sum((REPO / n).stat().st_size for n in names if (REPO / n).is_file())
    print(f"{out}: {count} vLLM modules, {len(listed)} wheels, {payload / MIB:.1f} MiB; with the "
          f"working tree {total / MIB:.1f} of the device's {CARRY_LIMIT_MIB} MiB")
    if total > CARRY_LIMIT_MIB * MIB:
        raise SeriesError(f"payload + working tree is {total / MIB:.1f} MiB, over the "
                          f"device's {CARRY_LIMIT_MIB} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=REPO / "build" / "vllm")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv")
    args = parser.parse_args()
    try:
        build(args.tree.resolve(), args.venv, OUT)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
