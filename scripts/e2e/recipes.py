"""The recipes: vLLM's own tools run with each install; their numbers, ratios and gates.

Every number under ``results`` is read from the tool's own output file; only the
patched / upstream ratios and the gates are computed here.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .mixed_batch import parse_engine_args

ROOT = Path(__file__).resolve().parents[2]
VLLM = ("-m", "vllm.entrypoints.cli.main")
MODEL_LEN_MARGIN = 64
SERVE_LEN = 1024          # serve: random input and output length
SERVER_START_S = 1800
THROUGHPUT_METRICS = ("requests_per_second", "tokens_per_second", "elapsed_time", "num_requests",
                      "total_num_tokens")
SERVE_METRICS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                 "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                 "p99_tpot_ms", "median_itl_ms", "p99_e2el_ms")
GSM8K = "exact_match,strict-match"
GSM8K_STDERR = "exact_match_stderr,strict-match"
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
    """SIGTERM the process group (vLLM's engine processes too), SIGKILL after a minute."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass


def run_logged(cmd: list[str], env: dict, log: Path, timeout_s: float | None) -> int:
    """Run ``cmd`` in its own process group, output appended to ``log``."""
    with open(log, "a") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
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


def _pick(path: Path, names: tuple) -> dict:
    """The numbers ``names`` of the JSON file a tool wrote."""
    data = json.loads(path.read_text())
    return {k: data[k] for k in names if k in data}


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
                    lambda out=out: _pick(out, THROUGHPUT_METRICS))


def compare_mixed(mixed: dict, reference: dict) -> dict:
    """The order-contract verdict of a mixed run and its unchunked reference run."""
    if not mixed.get("mixed_steps"):
        verdict = "not-triggered"   # no step held decode + extend + prefill
    elif not reference.get("needle_found"):
        verdict = "inconclusive"    # the model cannot do the task even unchunked
    else:
        verdict = "pass" if mixed.get("needle_found") else "fail"
    return {"verdict": verdict, "needle_found": bool(mixed.get("needle_found")),
            "needle_found_reference": bool(reference.get("needle_found")),
            "mixed_steps": mixed.get("mixed_steps", 0), "steps": len(mixed.get("steps", []))}


def mixed(run: Run, install: Install) -> None:
    a = run.args
    outs = {m: run.work / f"mixed-{install.name}-{m}.json" for m in ("reference", "mixed")}
    cmds = [install.command([Path(__file__).with_name("mixed_batch.py"), "--model", a.model,
                             "--tp", a.tp, "--mode", mode, "--out", out, *a.engine_args], run.env)
            for mode, out in outs.items()]
    run.measure(install, "order-contract", {}, cmds, run.work / f"mixed-{install.name}.log",
                lambda: compare_mixed(*(json.loads(outs[m].read_text())
                                        for m in ("mixed", "reference"))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    port = _free_port()
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
                        lambda out=out: _pick(out, SERVE_METRICS))
    finally:
        stop(server)


def parse_lm_eval(out_dir: Path) -> dict:
    files = sorted(out_dir.rglob("results_*.json"), key=os.path.getmtime)
    if not files:
        raise ValueError(f"lm_eval wrote no results_*.json under {out_dir}")
    data = json.loads(files[-1].read_text())
    results = {k: v for k, v in data["results"]["gsm8k"].items() if k.startswith("exact_match")}
    results["samples"] = data.get("n-samples", {}).get("gsm8k", {}).get("effective")
    return results


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
    sides: dict = {}
    for bench in benchmarks:
        info = bench["extra_info"]
        sides.setdefault(info["case"], {})[info["install"]] = info["results"]
    rows = []
    for case, got in sides.items():
        up, pa = got.get("upstream") or {}, got.get("patched") or {}
        for metric, value in pa.items():
            base = up.get(metric)
            numbers = [v for v in (value, base) if isinstance(v, (int, float))
                       and not isinstance(v, bool)]
            if len(numbers) == 2:
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
        gate["rule"] = f"patched >= upstream - {sigmas:g} x combined stderr ({gate['tolerance']:.4f})"
    return gate


def mixed_gate(benchmarks: list[dict]) -> dict:
    """The patched verdict must be ``pass``; upstream's is recorded, not gated."""
    verdicts = {b["extra_info"]["install"]: b["extra_info"]["results"].get("verdict")
                for b in benchmarks}
    return {**verdicts, "passed": None if "patched" not in verdicts else verdicts["patched"] == "pass",
            "rule": "patched: the answer holds the needle after mixed decode + extend + prefill"}


def run_recipe(name: str, installs: list[Install], args, env: dict, probes: dict) -> dict:
    """Run recipe ``name`` for every install; write and return its results document."""
    stamp = datetime.datetime.now(datetime.UTC)
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    series = {"commit": git.stdout.strip() or os.environ.get("SERIES_COMMIT", "unknown")}
    first = probes[installs[0].name]
    device = first.get("device") or "unknown"
    tag = f"{stamp:%Y%m%d-%H%M%S}-{re.sub(r'[^A-Za-z0-9.]+', '-', device).lower()}-" \
          f"{series['commit'][:10]}-{name}"
    run = Run(name, args, env, args.work / tag)
    run.work.mkdir(parents=True, exist_ok=True)
    for install in installs:
        RECIPES[name](run, install)
    gate = None
    if name == "gsm8k":
        gate = gsm8k_gate(run.benchmarks, args.gate_sigmas)
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

