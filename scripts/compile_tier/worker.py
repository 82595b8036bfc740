"""One compile worker: one target, one process.

Run by ``compile_tier.run`` as ``python -m compile_tier.worker`` with the
kernels' package (vllm_overlay) on PYTHONPATH and ``TRITON_INTERPRET`` unset.
One target per process: Triton 3.6 compiling gfx942 and then gfx950 in one
process breaks e4m3fnuz conversions on gfx950 (an assertion in
ElementwiseOpToLLVM, ``Fp8E4M3FNUZ_to_Bf16_HW``).

For each spec of the target it computes the signature, constexprs and
attributes exactly as Triton's JIT specialises a launch, keys the compile by
the kernel's source hash (``JITFunction.cache_key``, which covers the jitted
functions it calls), the target, that specialisation, the options, the Triton
version and ``FACTS_VERSION``, and reads the facts from the cache or compiles
(``triton.compile(ASTSource(...), target=...)``) and parses them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import os
import sys
import time
from pathlib import Path

from .cases import OPS, build_specs
from .facts import FACTS_VERSION, amd_facts, cuda_facts
from .targets import TARGETS


def specialize(fn, spec, backend):
    """(signature, constexprs, attrs) of one launch, as the JIT computes them."""
    from triton._C.libtriton import native_specialize_impl

    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in spec.constexprs:
            signature[name] = "constexpr"
            constexprs[name] = spec.constexprs[name]
            continue
        kp = fn.params[i]
        ty, attr = native_specialize_impl(backend, spec.args[name], kp.is_const,
                                          not kp.do_not_specialize,
                                          not kp.do_not_specialize_on_alignment)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = spec.args[name]
        elif attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return signature, constexprs, attrs


def compile_key(fn, target, signature, constexprs, attrs, options) -> str:
    import triton

    blob = json.dumps(dict(
        source=fn.cache_key, target=target.name, signature=signature,
        constexprs={k: repr(v) for k, v in constexprs.items()},
        attrs={str(k): v for k, v in attrs.items()}, options=options,
        triton=triton.__version__, facts=FACTS_VERSION,
    ), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def compile_facts(fn, target, signature, constexprs, attrs, options) -> dict:
    return compile_kernel(fn, target, signature, constexprs, attrs, options)[1]


def compile_kernel(fn, target, signature, constexprs, attrs, options):
    """(the CompiledKernel, its facts); make validate-rocm loads the kernel on
    the device to read what the driver reports beside the facts."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    src = ASTSource(fn, signature, constexprs, attrs)
    log = io.StringIO()
    start = time.perf_counter()
    if target.amd:
        kernel = triton.compile(src, target=target.gpu_target(), options=options)
    else:
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v output, printed by Triton
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=target.gpu_target(), options=options)
    seconds = time.perf_counter() - start
    warps = options["num_warps"]
    if target.amd:
        facts = amd_facts(target, kernel.asm["amdgcn"], kernel.metadata.shared, warps)
    else:
        facts = cuda_facts(target, kernel.asm["ptx"], log.getvalue(), kernel.metadata.shared,
                           warps)
    facts["compile_s"] = round(seconds, 2)
    return kernel, facts


def _cached(cache: Path, key: str) -> dict | None:
    path = cache / key[:2] / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _store(cache: Path, key: str, facts: dict) -> None:
    path = cache / key[:2] / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(facts, sort_keys=True))
    tmp.replace(path)


@contextlib.contextmanager
def compile_slot(slots: Path | None, jobs: int):
    """Hold one of ``jobs`` lock files in ``slots`` while compiling, so that
    the workers of all targets (one process each) compile at most ``jobs``
    kernels at a time between them."""
    if slots is None:
        yield
        return
    import fcntl

    while True:
        for i in range(jobs):
            f = open(slots / f"slot{i}", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        time.sleep(0.05)


def run_target(target_name: str, cache: Path, slots: Path | None = None,
               jobs: int = 1, candidates: bool = False, progress: Path | None = None) -> list[dict]:
    """Records (kernel, case, config, options, expect, key, cached, facts) of
    every spec of the target; ``progress`` gets "done total compiled" after each compile key."""
    from triton.compiler import make_backend

    target = TARGETS[target_name]
    backend = type(make_backend(target.gpu_target()))
    specs = build_specs(target, candidates)
    by_key: dict[str, list] = {}
    for spec in specs:
        module, name = spec.fn_name.split(":")
        fn = getattr(importlib.import_module(f"{OPS}.{module}"), name)
        signature, constexprs, attrs = specialize(fn, spec, backend)
        key = compile_key(fn, target, signature, constexprs, attrs, spec.options)
        by_key.setdefault(key, [fn, signature, constexprs, attrs, []])[4].append(spec)
    records = []
    done = compiled = 0
    for key in sorted(by_key):
        fn, signature, constexprs, attrs, owners = by_key[key]
        facts = _cached(cache, key)
        cached = facts is not None
        if not cached:
            try:
                with compile_slot(slots, jobs):
                    facts = compile_facts(fn, target, signature, constexprs, attrs,
                                          owners[0].options)
            except Exception as exc:  # noqa: BLE001 - a failed compile is a result
                facts = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
            else:
                _store(cache, key, facts)
            compiled += 1
        done += 1
        if progress is not None:
            progress.write_text(f"{done} {len(by_key)} {compiled}\n")
        for spec in owners:
            records.append(dict(
                target=target.name, kernel=spec.kernel, fn=spec.fn_name, case=spec.case,
                config=spec.config, options=spec.options, expect=spec.expect, key=key,
                cached=cached, facts=facts,
            ))
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True, choices=sorted(TARGETS))
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--slots", type=Path, help="directory of the compile-slot lock files")
    p.add_argument("--jobs", type=int, default=1, help="compile slots shared by all workers")
    p.add_argument("--candidates", action="store_true", help="the candidate tiles instead")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--progress", type=Path, help="file rewritten with 'done total compiled'")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("compile worker: TRITON_INTERPRET must be unset", file=sys.stderr)
        return 2
    records = run_target(args.target, args.cache, args.slots, args.jobs, args.candidates,
                         args.progress)
    args.out.write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
