"""The e2e recipes stop at once, with one clear message, on a machine without ROCm/AITER.

Runs the real command line on this CPU machine (no vLLM needed): one install is this
interpreter (a CPU build of torch), one has no torch at all, one does not exist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from e2e import preflight  # noqa: E402
from e2e.installs import Install, InstallError, from_args, recorded_env, run_env  # noqa: E402

E2E = REPO / "scripts" / "e2e.py"


@pytest.fixture
def no_torch_site(tmp_path: Path) -> Path:
    """A PYTHONPATH entry whose ``torch`` fails to import, like a Python without torch."""
    pkg = tmp_path / "site" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    return tmp_path / "site"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(E2E), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300, check=False)


def test_cli_fails_fast_off_rocm_and_names_every_problem(tmp_path, no_torch_site):
    out, work = tmp_path / "out", tmp_path / "work"
    start = time.monotonic()
    proc = _cli("throughput", "--model", "some/model", "--upstream", sys.executable,
                "--patched", f"env PYTHONPATH={no_torch_site} {sys.executable}",
                "--out", str(out), "--work", str(work))
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "e2e preflight failed" in err and "nothing was run" in err
    if not (shutil.which("amd-smi") or shutil.which("rocm-smi")):
        assert "neither amd-smi nor rocm-smi is on PATH" in err
    if not Path("/dev/kfd").exists():
        assert "/dev/kfd does not exist" in err
    import torch

    if torch.version.hip is None:  # this machine's torch: a CPU (or CUDA) build
        assert "is not a ROCm build (torch.version.hip is None" in err
        assert "aiter" in err
    assert "patched (`env PYTHONPATH=" in err and "torch does not import" in err
    assert "scripts/e2e/README.md" in err
    assert not out.exists() and not work.exists()    # nothing measured, nothing written
    assert elapsed < 120                              # no model load, no vLLM import


def test_missing_install_binary_is_reported(tmp_path):
    proc = _cli("mixed", "--model", "m", "--only", "patched", "--patched",
                str(tmp_path / "no-such-python"))
    assert proc.returncode == 2
    assert f"cannot run `{tmp_path / 'no-such-python'}`" in proc.stderr


def test_installs_come_from_arguments_or_environment():
    with pytest.raises(InstallError, match="no upstream install: pass --upstream"):
        from_args(None, "python3", environ={})
    installs = from_args(None, None, environ={"E2E_UPSTREAM": "docker exec up python3",
                                              "E2E_PATCHED": "/opt/p/bin/python"})
    assert [i.name for i in installs] == ["upstream", "patched"]
    assert installs[0].command("-c", "pass") == ["docker", "exec", "up", "python3", "-c", "pass"]
    assert [i.name for i in from_args(None, "python3", ["patched"], environ={})] == ["patched"]


def test_recorded_env_keeps_vllm_flags_and_redacts_secrets():
    install = Install.parse("patched", "python3", {"VLLM_ROCM_USE_AITER_MHA": "0"})
    env = run_env(install, {"VLLM_ROCM_USE_AITER": "1"},
                  base={"VLLM_API_KEY": "s3cret", "HF_TOKEN": "x", "PATH": "/bin",
                        "HIP_VISIBLE_DEVICES": "0,1"})
    assert recorded_env(env) == {"HIP_VISIBLE_DEVICES": "0,1", "VLLM_API_KEY": "<redacted>",
                                 "VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MHA": "0"}
    # The recipes turn AITER on unless the caller's environment says otherwise.
    assert run_env(install, {}, base={})["VLLM_ROCM_USE_AITER"] == "1"
    assert run_env(install, {}, base={"VLLM_ROCM_USE_AITER": "0"})["VLLM_ROCM_USE_AITER"] == "0"


def test_problems_of_a_rocm_install_without_aiter_or_gpus():
    info = {"torch": "2.9.0+rocm7.0", "hip": "7.0", "gpu_count": 1,
            "aiter_error": "ModuleNotFoundError: No module named 'aiter'",
            "vllm": {"path": "/x", "version": "0.33.0"}, "lm_eval": None}
    problems = preflight.install_problems(info, tp=8, need_lm_eval=True)
    assert problems == ["import aiter failed: ModuleNotFoundError: No module named 'aiter'",
                        "sees 1 GPU(s), the run needs 8 (HIP_VISIBLE_DEVICES?)",
                        "lm_eval is not installed (pip install 'lm_eval[api]' in that install)"]
    ready = {**info, "aiter": "0.1.28.post1", "gpu_count": 8, "lm_eval": {"path": "/y"}}
    del ready["aiter_error"]
    assert preflight.install_problems(ready, tp=8, need_lm_eval=True) == []


def test_prefix_installs_get_the_recorded_env_inside():
    """`docker exec` does not pass the caller's env: the recorded flags are set inside."""
    env = {"VLLM_ROCM_USE_AITER": "1", "VLLM_API_KEY": "s3cret", "PATH": "/bin",
           "HIP_VISIBLE_DEVICES": "2"}
    image = Install.parse("patched", "docker exec -w /src vllm-patched python3")
    assert image.command("-c", "pass", env=env) == [
        "docker", "exec", "-w", "/src", "vllm-patched", "env", "HIP_VISIBLE_DEVICES=2",
        "VLLM_ROCM_USE_AITER=1", "python3", "-c", "pass"]
    venv = Install.parse("upstream", "/opt/vllm-upstream/bin/python")
    assert venv.command("-c", "pass", env=env) == ["/opt/vllm-upstream/bin/python", "-c", "pass"]


def test_cpu_mode_checks_only_torch_and_vllm(tmp_path, no_torch_site):
    """--device cpu: no ROCm/AITER checks; a Python without vLLM or torch is still refused."""
    # make test puts the patched tree on PYTHONPATH: this "upstream" has no vLLM.
    proc = _cli("throughput", "--device", "cpu", "--model", "some/model",
                "--upstream", f"env -u PYTHONPATH {sys.executable}",
                "--patched", f"env PYTHONPATH={no_torch_site} {sys.executable}",
                "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "e2e preflight failed (CPU mode)" in err and "nothing was run" in err
    assert "amd-smi" not in err and "/dev/kfd" not in err and "aiter" not in err.lower()
    assert "ROCm build" not in err
    assert "upstream (`" in err and "vllm is not installed in this Python" in err
    assert "patched (`env PYTHONPATH=" in err and "torch does not import" in err
    assert not (tmp_path / "out").exists()


def test_cpu_mode_environment_defaults():
    install = Install.parse("patched", sys.executable)
    env = run_env(install, {}, base={}, device="cpu")
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and "VLLM_ROCM_USE_AITER" not in env
    assert run_env(install, {}, base={})["VLLM_ROCM_USE_AITER"] == "1"


def test_cpu_probe_names_the_cpu(tmp_path):
    install = Install.parse("upstream", sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no vLLM then
    with pytest.raises(preflight.PreflightError, match="vllm is not installed"):
        preflight.check([install], {"upstream": env}, device="cpu")
    info = preflight.probe(install, env)
    assert info["cpu"].endswith("cores)")


def test_cpu_runs_write_into_build_not_the_tracked_results():
    """A --device cpu run is a smoke test: its JSON goes to the ignored build/, ROCm runs' to
    benchmarks/results/e2e/ (to commit); --out overrides both."""
    from e2e import cli

    assert cli.default_out("cpu") == REPO / "build" / "e2e" / "results"
    assert cli.default_out("rocm") == REPO / "benchmarks" / "results" / "e2e"
    assert subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "build/e2e/results/x.json"]).returncode == 0
