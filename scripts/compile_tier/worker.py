"""One compile worker: ``python -m compile_tier.worker TARGET CACHE OUT``.

One target per process: Triton 3.6 compiling gfx942 and then gfx950 in one
process breaks e4m3fnuz conversions on gfx950.  Each spec is specialised as
Triton's JIT specialises a launch, keyed (kernel source hash, target,
specialisation, options, Triton version, ``FACTS_VERSION``) and its facts read
from the cache or compiled and parsed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import time
from pathlib import Path

from .cases import OPS, build_specs
from .facts import FACTS_VERSION, amd_facts
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


def compile_kernel(fn, target, signature, constexprs, attrs, options) -> dict:
    """The facts of one compile (and its time)."""
    import triton
    from triton.compiler import ASTSource

    src = ASTSource(fn, signature, constexprs, attrs)
    start = time.perf_counter()
    kernel = triton.compile(src, target=target.gpu_target(), options=options)
    seconds = time.perf_counter() - start
    facts = amd_facts(target, kernel.asm["amdgcn"], kernel.metadata.shared, options["num_warps"])
    facts["compile_s"] = round(seconds, 2)
    return facts


def run_target(target_name: str, cache: Path) -> list[dict]:
    """One record (kernel, case, config, options, expect, key, cached, facts) per spec."""
    from triton.compiler import make_backend

    target = TARGETS[target_name]
    backend = type(make_backend(target.gpu_target()))
    records = []
    for spec in build_specs(target):
        module, name = spec.fn_name.split(":")
        fn = getattr(importlib.import_module(f"{OPS}.{module}"), name)
        signature, constexprs, attrs = specialize(fn, spec, backend)
        key = compile_key(fn, target, signature, constexprs, attrs, spec.options)
        path = cache / key[:2] / f"{key}.json"
        cached = path.is_file()
        if cached:
            facts = json.loads(path.read_text())
        else:
            try:
                facts = compile_kernel(fn, target, signature, constexprs, attrs, spec.options)
            except Exception as exc:  # noqa: BLE001 - a failed compile is a result
                facts = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".tmp").write_text(json.dumps(facts, sort_keys=True))
                path.with_suffix(".tmp").replace(path)  # a killed worker leaves no half file
            print(f"{target_name}: compiled {spec.kernel} {spec.case}", file=sys.stderr, flush=True)
        records.append(dict(
            target=target.name, kernel=spec.kernel, fn=spec.fn_name, case=spec.case,
            config=spec.config, options=spec.options, expect=spec.expect, key=key,
            cached=cached, facts=facts,
        ))
    return records


if __name__ == "__main__":
    target_name, cache, out = sys.argv[1:4]
    records = run_target(target_name, Path(cache))
    Path(out).write_text(json.dumps(records))
