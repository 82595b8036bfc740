"""python3 scripts/e2e.py RECIPE... --model MODEL [options] [-- VLLM ARGS]

Each recipe (throughput, mixed, serve, gsm8k, or all) runs with the upstream, then
the patched install, and writes <out>/<date>-<device>-<commit>-<recipe>.json.  A
preflight first checks every install (ROCm torch, AITER, vLLM, lm_eval for gsm8k,
--tp GPUs).  Exit status: 0 all measured and every gate passed, 1 a run or a gate
failed, 2 the preflight or the arguments failed (nothing ran).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from . import recipes
from .recipes import Install

ROOT = Path(__file__).resolve().parents[2]
INSTALL_ENV = {"upstream": "E2E_UPSTREAM", "patched": "E2E_PATCHED"}
PROBE_TIMEOUT_S = 180
# Run by each install's Python with TP and NEED_LM_EVAL as arguments; never imports vLLM.
PROBE = r'''
import json, sys
from importlib.util import find_spec
tp, need_lm_eval = int(sys.argv[1]), sys.argv[2] == "1"
info, problems = {}, []
try:
    import torch
    info.update(torch=torch.__version__, hip=torch.version.hip, gpus=torch.cuda.device_count())
    if not torch.version.hip:
        problems.append(f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)")
    elif info["gpus"] < tp:
        problems.append(f"sees {info['gpus']} GPU(s), the run needs {tp} (HIP_VISIBLE_DEVICES?)")
    else:
        info["device"] = torch.cuda.get_device_name(0)
except BaseException as exc:
    problems.append(f"torch does not import ({type(exc).__name__}: {exc}): a ROCm torch is needed")
try:
    import aiter
    info["aiter"] = getattr(aiter, "__version__", None) or "unknown"
except BaseException as exc:
    problems.append(f"import aiter failed ({type(exc).__name__}: {exc})")
if find_spec("vllm") is None:
    problems.append("vllm is not installed in this Python")
if need_lm_eval and find_spec("lm_eval") is None:
    problems.append("lm_eval is not installed (pip install 'lm_eval[api]' in that install)")
print("E2E-PROBE " + json.dumps({**info, "problems": problems}))
'''


class UsageError(Exception):
    pass


def _lengths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        a, sep, b = item.partition("/")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise argparse.ArgumentTypeError(f"lengths are INPUT/OUTPUT pairs, got {item!r}")
        pairs.append((int(a), int(b)))
    return pairs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipes", nargs="+", choices=(*recipes.RECIPES, "all"), metavar="RECIPE")
    p.add_argument("--model", required=True, help="HF model id or local path")
    p.add_argument("--upstream", help="command running the upstream install's Python, e.g. "
                                      "/opt/up/bin/python or 'docker exec up python3' "
                                      "(default $E2E_UPSTREAM)")
    p.add_argument("--patched", help="the same for the patched install ($E2E_PATCHED)")
    p.add_argument("--only", choices=tuple(INSTALL_ENV), help="run this install only")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set (and record) for every run; VLLM_ROCM_USE_AITER=1 unless set")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e",
                   help="results folder (default benchmarks/results/e2e)")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "e2e",
                   help="tool outputs and logs (default build/e2e)")
    p.add_argument("--timeout-s", type=float, default=None, help="limit per command")
    p.add_argument("--lengths", type=_lengths, default=[(2048, 16), (8192, 16), (32768, 64)],
                   help="throughput: INPUT/OUTPUT pairs (default 2048/16,8192/16,32768/64)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="throughput: default about 1M prompt tokens per case, at least 32")
    p.add_argument("--concurrency", type=_ints, default=[4, 8, 16, 32, 64, 128],
                   help="serve: max concurrencies (default 4,8,16,32,64,128)")
    p.add_argument("--limit", type=int, default=None, help="gsm8k: first N questions (smoke)")
    p.add_argument("--gate-sigmas", type=float, default=3.0,
                   help="gsm8k gate: patched >= upstream - N combined stderr (default 3)")
    return p


def installs_from(args, environ=os.environ) -> list[Install]:
    installs = []
    for name in [args.only] if args.only else list(INSTALL_ENV):
        command = getattr(args, name) or environ.get(INSTALL_ENV[name])
        if not command:
            raise UsageError(f"no {name} install: pass --{name} 'PYTHON' (a path, or a command "
                             f"such as 'docker exec CONTAINER python3') or set "
                             f"{INSTALL_ENV[name]}; --only runs one side")
        try:
            installs.append(Install(name, tuple(shlex.split(command))))
        except ValueError as exc:
            raise UsageError(f"{name}: cannot split {command!r}: {exc}") from exc
    return installs


def run_env(pairs: list[str], environ=os.environ) -> dict:
    env = {"VLLM_ROCM_USE_AITER": "1", **environ}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"--env expects NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def probe(install: Install, env: dict, tp: int, need_lm_eval: bool) -> dict:
    """What the install's Python has, and its ``problems``."""
    who = shlex.join(install.argv)
    try:
        proc = subprocess.run(install.command(["-c", PROBE, tp, int(need_lm_eval)], env),
                              capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S)
    except OSError as exc:
        return {"problems": [f"cannot run `{who}`: {exc.strerror or exc}"]}
    except subprocess.TimeoutExpired:
        return {"problems": [f"`{who}` did not answer the probe in {PROBE_TIMEOUT_S} s"]}
    for line in proc.stdout.splitlines():
        if line.startswith("E2E-PROBE "):
            return json.loads(line.removeprefix("E2E-PROBE "))
    return {"problems": [f"`{who}` is not a working Python (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-300:]}"]}


def preflight(installs: list[Install], env: dict, tp: int, need_lm_eval: bool) -> dict:
    """The probe of every install; UsageError listing every problem of all of them."""
    probes = {i.name: probe(i, env, tp, need_lm_eval) for i in installs}
    found = [f"  - {i.name} (`{shlex.join(i.argv)}`): {problem}"
             for i in installs for problem in probes[i.name]["problems"]]
    if found:
        raise UsageError("e2e preflight failed: these recipes need a ROCm machine (MI300X/MI355X "
                         "class) with AITER and the vLLM installs to compare; nothing was run.\n"
                         + "\n".join(found) + "\nSee docs/sweeps-and-e2e.md.")
    return probes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args = []
    if "--" in argv:
        argv, engine_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser().parse_args(argv)
    args.engine_args = engine_args
    names = list(recipes.RECIPES) if "all" in args.recipes else list(dict.fromkeys(args.recipes))
    try:
        installs = installs_from(args)
        env = run_env(args.env)
        probes = preflight(installs, env, args.tp, "gsm8k" in names)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = False
    for name in names:
        doc = recipes.run_recipe(name, installs, args, env, probes)
        print(f"[e2e] {name}: {doc['path']}")
        for row in doc["comparison"]:
            print(f"  {row['case']} {row['metric']}: upstream {row['upstream']:.4g}, patched "
                  f"{row['patched']:.4g}, ratio {row['ratio'] or 0:.3f}")
        if doc["gate"]:
            print(f"  gate passed: {doc['gate']['passed']} ({doc['gate']['rule']})")
        for line in doc["failed"] or []:
            print(f"  FAILED {line}", file=sys.stderr)
        failed = failed or bool(doc["failed"])
    return 1 if failed else 0
