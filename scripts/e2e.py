#!/usr/bin/env python3
"""python3 scripts/e2e.py RECIPE... --model MODEL --upstream PY --patched PY [-- VLLM ARGS]

Each recipe (throughput, mixed, serve, gsm8k, or all) runs vLLM's own tools with the upstream,
then the patched install, after a preflight of both, and writes one JSON (docs/sweeps-and-e2e.md).
Exit status: 0 all measured and gates passed, 1 a run or gate failed, 2 nothing ran (preflight).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mixed_batch import parse_engine_args

ROOT = Path(__file__).resolve().parents[1]
# What a Python has, as one JSON line; run by each install's (and validate_rocm.py's) Python.
PROBE = r'''
import importlib, json
from importlib.util import find_spec
facts = {"found": [m for m in ("vllm", "lm_eval", "pytest") if find_spec(m)], "hip": None,
         "gpus": 0, "device": None}
for name in ("torch", "aiter"):
    try:
        facts[name] = str(getattr(importlib.import_module(name), "__version__", "unknown"))
    except BaseException as exc:
        facts[name] = None
        facts[name + "_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
if facts["torch"]:
    import torch
    facts.update(hip=torch.version.hip, gpus=torch.cuda.device_count())
    if facts["gpus"]:
        facts["device"] = torch.cuda.get_device_name(0)
print("PROBE " + json.dumps(facts))
'''
VLLM = ("-m", "vllm.entrypoints.cli.main")
MODEL_LEN_MARGIN = 64
SERVE_LEN = 1024          # serve: random input and output length
SERVER_START_S = 1800     # serve: bench serve waits this long for the server to answer
GSM8K = "exact_match,strict-match"
GSM8K_STDERR = "exact_match_stderr,strict-match"
GATE_SIGMAS = 3  # gsm8k: patched >= upstream - 3 combined standard errors
RECORDED = re.compile(r"VLLM_|AITER_|(HIP|CUDA|ROCR)_VISIBLE_DEVICES$|HSA_OVERRIDE_GFX_VERSION$"
                      r"|(HF_HUB|TRANSFORMERS)_OFFLINE$")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


def commit() -> str:
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    return git.stdout.strip() or os.environ.get("SERIES_COMMIT", "unknown")


def probe(cmd: list[str], env: dict) -> dict:
    """PROBE's facts from ``cmd`` (a Python running ``-c PROBE``), or {"error": why none}."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:  # no such program, or no answer
        return {"error": f"cannot run it: {exc}"}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line.removeprefix("PROBE "))
    return {"error": f"not a working Python (exit {proc.returncode}): "
                     f"{(proc.stderr or proc.stdout).strip()[-300:]}"}


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (vLLM's engine processes too), SIGKILL a minute later."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_logged(cmd: list, env: dict, log: Path, timeout_s: float | None = None) -> int:
    """Run ``cmd`` in a process group of its own, output appended to ``log``; the group is
    stopped on return (subprocess.TimeoutExpired after ``timeout_s``)."""
    with open(log, "a") as fh:
        print(f"$ {shlex.join(map(str, cmd))}", file=fh, flush=True)
        proc = subprocess.Popen(list(map(str, cmd)), stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        finally:
            stop(proc)


def command(install: list[str], args: list, env: dict) -> list[str]:
    """``args`` run by an install: a Python, or a prefix ending in one (`docker exec C python3`
    passes no environment), with the VLLM_*, AITER_*, device visibility and Hugging Face offline
    variables of ``env`` but no secret set by `env`; so each result's command records them."""
    recorded = [f"{k}={env[k]}" for k in sorted(env) if RECORDED.match(k) and not SECRET.search(k)]
    return [*install[:-1], "env", *recorded, install[-1], *map(str, args)]


@dataclass
class Run:
    """One recipe over both installs: its options, environment, folder and results so far."""
    recipe: str
    args: argparse.Namespace
    env: dict
    work: Path
    benchmarks: list = field(default_factory=list)
    failed: list = field(default_factory=list)

    def measure(self, install: str, case: str, params: dict, cmd: list, log: Path, parse):
        """Run ``cmd`` (it must exit 0), then record ``parse()`` or the failure."""
        info = {"recipe": self.recipe, "case": case, "install": install,
                "model": self.args.model, "params": params, "command": shlex.join(cmd),
                "log": str(log), "results": {}}
        print(f"[e2e] {self.recipe} {case} {install}: {info['command']}", flush=True)
        try:
            if rc := run_logged(cmd, self.env, log, self.args.timeout_s):
                last = log.read_text(errors="replace").strip().splitlines()[-1]
                raise RuntimeError(f"exit {rc}: {last[:300]}")
            info["results"] = parse()
        except (subprocess.TimeoutExpired, RuntimeError, OSError, ValueError, KeyError) as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"  # a failed run, or no results
        if "error" in info:
            self.failed.append(f"{self.recipe} {case} {install}: {info['error']}")
        self.benchmarks.append({"name": f"{self.recipe}[{case}-{install}]",
                                "group": self.recipe, "extra_info": info})


def _numbers(path: Path) -> dict:
    """The finite numbers of the JSON file a tool wrote (not its lists, strings, infinities)."""
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if type(v) in (int, float) and math.isfinite(v)}


def throughput(run: Run, name: str, install: list[str]) -> None:
    a = run.args
    for input_len, output_len in a.lengths:
        prompts = a.num_prompts or max(32, (1 << 20) // input_len)  # ~1M prompt tokens
        out = run.work / f"throughput-{name}-{input_len}x{output_len}.json"
        cmd = command(install, [
            *VLLM, "bench", "throughput", "--model", a.model, "--dataset-name", "random",
            "--random-input-len", input_len, "--random-output-len", output_len,
            "--random-range-ratio", "0", "--num-prompts", prompts,
            "--max-model-len", input_len + output_len + MODEL_LEN_MARGIN,
            "--tensor-parallel-size", a.tp, "--seed", "0", "--output-json", out,
            *a.engine_args], run.env)
        run.measure(name, f"{input_len}/{output_len}",
                    {"input_len": input_len, "output_len": output_len, "num_prompts": prompts},
                    cmd, out.with_suffix(".log"), lambda out=out: _numbers(out))


def mixed(run: Run, name: str, install: list[str]) -> None:
    out = run.work / f"mixed-{name}.json"
    cmd = command(install, [ROOT / "scripts" / "mixed_batch.py", "--model", run.args.model,
                            "--out", out, "--tensor-parallel-size", run.args.tp,
                            *run.args.engine_args], run.env)
    run.measure(name, "order-contract", {}, cmd, out.with_suffix(".log"),
                lambda: json.loads(out.read_text()))  # the verdict, its steps and answers


def serve(run: Run, name: str, install: list[str]) -> None:
    a = run.args
    with socket.socket() as sock:  # a free port: sweep cells may share a node
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = run.work / f"serve-{name}-server.log"
    cmd = command(install, [*VLLM, "serve", a.model, "--port", port, "--tensor-parallel-size",
                            a.tp, "--max-model-len", 2 * SERVE_LEN + MODEL_LEN_MARGIN,
                            "--seed", "0", *a.engine_args], run.env)
    with open(log, "w") as fh:
        server = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=run.env,
                                  start_new_session=True)
    try:
        for conc in a.concurrency:
            if server.poll() is not None:
                run.failed.append(f"serve {name}: the server exited ({log})")
                return
            out = run.work / f"serve-{name}-c{conc}.json"
            prompts = max(32, 5 * conc)
            bench = command(install, [
                *VLLM, "bench", "serve", "--backend", "vllm", "--model", a.model, "--port", port,
                "--dataset-name", "random", "--random-input-len", SERVE_LEN,
                "--random-output-len", SERVE_LEN, "--random-range-ratio", "0", "--ignore-eos",
                "--max-concurrency", conc, "--num-prompts", prompts,
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--seed", "0", "--save-result", "--result-dir", run.work,
                "--result-filename", out.name, "--ready-check-timeout-sec", SERVER_START_S],
                run.env)
            run.measure(name, f"c{conc}", {"concurrency": conc, "num_prompts": prompts},
                        bench, out.with_suffix(".log"), lambda out=out: _numbers(out))
    finally:
        stop(server)


def parse_lm_eval(out_dir: Path) -> dict:
    files = sorted(out_dir.rglob("results_*.json"), key=os.path.getmtime)
    if not files:
        raise ValueError(f"lm_eval wrote no results_*.json under {out_dir}")
    data = json.loads(files[-1].read_text())
    return {k: v for k, v in data["results"]["gsm8k"].items() if k.startswith("exact_match")}


def gsm8k(run: Run, name: str, install: list[str]) -> None:
    a = run.args
    out = run.work / f"gsm8k-{name}"
    model_args = {"pretrained": a.model, "tensor_parallel_size": a.tp, "max_model_len": 4096,
                  "gpu_memory_utilization": 0.8, "seed": 0, **parse_engine_args(a.engine_args)}
    cmd = command(install, ["-m", "lm_eval", "--model", "vllm", "--model_args",
                            ",".join(f"{k}={v}" for k, v in model_args.items()),
                            "--tasks", "gsm8k", "--num_fewshot", "5", "--batch_size", "auto",
                            "--seed", "0", "--output_path", out], run.env)
    run.measure(name, "gsm8k-5shot", {}, cmd, out.with_suffix(".log"),
                lambda: parse_lm_eval(out))


RECIPES = {"throughput": throughput, "mixed": mixed, "serve": serve, "gsm8k": gsm8k}


def comparison(benchmarks: list[dict]) -> list[dict]:
    """patched / upstream for every number both installs measured in the same case."""
    results = {(b["extra_info"]["case"], b["extra_info"]["install"]): b["extra_info"]["results"]
               for b in benchmarks}
    rows = []
    for (case, install), patched in results.items():
        upstream = results.get((case, "upstream"), {}) if install == "patched" else {}
        for metric, value in patched.items():
            base = upstream.get(metric)
            if type(value) in (int, float) and type(base) in (int, float):
                rows.append({"case": case, "metric": metric, "upstream": base, "patched": value,
                             "ratio": value / base if base else None})
    return rows


def gate(recipe: str, benchmarks: list[dict]) -> dict | None:
    """mixed: the patched verdict is ``pass`` (upstream's is recorded, not gated); gsm8k:
    patched >= upstream - 3 combined standard errors (lm_eval's own); the others: none."""
    sides = {b["extra_info"]["install"]: b["extra_info"]["results"] for b in benchmarks}
    if recipe == "mixed":
        verdicts = {install: results.get("verdict") for install, results in sides.items()}
        return {**verdicts, "passed": verdicts["patched"] == "pass",
                "rule": "patched: the answer holds the needle after mixed steps"}
    if recipe != "gsm8k":
        return None
    up = sides["upstream"]
    pa = sides["patched"]
    if GSM8K not in up or GSM8K not in pa:
        return {"metric": GSM8K, "passed": False, "rule": "both accuracies are needed"}
    tolerance = GATE_SIGMAS * math.hypot(up.get(GSM8K_STDERR, 0), pa.get(GSM8K_STDERR, 0))
    return {"metric": GSM8K, "upstream": up[GSM8K], "patched": pa[GSM8K], "tolerance": tolerance,
            "passed": pa[GSM8K] >= up[GSM8K] - tolerance,
            "rule": f"patched >= upstream - {GATE_SIGMAS} x combined stderr ({tolerance:.4f})"}


def run_recipe(recipe: str, installs: dict, args, env: dict, probes: dict) -> dict:
    """Run ``recipe`` for both installs; write and return its results document."""
    stamp = datetime.datetime.now(datetime.UTC)
    series = {"commit": commit(), "device": probes["upstream"].get("device", "unknown")}
    tag = (f"{stamp:%Y%m%d-%H%M%S}-{re.sub(r'[^A-Za-z0-9.]+', '-', series['device']).lower()}-"
           f"{series['commit'][:10]}-{recipe}")
    run = Run(recipe, args, env, args.work / tag)
    run.work.mkdir(parents=True, exist_ok=True)
    for name, install in installs.items():
        RECIPES[recipe](run, name, install)
    result = gate(recipe, run.benchmarks)
    if result and result["passed"] is False:
        run.failed.append(f"gate failed: {result['rule']}")
    doc = {"recipe": recipe, "datetime": stamp.isoformat(timespec="seconds"),
           "machine_info": {"node": socket.gethostname(), "series": series}, "probes": probes,
           "benchmarks": run.benchmarks, "comparison": comparison(run.benchmarks),
           "gate": result, "failed": run.failed or None}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{tag}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    doc["path"] = str(path)
    return doc


def problems(facts: dict, tp: int, modules: tuple[str, ...]) -> list[str]:
    """What a Python's probe lacks: a ROCm torch that sees ``tp`` GPUs, AITER, ``modules``."""
    if "error" in facts:
        return [facts["error"]]
    found = []
    if not facts["torch"]:
        found.append(f"torch does not import ({facts['torch_error']}): a ROCm torch is needed")
    elif not facts["hip"]:
        found.append(f"torch {facts['torch']} is not a ROCm build (no torch.version.hip)")
    elif facts["gpus"] < tp:
        found.append(f"sees {facts['gpus']} GPU(s), needs {tp} (HIP_VISIBLE_DEVICES? "
                     "--device /dev/kfd --device /dev/dri in a container?)")
    if not facts["aiter"]:
        found.append(f"import aiter failed ({facts['aiter_error']})")
    return found + [f"{m} is not installed in this Python" for m in modules
                    if m not in facts["found"]]


def _lengths(text: str) -> list[tuple[int, int]]:
    """'2048/16,8192/16' -> [(2048, 16), (8192, 16)]; argparse reports a ValueError."""
    return [(int(i), int(o)) for i, o in (item.split("/") for item in text.split(","))]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args = []
    if "--" in argv:
        engine_args = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(prog="e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipes", nargs="+", choices=(*RECIPES, "all"), metavar="RECIPE")
    p.add_argument("--model", required=True, help="HF model id or local path")
    p.add_argument("--upstream", type=shlex.split, required=True,
                   help="the upstream install's Python: /up/bin/python, 'docker exec C python3'")
    p.add_argument("--patched", type=shlex.split, required=True, help="the same, patched")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set (and record) for every run; VLLM_ROCM_USE_AITER=1 unless set")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "e2e", help="tool outputs, logs")
    p.add_argument("--timeout-s", type=float, help="limit per command")
    p.add_argument("--lengths", type=_lengths, default=[(2048, 16), (8192, 16), (32768, 64)],
                   help="throughput: INPUT/OUTPUT pairs, comma-separated")
    p.add_argument("--num-prompts", type=int, help="throughput: default ~1M prompt tokens per case")
    p.add_argument("--concurrency", type=_ints, default=[4, 8, 16, 32, 64, 128],
                   help="serve: max concurrencies, comma-separated")
    args = p.parse_args(argv)
    if engine_args and not engine_args[0].startswith("--"):
        p.error(f"the arguments after -- are vLLM flags, not {engine_args[0]!r}")
    if not (args.upstream and args.patched):
        p.error("--upstream and --patched name a Python each")
    args.engine_args = engine_args
    recipes = list(RECIPES) if "all" in args.recipes else list(dict.fromkeys(args.recipes))
    env = {"VLLM_ROCM_USE_AITER": "1", **os.environ}
    for pair in args.env:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            p.error(f"--env expects NAME=VALUE, got {pair!r}")
        env[name] = value
    installs = {"upstream": args.upstream, "patched": args.patched}
    probes = {}
    found = []
    for name, install in installs.items():
        probes[name] = probe(command(install, ["-c", PROBE], env), env)
        modules = ("vllm", "lm_eval") if "gsm8k" in recipes else ("vllm",)
        for problem in problems(probes[name], args.tp, modules):
            found.append(f"  - {name} (`{shlex.join(install)}`): {problem}")
    if found:
        print("error: e2e preflight failed (a ROCm machine with AITER and both vLLM installs is "
              "needed); nothing was run.\n" + "\n".join(found), file=sys.stderr)
        return 2
    failed = False
    for recipe in recipes:
        doc = run_recipe(recipe, installs, args, env, probes)
        print(f"[e2e] {recipe}: {doc['path']}; gate passed: {(doc['gate'] or {}).get('passed')}")
        for line in doc["failed"] or []:
            print(f"  FAILED {line}", file=sys.stderr)
        failed = failed or bool(doc["failed"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
