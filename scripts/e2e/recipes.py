"""The recipes, for each install: run vLLM's own tools, keep their numbers, write one JSON.

  * ``throughput`` -- ``vllm bench throughput``, random prompts, long input / short
                      output: 2048/16, 8192/16, 32768/64 (``lengths``);
  * ``mixed``      -- the order-contract case (``mixed_batch.py``): decode + extend +
                      fresh prefill in one step, a needle only the extend's cached
                      context holds; compared with an unchunked reference run;
  * ``serve``      -- ``vllm serve`` + ``vllm bench serve``, random 1024/1024 at
                      max concurrency 4, 8, 16, 32, 64, 128;
  * ``gsm8k``      -- ``lm_eval`` gsm8k 5-shot with the vllm backend; the gate:
                      patched accuracy >= upstream - k * combined standard error.

The results file has the kernel bench file's shape where it makes sense::

    {"format": "e2e/1", "recipe", "datetime",
     "machine_info": {"node", "host",
                      "series": {commit, dirty, device, gpu_count, torch, hip, aiter}},
     "installs": {name: {command, env, probe}}, "env": {VLLM_* of the run},
     "options": {...},
     "benchmarks": [{"name", "group": recipe, "extra_info": {recipe, case, install, model,
                     params, env, command, results: {metric: value}, returncode, log, error?}}],
     "comparison": [{case, metric, upstream, patched, ratio}], "gate": {...} | null,
     "failed": [messages] | null}

Every value under ``results`` is read from the tool's own output file; nothing
is computed here except ratios (comparison) and the gate.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import preflight
from .installs import Install, recorded_env, run_env

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FORMAT = "e2e/1"
VLLM_CLI = ("-m", "vllm.entrypoints.cli.main")
DEFAULT_LENGTHS = ((2048, 16), (8192, 16), (32768, 64))
DEFAULT_CONCURRENCY = (4, 8, 16, 32, 64, 128)
# Throughput: enough prompts for ~1M prompt tokens per case, at least 32.
PROMPT_TOKENS_PER_CASE = 1 << 20
SERVE_METRICS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                 "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                 "p99_tpot_ms", "median_itl_ms", "p99_e2el_ms")
GSM8K_METRICS = ("exact_match,strict-match", "exact_match,flexible-extract")
MODEL_LEN_MARGIN = 64
MIXED_DEFAULT_BACKEND = "ROCM_AITER_FA"
CPU_NOTE = ("CPU mode (docs/e2e-cpu.md): the recipe's command lines, parsers and result file on "
            "the CPU tier's engine; not performance data (tiny random models, a shared machine: "
            "the ratios are noise)")


class RecipeError(Exception):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


@dataclass
class Options:
    model: str | None = None
    device: str = "rocm"  # or "cpu": the CPU tier's engine (docs/e2e-cpu.md)
    tp: int = 1
    attention_backend: str | None = None
    engine_args: list[str] = field(default_factory=list)
    # throughput
    lengths: list[tuple[int, int]] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    num_prompts: int | None = None
    # serve
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    serve_input_len: int = 1024
    serve_output_len: int = 1024
    prompts_per_concurrency: int = 5
    port: int = 8000
    server_start_timeout_s: float = 1800
    # gsm8k
    num_fewshot: int = 5
    limit: int | None = None
    gate_sigmas: float = 3.0
    min_accuracy: float | None = None
    # mixed
    long_prompt_len: int = 12288
    chunk: int = 2048
    max_num_batched_tokens: int = 4096
    fresh_prompts: int = 4


def options_from_params(params: Mapping) -> Options:
    """Options from a sweep cell's params (input_len + output_len -> one length pair,
    a single concurrency -> a list of one)."""
    params = dict(params)
    opts = Options()
    if "input_len" in params or "output_len" in params:
        if "input_len" not in params or "output_len" not in params:
            raise RecipeError("give input_len and output_len together")
        opts.lengths = [(int(params.pop("input_len")), int(params.pop("output_len")))]
    if isinstance(params.get("concurrency"), int):
        params["concurrency"] = [params["concurrency"]]
    names = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(params) - names)
    if unknown:
        raise RecipeError(f"unknown recipe option(s) {unknown}; known: input_len, output_len, "
                          + ", ".join(sorted(names)))
    for name, value in params.items():
        if name == "lengths":
            value = [tuple(int(x) for x in pair) for pair in value]
        setattr(opts, name, value)
    return opts


# ---------------------------------------------------------------------------- running commands

def run_logged(cmd: list[str], env: Mapping[str, str], log: Path, timeout_s: float | None,
               echo: bool = True) -> tuple[int, str]:
    """Run ``cmd`` in its own process group, output to ``log`` (and stdout); (rc, tail).

    On timeout the whole process group is stopped and RecipeError raised."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail: list[str] = []
    with open(log, "w") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=dict(env), start_new_session=True, bufsize=1,
                                    errors="replace")
        except FileNotFoundError as exc:
            raise RecipeError(f"cannot run `{cmd[0]}`: {exc.strerror}") from exc

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                fh.write(line)
                tail.append(line)
                del tail[:-200]
                if echo:
                    sys.stdout.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            reader.join(timeout=10)
            raise RecipeError(f"timed out after {timeout_s} s: {shlex.join(cmd)}",
                              "".join(tail)) from None
        reader.join()
    return rc, "".join(tail)


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM the process group, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Run:
    """One recipe over the installs: where logs go, the env of each install, results so far."""
    recipe: str
    opts: Options
    work: Path
    logs: Path
    env: dict[str, str]
    timeout_s: float | None
    echo: bool = True
    benchmarks: list[dict] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def install_env(self, install: Install) -> dict[str, str]:
        return run_env(install, self.env, device=self.opts.device)

    def command(self, install: Install, *args) -> list[str]:
        return install.command(*args, env=self.install_env(install))

    def backend_args(self) -> list[str]:
        backend = self.opts.attention_backend
        return ["--attention-backend", backend] if backend and backend != "auto" else []

    def add(self, install: Install, case: str, params: dict, cmd: list[str], results: dict,
            returncode: int | None, log: Path | None, error: str | None = None) -> None:
        info = {"recipe": self.recipe, "case": case, "install": install.name,
                "model": self.opts.model, "params": params,
                "env": recorded_env(self.install_env(install)), "command": shlex.join(cmd),
                "results": results, "returncode": returncode,
                "log": str(log) if log else None}
        if error:
            info["error"] = error
            self.failed.append(f"{self.recipe} {case} {install.name}: {error}")
        self.benchmarks.append({"name": f"{self.recipe}[{case}-{install.name}]",
                                "group": self.recipe, "extra_info": info})

    def call(self, install: Install, case: str, params: dict, cmd: list[str], log: Path,
             parse: Callable[[], dict]) -> dict | None:
        """Run one measured command; record its results or its failure; return results."""
        print(f"[e2e] {self.recipe} {case} {install.name}: {shlex.join(cmd)}", flush=True)
        try:
            rc, tail = run_logged(cmd, self.install_env(install), log, self.timeout_s, self.echo)
        except RecipeError as exc:
            self.add(install, case, params, cmd, {}, None, log, str(exc))
            return None
        if rc != 0:
            last = [ln for ln in tail.strip().splitlines() if ln.strip()][-1:] or [""]
            self.add(install, case, params, cmd, {}, rc, log, f"exit {rc}: {last[0][:300]}")
            return None
        try:
            results = parse()
        except (OSError, ValueError, KeyError) as exc:
            self.add(install, case, params, cmd, {}, rc, log,
                     f"no results: {type(exc).__name__}: {exc}")
            return None
        self.add(install, case, params, cmd, results, rc, log)
        return results


# ---------------------------------------------------------------------------- parsers

_THROUGHPUT_LINE = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, "
                              r"([\d.]+) output tokens/s")


def parse_throughput(json_path: Path, log_text: str = "") -> dict:
    data = json.loads(json_path.read_text())
    results = {k: data[k] for k in ("requests_per_second", "tokens_per_second", "elapsed_time",
                                    "num_requests", "total_num_tokens")}
    match = _THROUGHPUT_LINE.search(log_text)
    if match:
        results["output_tokens_per_second"] = float(match.group(3))
    return results


def parse_serve(json_path: Path) -> dict:
    data = json.loads(json_path.read_text())
    return {k: data[k] for k in SERVE_METRICS if k in data and not isinstance(data[k], list)}


def parse_lm_eval(out_dir: Path, task: str = "gsm8k") -> dict:
    files = sorted(glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise ValueError(f"lm_eval wrote no results_*.json under {out_dir}")
    data = json.loads(Path(files[-1]).read_text())
    task_results = data["results"][task]
    results = {}
    for metric in GSM8K_METRICS:
        name, _, filt = metric.partition(",")
        if metric in task_results:
            results[metric] = task_results[metric]
            stderr = task_results.get(f"{name}_stderr,{filt}")
            if isinstance(stderr, (int, float)):
                results[f"{name}_stderr,{filt}"] = stderr
    samples = data.get("n-samples", {}).get(task, {})
    if "effective" in samples:
        results["samples"] = samples["effective"]
    if not results:
        raise ValueError(f"no {GSM8K_METRICS} in {files[-1]}")
    return results


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_mixed(mixed: dict, reference: dict) -> dict:
    """Results of the order-contract case from a mixed run and its unchunked reference."""
    def agreement(rid: str) -> float | None:
        ref = reference["requests"].get(rid, {}).get("token_ids")
        got = mixed["requests"].get(rid, {}).get("token_ids")
        if not ref or got is None:
            return None
        return common_prefix(got, ref) / len(ref)

    fresh = [agreement(r) for r in mixed["requests"] if r.startswith("fresh-")]
    fresh = [f for f in fresh if f is not None]
    if not mixed.get("mixed_steps"):
        verdict = "not-triggered"
    elif not reference.get("needle_found"):
        verdict = "inconclusive"
    else:
        verdict = "pass" if mixed.get("needle_found") else "fail"
    return {"verdict": verdict, "needle_found": bool(mixed.get("needle_found")),
            "needle_found_reference": bool(reference.get("needle_found")),
            "mixed_steps": mixed.get("mixed_steps", 0), "steps": len(mixed.get("steps", [])),
            "long_prompt_agreement": agreement("long"),
            "fresh_prompts_agreement_min": min(fresh) if fresh else None,
            "decoder_agreement": agreement("decoder")}


# ---------------------------------------------------------------------------- recipes

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def throughput(run: Run, install: Install) -> None:
    opts = run.opts
    for input_len, output_len in opts.lengths:
        case = f"{input_len}/{output_len}"
        prompts = opts.num_prompts or max(32, PROMPT_TOKENS_PER_CASE // input_len)
        out = run.work / f"throughput-{install.name}-{input_len}x{output_len}.json"
        log = run.logs / f"throughput-{install.name}-{input_len}x{output_len}.log"
        cmd = run.command(install, *VLLM_CLI, "bench", "throughput", "--model", opts.model,
                          "--dataset-name", "random", "--random-input-len", input_len,
                          "--random-output-len", output_len, "--random-range-ratio", "0",
                          "--num-prompts", prompts,
                          "--max-model-len", input_len + output_len + MODEL_LEN_MARGIN,
                          "--tensor-parallel-size", opts.tp, "--seed", "0",
                          "--output-json", out, *run.backend_args(), *opts.engine_args)
        run.call(install, case, {"input_len": input_len, "output_len": output_len,
                                 "num_prompts": prompts}, cmd, log,
                 lambda out=out, log=log: parse_throughput(out, log.read_text()))


def mixed(run: Run, install: Install) -> None:
    opts = run.opts
    script = HERE / "mixed_batch.py"
    # The order contract is AITER FA's: that backend unless told otherwise ("auto": vLLM
    # picks); the CPU engine has one attention backend per model kind.
    backend = opts.attention_backend or (MIXED_DEFAULT_BACKEND if opts.device == "rocm"
                                         else "auto")
    params = {"long_prompt_len": opts.long_prompt_len, "chunk": opts.chunk,
              "max_num_batched_tokens": opts.max_num_batched_tokens,
              "fresh_prompts": opts.fresh_prompts, "attention_backend": backend}
    outputs = {}
    for mode in ("reference", "mixed"):
        out = run.work / f"mixed-{install.name}-{mode}.json"
        log = run.logs / f"mixed-{install.name}-{mode}.log"
        cmd = run.command(install, script, "--mode", mode, "--model", opts.model, "--out", out,
                          "--tp", opts.tp, "--long-prompt-len", opts.long_prompt_len,
                          "--chunk", opts.chunk,
                          "--max-num-batched-tokens", opts.max_num_batched_tokens,
                          "--fresh-prompts", opts.fresh_prompts,
                          *([] if backend == "auto" else ["--attention-backend", backend]),
                          *opts.engine_args)
        print(f"[e2e] mixed {mode} {install.name}: {shlex.join(cmd)}", flush=True)
        try:
            rc, tail = run_logged(cmd, run.install_env(install), log, run.timeout_s, run.echo)
        except RecipeError as exc:
            run.add(install, "order-contract", params, cmd, {}, None, log, str(exc))
            return
        if rc != 0 or not out.is_file():
            last = [ln for ln in tail.strip().splitlines() if ln.strip()][-1:] or [""]
            run.add(install, "order-contract", params, cmd, {}, rc, log,
                    f"{mode} run exit {rc}: {last[0][:300]}")
            return
        outputs[mode] = json.loads(out.read_text())
    results = compare_mixed(outputs["mixed"], outputs["reference"])
    run.add(install, "order-contract", params, cmd, results, 0, log)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> str | None:
    """None when /health answers 200; else why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with {proc.returncode} before it was ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(5)
    return f"the server was not ready after {timeout_s} s"


def serve(run: Run, install: Install) -> None:
    opts = run.opts
    params = {"input_len": opts.serve_input_len, "output_len": opts.serve_output_len}
    if not _port_free(opts.port):
        run.add(install, "server", params, [], {}, None, None,
                f"port {opts.port} is in use (another server?); pass --port")
        return
    log = run.logs / f"serve-{install.name}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = run.command(install, *VLLM_CLI, "serve", opts.model, "--port", opts.port,
                      "--tensor-parallel-size", opts.tp,
                      "--max-model-len", opts.serve_input_len + opts.serve_output_len
                      + MODEL_LEN_MARGIN, "--seed", "0", *run.backend_args(),
                      *opts.engine_args)
    print(f"[e2e] serve {install.name}: starting {shlex.join(cmd)} (log: {log})", flush=True)
    with open(log, "w") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env=run.install_env(install), start_new_session=True)
    try:
        why = _wait_healthy(proc, opts.port, opts.server_start_timeout_s)
        if why:
            tail = log.read_text()[-2000:]
            run.add(install, "server", params, cmd, {}, proc.poll(), log, why)
            print(tail, flush=True)
            return
        for conc in opts.concurrency:
            prompts = max(32, opts.prompts_per_concurrency * conc)
            case = f"c{conc}"
            out = run.work / f"serve-{install.name}-c{conc}.json"
            bench = run.command(install, *VLLM_CLI, "bench", "serve", "--backend", "vllm",
                                "--model", opts.model, "--port", opts.port,
                                "--dataset-name", "random",
                                "--random-input-len", opts.serve_input_len,
                                "--random-output-len", opts.serve_output_len,
                                "--random-range-ratio", "0", "--ignore-eos",
                                "--max-concurrency", conc, "--num-prompts", prompts,
                                "--percentile-metrics", "ttft,tpot,itl,e2el",
                                "--metric-percentiles", "50,99", "--seed", "0",
                                "--save-result", "--result-dir", run.work,
                                "--result-filename", out.name)
            run.call(install, case, {**params, "concurrency": conc, "num_prompts": prompts}, bench,
                     run.logs / f"serve-{install.name}-c{conc}.log",
                     lambda out=out: parse_serve(out))
    finally:
        stop(proc)


def _lm_eval_model_args(opts: Options) -> str:
    from .mixed_batch import parse_engine_args

    args = {"pretrained": opts.model, "tensor_parallel_size": opts.tp, "max_model_len": 4096,
            "gpu_memory_utilization": 0.8, "seed": 0}
    if opts.attention_backend and opts.attention_backend != "auto":
        args["attention_backend"] = opts.attention_backend
    args.update(parse_engine_args(opts.engine_args))
    return ",".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"
                    for k, v in args.items())


def gsm8k(run: Run, install: Install) -> None:
    opts = run.opts
    out = run.work / f"gsm8k-{install.name}"
    cmd = run.command(install, "-m", "lm_eval", "--model", "vllm", "--model_args",
                      _lm_eval_model_args(opts), "--tasks", "gsm8k", "--num_fewshot",
                      opts.num_fewshot, "--batch_size", "auto", "--seed", "0",
                      "--output_path", out,
                      *(["--limit", opts.limit] if opts.limit else []))
    run.call(install, f"gsm8k-{opts.num_fewshot}shot", {"num_fewshot": opts.num_fewshot,
                                                         "limit": opts.limit},
             cmd, run.logs / f"gsm8k-{install.name}.log", lambda: parse_lm_eval(out))


RECIPES: dict[str, Callable[[Run, Install], None]] = {
    "throughput": throughput, "mixed": mixed, "serve": serve, "gsm8k": gsm8k}


# ---------------------------------------------------------------------------- comparison, gates

def comparison(benchmarks: list[dict]) -> list[dict]:
    by_case: dict[str, dict[str, dict]] = {}
    for bench in benchmarks:
        info = bench["extra_info"]
        by_case.setdefault(info["case"], {})[info["install"]] = info.get("results", {})
    rows = []
    for case, sides in by_case.items():
        up, pa = sides.get("upstream"), sides.get("patched")
        if not up or not pa:
            continue
        for metric, value in pa.items():
            base = up.get(metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or isinstance(base, bool) or not isinstance(base, (int, float)):
                continue
            rows.append({"case": case, "metric": metric, "upstream": base, "patched": value,
                         "ratio": value / base if base else None})
    return rows


def gsm8k_gate(benchmarks: list[dict], sigmas: float, min_accuracy: float | None) -> dict:
    metric, stderr_key = "exact_match,strict-match", "exact_match_stderr,strict-match"
    sides = {b["extra_info"]["install"]: b["extra_info"].get("results", {}) for b in benchmarks}
    gate: dict = {"metric": metric, "sigmas": sigmas, "min_accuracy": min_accuracy}
    patched = sides.get("patched", {}).get(metric)
    upstream = sides.get("upstream", {}).get(metric)
    gate.update(upstream=upstream, patched=patched)
    if patched is None:
        gate.update(passed=False, rule="no patched accuracy was measured")
        return gate
    checks, rules = [], []
    if upstream is not None:
        se = math.hypot(sides["upstream"].get(stderr_key) or 0.0,
                        sides["patched"].get(stderr_key) or 0.0)
        gate["tolerance"] = sigmas * se
        checks.append(patched >= upstream - sigmas * se)
        rules.append(f"patched >= upstream - {sigmas:g} x combined stderr ({sigmas * se:.4f})")
    if min_accuracy is not None:
        checks.append(patched >= min_accuracy)
        rules.append(f"patched >= {min_accuracy}")
    if not checks:
        gate.update(passed=None, rule="no gate: upstream not run and no --min-accuracy")
    else:
        gate.update(passed=all(checks), rule="; ".join(rules))
    return gate


def mixed_gate(benchmarks: list[dict], device: str = "rocm") -> dict:
    verdicts = {b["extra_info"]["install"]: b["extra_info"].get("results", {}).get("verdict")
                for b in benchmarks}
    patched = verdicts.get("patched")
    if device == "cpu":
        # A tiny random model cannot find the needle: gate on the tokens instead.
        results = next((b["extra_info"].get("results", {}) for b in benchmarks
                        if b["extra_info"]["install"] == "patched"), {})
        agreements = [results.get(k) for k in ("long_prompt_agreement",
                                                "fresh_prompts_agreement_min",
                                                "decoder_agreement")]
        passed = None
        if results.get("mixed_steps"):
            passed = all(a == 1.0 for a in agreements)
        return {**{f"{k}_verdict": v for k, v in verdicts.items()}, "passed": passed,
                "rule": "CPU mode: patched, after mixed decode + extend + prefill steps, "
                        "generates every request's tokens exactly as the unchunked reference "
                        "(no gate when no such step formed; the needle verdicts are recorded)"}
    return {**{f"{k}_verdict": v for k, v in verdicts.items()},
            "passed": None if patched is None else patched == "pass",
            "rule": "patched: the long prompt's answer holds the needle after mixed "
                    "decode + extend + prefill steps (upstream's verdict is recorded, not gated)"}


# ---------------------------------------------------------------------------- the document

def series_commit() -> dict:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD") or os.environ.get("SERIES_COMMIT", "unknown")
    dirty = git("status", "--porcelain", "--", "patches", "vllm_overlay", "scripts")
    return {"commit": commit, "dirty": bool(dirty) if dirty is not None else "unknown"}


def run_recipe(name: str, installs: list[Install], opts: Options, *, out_dir: Path,
               work_dir: Path | None = None, env: Mapping[str, str] | None = None,
               timeout_s: float | None = None, host_check: bool = True, echo: bool = True,
               probes: dict | None = None) -> dict:
    """Preflight (unless ``probes`` are given), run ``name`` for every install, write the JSON.

    ``out_dir`` gets the results file (``<date>-<device>-<commit>-<recipe>.json``);
    ``work_dir/<same stem>/`` the tools' own output files and the logs (default:
    ``out_dir``).  Each command runs at most ``timeout_s``."""
    if name not in RECIPES:
        raise RecipeError(f"unknown recipe {name!r}; one of {', '.join(RECIPES)}")
    if not opts.model:
        raise RecipeError(f"{name}: a model is needed (--model)")
    if not installs:
        raise RecipeError(f"{name}: no install to run")
    env = dict(env or {})
    if probes is None:
        envs = {i.name: run_env(i, env, device=opts.device) for i in installs}
        try:
            probes = preflight.check(installs, envs, tp=opts.tp, need_lm_eval=name == "gsm8k",
                                     host=host_check, device=opts.device)
        except preflight.PreflightError as exc:
            raise RecipeError(str(exc)) from exc
    stamp = datetime.datetime.now(datetime.UTC)
    first = probes["installs"].get(installs[0].name) or {}
    device = first.get("device", "unknown")
    series = series_commit()
    label = "cpu" if opts.device == "cpu" else _slug(device).lower()
    tag = f"{stamp:%Y%m%d-%H%M}-{label}-{series['commit'][:10]}-{name}"
    n = 1
    while (out_dir / f"{tag}.json").exists():  # two runs in the same minute
        n += 1
        tag = f"{stamp:%Y%m%d-%H%M}-{label}-{series['commit'][:10]}-{name}-{n}"
    work = (work_dir or out_dir) / tag
    work.mkdir(parents=True, exist_ok=True)
    run = Run(recipe=name, opts=opts, work=work, logs=work / "logs", env=env,
              timeout_s=timeout_s, echo=echo)
    for install in installs:
        RECIPES[name](run, install)
    doc = {
        "format": FORMAT, "recipe": name, "datetime": stamp.isoformat(timespec="seconds"),
        "machine_info": {"node": socket.gethostname(), "host": probes.get("host", {}),
                         "series": {**series, "device": device,
                                    **{k: first.get(k) for k in ("gpu_count", "arch", "torch",
                                                                 "hip", "aiter")}}},
        "installs": {i.name: {**i.to_dict(), "probe": probes["installs"].get(i.name)}
                     for i in installs},
        "env": recorded_env(run_env(installs[0], env, device=opts.device)),
        "options": dataclasses.asdict(opts),
        "work_dir": str(work),
        "benchmarks": run.benchmarks,
        "comparison": comparison(run.benchmarks),
        "gate": (gsm8k_gate(run.benchmarks, opts.gate_sigmas, opts.min_accuracy) if name == "gsm8k"
                 else mixed_gate(run.benchmarks, opts.device) if name == "mixed" else None),
        "failed": run.failed or None,
    }
    if opts.device == "cpu":
        doc["note"] = CPU_NOTE
    gate = doc["gate"]
    if gate and gate.get("passed") is False:
        doc["failed"] = [*(doc["failed"] or []), f"gate failed: {gate['rule']}"]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{tag}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    doc["path"] = str(path)
    print(f"[e2e] {name}: wrote {path} (tool outputs and logs: {work})", flush=True)
    return doc


def summary_table(doc: dict) -> str:
    """Markdown: every measured case, then patched/upstream ratios."""
    lines = [f"### {doc['recipe']} — {doc['machine_info']['series'].get('device')}", "",
             *([f"Note: {doc['note']}.", ""] if doc.get("note") else []),
             "| case | install | results |", "|---|---|---|"]
    for bench in doc["benchmarks"]:
        info = bench["extra_info"]
        shown = info.get("error") or ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in info.get("results", {}).items())
        lines.append(f"| {info['case']} | {info['install']} | {shown} |")
    if doc["comparison"]:
        lines += ["", "| case | metric | upstream | patched | patched / upstream |",
                  "|---|---|---:|---:|---:|"]
        for row in doc["comparison"]:
            ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "–"
            lines.append(f"| {row['case']} | {row['metric']} | {row['upstream']:.4g} | "
                         f"{row['patched']:.4g} | {ratio} |")
    gate = doc.get("gate")
    if gate:
        verdict = {True: "pass", False: "FAIL", None: "no gate"}[gate.get("passed")]
        lines += ["", f"gate: {verdict} — {gate.get('rule')}"]
    return "\n".join(lines) + "\n"
