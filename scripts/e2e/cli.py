"""python3 scripts/e2e.py RECIPE... --model MODEL [options] [-- VLLM ARGS]

Each recipe (throughput, mixed, serve, gsm8k, or all) runs vLLM's own tools with the upstream,
then the patched install, after a preflight of both, and writes one JSON (docs/sweeps-and-e2e.md).
Exit status: 0 all measured and every gate passed, 1 a run or a gate failed, 2 the preflight
or the arguments failed (nothing ran).
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
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .mixed_batch import parse_engine_args

ROOT = Path(__file__).resolve().parents[2]
INSTALL_ENV = {"upstream": "E2E_UPSTREAM", "patched": "E2E_PATCHED"}
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
        problems.append(f"torch {torch.__version__} is not a ROCm build (no torch.version.hip)")
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
VLLM = ("-m", "vllm.entrypoints.cli.main")
MODEL_LEN_MARGIN = 64
SERVE_LEN = 1024          # serve: random input and output length
SERVER_START_S = 1800
GSM8K = "exact_match,strict-match"
GSM8K_STDERR = "exact_match_stderr,strict-match"
GATE_SIGMAS = 3  # gsm8k: patched >= upstream - 3 combined standard errors
RECORDED = re.compile(r"VLLM_|AITER_|(HIP|CUDA|ROCR)_VISIBLE_DEVICES$|HSA_OVERRIDE_GFX_VERSION$")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


class RecipeError(Exception):
    pass


def recorded_env(env: dict) -> dict:
    """The variables a result records: VLLM_*, AITER_*, device visibility; secrets redacted."""
    return {k: "<redacted>" if SECRET.search(k) else env[k] for k in sorted(env)
            if RECORDED.match(k)}


@dataclass(frozen=True)
class Install:
    """An install is the command that runs its Python: a path, or a prefix that ends in a
    Python such as ``docker exec vllm-patched python3``."""
    name: str
    argv: tuple[str, ...]

    def command(self, args: list, env: dict) -> list[str]:
        """``argv + args``.  A prefix install gets the recorded variables of ``env`` (not the
        secrets) set inside with ``env NAME=VALUE``: ``docker exec`` does not pass them."""
        inner = []
        if len(self.argv) > 1:
            inner = [f"{k}={v}" for k, v in recorded_env(env).items() if v != "<redacted>"]
        return [*self.argv[:-1], *(["env", *inner] if inner else []), self.argv[-1],
                *map(str, args)]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (vLLM's engine processes too), SIGKILL a minute later."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_logged(cmd: list[str], env: dict, log: Path, timeout_s: float | None) -> int:
    """Run ``cmd`` in its own process group, output appended to ``log``."""
    with open(log, "a") as fh:
        print(f"$ {shlex.join(cmd)}", file=fh, flush=True)
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RecipeError(f"timed out after {timeout_s:g} s") from None
        finally:
            stop(proc)


@dataclass
class Run:
    """One recipe over the installs: its options, environment, folder and results so far."""
    recipe: str
    args: object          # the command line's namespace (model, tp, engine_args, ...)
    env: dict
    work: Path
    benchmarks: list = field(default_factory=list)
    failed: list = field(default_factory=list)

    def measure(self, install: Install, case: str, params: dict, cmds: list[list[str]],
                log: Path, parse) -> None:
        """Run ``cmds`` in order (each must exit 0), then record ``parse()`` or the failure."""
        info = {"recipe": self.recipe, "case": case, "install": install.name,
                "model": self.args.model, "params": params,
                "command": " && ".join(shlex.join(c) for c in cmds), "log": str(log),
                "results": {}}
        print(f"[e2e] {self.recipe} {case} {install.name}: {info['command']}", flush=True)
        try:
            for cmd in cmds:
                rc = run_logged(cmd, self.env, log, self.args.timeout_s)
                if rc != 0:
                    last = log.read_text(errors="replace").strip().splitlines()[-1]
                    raise RecipeError(f"exit {rc}: {last[:300]}")
            info["results"] = parse()
        except RecipeError as exc:
            info["error"] = str(exc)
        except (OSError, ValueError, KeyError) as exc:  # cannot run, or no results to read
            info["error"] = f"{type(exc).__name__}: {exc}"
        if "error" in info:
            self.failed.append(f"{self.recipe} {case} {install.name}: {info['error']}")
        self.benchmarks.append({"name": f"{self.recipe}[{case}-{install.name}]",
                                "group": self.recipe, "extra_info": info})


def _numbers(path: Path) -> dict:
    """The finite numbers of the JSON file a tool wrote (not its lists, strings, infinities)."""
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if type(v) in (int, float) and math.isfinite(v)}


def throughput(run: Run, install: Install) -> None:
    a = run.args
    for input_len, output_len in a.lengths:
        prompts = a.num_prompts or max(32, (1 << 20) // input_len)  # ~1M prompt tokens
        out = run.work / f"throughput-{install.name}-{input_len}x{output_len}.json"
        cmd = install.command([
            *VLLM, "bench", "throughput", "--model", a.model, "--dataset-name", "random",
            "--random-input-len", input_len, "--random-output-len", output_len,
            "--random-range-ratio", "0", "--num-prompts", prompts,
            "--max-model-len", input_len + output_len + MODEL_LEN_MARGIN,
            "--tensor-parallel-size", a.tp, "--seed", "0", "--output-json", out,
            *a.engine_args], run.env)
        run.measure(install, f"{input_len}/{output_len}",
                    {"input_len": input_len, "output_len": output_len, "num_prompts": prompts},
                    [cmd], out.with_suffix(".log"),
                    lambda out=out: _numbers(out))


def compare_mixed(mixed: dict, reference: dict) -> dict:
    """The order-contract verdict of a mixed run and its unchunked reference run."""
    if not mixed.get("mixed_steps"):
        verdict = "not-triggered"   # no step held decode + extend + prefill
    elif not reference.get("needle_found"):
        verdict = "inconclusive"    # the model cannot do the task even unchunked
    else:
        verdict = "pass" if mixed.get("needle_found") else "fail"
    return {"verdict": verdict, "mixed_steps": mixed.get("mixed_steps", 0),
            "steps": len(mixed.get("steps", []))}


def mixed(run: Run, install: Install) -> None:
    a = run.args
    outs = {m: run.work / f"mixed-{install.name}-{m}.json" for m in ("reference", "mixed")}
    cmds = [install.command([Path(__file__).with_name("mixed_batch.py"), "--model", a.model,
                             "--mode", mode, "--out", out, "--tensor-parallel-size", a.tp,
                             *a.engine_args], run.env)
            for mode, out in outs.items()]
    run.measure(install, "order-contract", {}, cmds, run.work / f"mixed-{install.name}.log",
                lambda: compare_mixed(*(json.loads(outs[m].read_text())
                                        for m in ("mixed", "reference"))))


def _wait_ready(server: subprocess.Popen, port: int) -> str | None:
    """None once the server answers /health; else why not."""
    deadline = time.monotonic() + SERVER_START_S
    while server.poll() is None and time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
            return None
        except OSError:
            time.sleep(2)
    if server.poll() is not None:
        return f"the server exited with {server.returncode} before it was ready"
    return f"the server was not ready after {SERVER_START_S} s"


def serve(run: Run, install: Install) -> None:
    a = run.args
    with socket.socket() as sock:  # a free port: sweep cells may share a node
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = run.work / f"serve-{install.name}-server.log"
    cmd = install.command([*VLLM, "serve", a.model, "--port", port, "--tensor-parallel-size", a.tp,
                           "--max-model-len", 2 * SERVE_LEN + MODEL_LEN_MARGIN, "--seed", "0",
                           *a.engine_args], run.env)
    with open(log, "w") as fh:
        server = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=run.env,
                                  start_new_session=True)
    try:
        why = _wait_ready(server, port)
        if why:
            run.failed.append(f"serve server {install.name}: {why} ({log})")
            return
        for conc in a.concurrency:
            out = run.work / f"serve-{install.name}-c{conc}.json"
            prompts = max(32, 5 * conc)
            bench = install.command([
                *VLLM, "bench", "serve", "--backend", "vllm", "--model", a.model, "--port", port,
                "--dataset-name", "random", "--random-input-len", SERVE_LEN,
                "--random-output-len", SERVE_LEN, "--random-range-ratio", "0", "--ignore-eos",
                "--max-concurrency", conc, "--num-prompts", prompts,
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--seed", "0", "--save-result", "--result-dir", run.work,
                "--result-filename", out.name], run.env)
            run.measure(install, f"c{conc}", {"concurrency": conc, "num_prompts": prompts},
                        [bench], out.with_suffix(".log"),
                        lambda out=out: _numbers(out))
    finally:
        stop(server)


def parse_lm_eval(out_dir: Path) -> dict:
    files = sorted(out_dir.rglob("results_*.json"), key=os.path.getmtime)
    if not files:
        raise ValueError(f"lm_eval wrote no results_*.json under {out_dir}")
    data = json.loads(files[-1].read_text())
    return {k: v for k, v in data["results"]["gsm8k"].items() if k.startswith("exact_match")}


def gsm8k(run: Run, install: Install) -> None:
    a = run.args
    out = run.work / f"gsm8k-{install.name}"
    model_args = {"pretrained": a.model, "tensor_parallel_size": a.tp, "max_model_len": 4096,
                  "gpu_memory_utilization": 0.8, "seed": 0, **parse_engine_args(a.engine_args)}
    cmd = install.command(["-m", "lm_eval", "--model", "vllm", "--model_args",
                           ",".join(f"{k}={v}" for k, v in model_args.items()),
                           "--tasks", "gsm8k", "--num_fewshot", "5", "--batch_size", "auto",
                           "--seed", "0", "--output_path", out,
                           *(["--limit", a.limit] if a.limit else [])], run.env)
    run.measure(install, "gsm8k-5shot", {"limit": a.limit}, [cmd], out.with_suffix(".log"),
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


def gsm8k_gate(benchmarks: list[dict], sigmas: float) -> dict:
    """patched >= upstream - sigmas x combined standard error (lm_eval's own stderr)."""
    sides = {b["extra_info"]["install"]: b["extra_info"]["results"] for b in benchmarks}
    up, pa = sides.get("upstream") or {}, sides.get("patched") or {}
    gate = {"metric": GSM8K, "upstream": up.get(GSM8K), "patched": pa.get(GSM8K),
            "passed": None, "rule": "no gate: no upstream accuracy"}
    if gate["patched"] is None:
        return {**gate, "passed": False, "rule": "no patched accuracy was measured"}
    if gate["upstream"] is not None:
        gate["tolerance"] = sigmas * math.hypot(up.get(GSM8K_STDERR, 0), pa.get(GSM8K_STDERR, 0))
        gate["passed"] = gate["patched"] >= gate["upstream"] - gate["tolerance"]
        gate["rule"] = f"patched >= upstream - {sigmas} x combined stderr ({gate['tolerance']:.4f})"
    return gate


def mixed_gate(benchmarks: list[dict]) -> dict:
    """The patched verdict must be ``pass``; upstream's is recorded, not gated."""
    verdicts = {b["extra_info"]["install"]: b["extra_info"]["results"].get("verdict")
                for b in benchmarks}
    passed = None if verdicts.get("patched") is None else verdicts["patched"] == "pass"
    return {**verdicts, "passed": passed,
            "rule": "patched: the answer holds the needle after mixed decode + extend + prefill"}


def run_recipe(name: str, installs: list[Install], args, env: dict, probes: dict) -> dict:
    """Run recipe ``name`` for every install; write and return its results document."""
    stamp = datetime.datetime.now(datetime.UTC)
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    series = {"commit": git.stdout.strip() or os.environ.get("SERIES_COMMIT", "unknown")}
    device = probes[installs[0].name].get("device", "unknown")
    tag = f"{stamp:%Y%m%d-%H%M%S}-{re.sub(r'[^A-Za-z0-9.]+', '-', device).lower()}-" \
          f"{series['commit'][:10]}-{name}"
    run = Run(name, args, env, args.work / tag)
    run.work.mkdir(parents=True, exist_ok=True)
    for install in installs:
        RECIPES[name](run, install)
    gate = None
    if name == "gsm8k":
        gate = gsm8k_gate(run.benchmarks, GATE_SIGMAS)
    elif name == "mixed":
        gate = mixed_gate(run.benchmarks)
    if gate and gate["passed"] is False:
        run.failed.append(f"gate failed: {gate['rule']}")
    doc = {"format": "e2e/1", "recipe": name, "datetime": stamp.isoformat(timespec="seconds"),
           "machine_info": {"node": socket.gethostname(), "series": {**series, "device": device}},
           "installs": {i.name: {"command": shlex.join(i.argv), "probe": probes[i.name]}
                        for i in installs},
           "env": recorded_env(env), "engine_args": args.engine_args,
           "benchmarks": run.benchmarks, "comparison": comparison(run.benchmarks),
           "gate": gate, "failed": run.failed or None}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{tag}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    doc["path"] = str(path)
    return doc


class UsageError(Exception):
    pass


def _lengths(text: str) -> list[tuple[int, int]]:
    """'2048/16,8192/16' -> [(2048, 16), (8192, 16)]; argparse reports a ValueError."""
    pairs = []
    for item in text.split(","):
        input_len, output_len = item.split("/")
        pairs.append((int(input_len), int(output_len)))
    return pairs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipes", nargs="+", choices=(*RECIPES, "all"), metavar="RECIPE")
    p.add_argument("--model", required=True, help="HF model id or local path")
    p.add_argument("--upstream", help="command running the upstream install's Python, e.g. "
                                      "/opt/up/bin/python or 'docker exec up python3' "
                                      "(default $E2E_UPSTREAM)")
    p.add_argument("--patched", help="the same for the patched install ($E2E_PATCHED)")
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
    return p


def installs_from(args, environ=os.environ) -> list[Install]:
    installs = []
    for name in INSTALL_ENV:
        command = getattr(args, name) or environ.get(INSTALL_ENV[name])
        if not command:
            raise UsageError(f"no {name} install: pass --{name} PYTHON (a path, or a command such "
                             f"as 'docker exec CONTAINER python3') or set {INSTALL_ENV[name]}")
        installs.append(Install(name, tuple(shlex.split(command))))  # ValueError: bad quotes
    return installs


def run_env(pairs: list[str], environ=os.environ) -> dict:
    env = {"VLLM_ROCM_USE_AITER": "1", **environ}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--env expects NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def probe(install: Install, env: dict, tp: int, need_lm_eval: bool) -> dict:
    """What the install's Python has, and its ``problems``."""
    who = shlex.join(install.argv)
    try:
        proc = subprocess.run(install.command(["-c", PROBE, tp, int(need_lm_eval)], env),
                              capture_output=True, text=True, env=env, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:  # no such program, or no answer
        return {"problems": [f"cannot run `{who}`: {exc}"]}
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
        raise UsageError("e2e preflight failed (a ROCm machine with AITER and both vLLM installs "
                         "is needed); nothing was run.\n" + "\n".join(found))
    return probes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args = []
    if "--" in argv:
        argv, engine_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser().parse_args(argv)
    args.engine_args = engine_args
    names = list(RECIPES) if "all" in args.recipes else list(dict.fromkeys(args.recipes))
    try:
        installs = installs_from(args)
        env = run_env(args.env)
        probes = preflight(installs, env, args.tp, "gsm8k" in names)
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = False
    for name in names:
        doc = run_recipe(name, installs, args, env, probes)
        print(f"[e2e] {name}: {doc['path']}; gate passed: {(doc['gate'] or {}).get('passed')}")
        for row in doc["comparison"]:
            print(f"  {row['case']} {row['metric']}: patched / upstream {row['ratio'] or 0:.3f}")
        for line in doc["failed"] or []:
            print(f"  FAILED {line}", file=sys.stderr)
        failed = failed or bool(doc["failed"])
    return 1 if failed else 0
