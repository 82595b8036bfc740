"""make validate-rocm end to end on the CPU tier: a stand-in ROCm platform (the probe),
the heavy parts stubbed through the runner (each writes what its command would), and the
conformance part run for real against a stand-in AITER with two fakes made to disagree."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import rocm_standin as standin
from rocm_standin import H200, MI300X, ROOT
from validate_rocm import cli, parts

HERE = Path(__file__).resolve().parent

SMALL_FAKE_TEST = textwrap.dedent("""
    import pytest, torch, fake_aiter, standins
    from aiter_mla import AiterCheckError

    def test_mla_refuses_a_float64_cache():
        fake = fake_aiter.install(standins.ARCH)
        try:
            import aiter
            args = {**standins.mla_inputs(), "kv_cache": torch.zeros(4, 4, 24, dtype=torch.float64)}
            with pytest.raises(AiterCheckError):
                aiter.fused_qk_rope_concat_and_cache_mla(*args.values())
            aiter.flash_attn_varlen_func(**standins.varlen_inputs(), causal=True)
        finally:
            fake.uninstall()
""")


class Runner:
    """Stubs every part but conformance, which runs for real (cli.run_command)."""

    def __init__(self, facts_target="gfx942", kernels_fail=True):
        self.calls = []
        self.facts_target, self.kernels_fail = facts_target, kernels_fail

    def __call__(self, cmd, env, cwd, log):
        part = log.stem
        self.calls.append((part, cmd, env))
        out = log.parent
        if part == "conformance":
            return cli.run_command(cmd, env, cwd, log)
        log.write_text(f"$ {' '.join(cmd)}\n(stub)\n")
        if part == "rocm-tests":
            standin.junit(out / "rocm-tests.xml", [
                ("tests.mla.test_mla_rope_fusion_aiter",
                 f"test_real_aiter_op_matches_the_triton_kernel[{p}]", "passed")
                for p in ("auto-False", "fp8-False", "auto-True")])
        elif part == "kernels":
            standin.junit(out / "kernels.xml", [
                ("tests.kernels.test_triton_launch", "test_amd_keys_the_2gib_buffer_bound", "passed"),
                ("tests.kernels.test_triton_fetch_kv", "test_fp8",
                 "failed" if self.kernels_fail else "passed")])
            return 1 if self.kernels_fail else 0
        elif part == "facts":
            standin.device_facts(out / "device-facts.json", self.facts_target,
                                 change=3 if self.facts_target == "gfx942" else None)
        elif part == "bench":
            standin.bench(out / "bench")
        elif part == "e2e":
            standin.e2e(out / "e2e")
        return 0


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return str(path)


def test_a_rocm_run_reports_every_claim(tmp_path, model, monkeypatch):
    fake_test = tmp_path / "test_small_fake_use.py"
    fake_test.write_text(SMALL_FAKE_TEST)
    monkeypatch.setattr(parts, "fake_test_files", lambda root: [str(fake_test)])
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    monkeypatch.setenv("AITER_CONFORMANCE_REFERENCE", "standins:disagreeing")
    runner = Runner()
    out = tmp_path / "out"
    rc = cli.main(["--model", model, "--upstream", "/opt/up/bin/python", "--patched", "python3",
                   "--out", str(out)], probe=lambda root: MI300X, runner=runner)
    assert rc == 1  # a kernel test failed, two fakes disagree, one compile fact differs
    assert [c[0] for c in runner.calls] == list(parts.ORDER)
    conformance_env = runner.calls[1][2]
    assert conformance_env["AITER_CONFORMANCE"] == str(out / "conformance.json")

    results = json.loads((out / "results.json").read_text())
    env = results["environment"]
    assert (env["device"], env["arch"], env["hip"], env["torch"], env["triton"], env["aiter"]) == (
        "AMD Instinct MI300X", "gfx942", "7.0.51831", "2.9.0+rocm7.0", "3.8.0", "0.1.28.post1")
    assert env["commit"] == MI300X["commit"]
    assert results["pins"]["AITER_REF"] == "v0.1.28.post1"
    status = {n: p["status"] for n, p in results["parts"].items()}
    assert status == {"rocm-tests": "passed", "conformance": "failed", "kernels": "failed",
                      "facts": "passed", "bench": "passed", "e2e": "passed"}  # a fact differs: the claim fails
    conf = results["parts"]["conformance"]["conformance"]
    assert conf["disagreeing"] == ["flash_attn_varlen_func", "fused_qk_rope_concat_and_cache_mla"]

    verdict = {c["id"]: c["verdict"] for c in results["claims"]}
    assert verdict["mla-aiter-op-on-rocm"] == "held"
    assert verdict["rocm-tier-real-op"] == "held"
    assert verdict["fakes-behave-like-aiter"] == "failed"
    assert verdict["fp8-native-per-arch"] == "failed"
    assert verdict["launcher-on-rocm"] == "held"
    assert verdict["compiled-for-gfx"] == "failed"
    assert verdict["amd-no-spill"] == verdict["amd-occupancy-floor"] == "held"
    assert verdict["paged-threshold"] == verdict["roofline-floor"] == "held"
    assert verdict["engine-e2e-rocm"] == verdict["gsm8k-gated"] == "held"
    assert verdict["short-extends-paged"] == "failed"  # varlen disagrees; its test did not run
    assert sum(results["summary"].values()) == len(results["claims"])

    page = (out / "REPORT.md").read_text()
    assert page.startswith("# make validate-rocm\n\nAMD Instinct MI300X (gfx942); ROCm (HIP) "
                           "7.0.51831; torch 2.9.0+rocm7.0; Triton 3.8.0; AITER 0.1.28.post1; commit "
                           "0123456789")
    assert "| **FAILED** | each fake accepts and refuses what real AITER does" in page
    assert "## Fakes that disagree with AITER" in page
    assert "| fused_qk_rope_concat_and_cache_mla | `" in page
    assert "the fake refuses (AiterCheckError: kv cache data type is not supported" in page
    assert "| fetch_kv | 1 | 1.90× | 50% |" in page  # 0.791 µs bound / 1.582 µs measured
    assert "| throughput | 2048/16 | tokens_per_s | 100 | 120 | 1.200 |" in page
    assert len(page.splitlines()) < 120


def test_allow_cuda_runs_kernels_facts_and_bench_and_skips_the_rest(tmp_path):
    runner = Runner(facts_target="sm_90", kernels_fail=False)
    out = tmp_path / "out"
    rc = cli.main(["--parts", "kernels,facts,bench,rocm-tests", "--allow-cuda", "--out", str(out)],
                  probe=lambda root: H200, runner=runner)
    assert rc == 0
    assert [c[0] for c in runner.calls] == ["kernels", "facts", "bench"]
    assert runner.calls[1][1][4] == "sm_90"
    results = json.loads((out / "results.json").read_text())
    assert results["parts"]["rocm-tests"] == {
        "status": "skipped",
        "reason": "needs ROCm and AITER; skipped under ALLOW_CUDA on NVIDIA H200 (sm_90)"}
    verdict = {c["id"]: c["verdict"] for c in results["claims"]}
    assert verdict["mla-aiter-op-on-rocm"] == "not run"
    assert verdict["amd-no-spill"] == "not run"  # an AMD budget, not judged on sm_90
    assert verdict["roofline-floor"] == "not run"  # no AMD bound on an NVIDIA GPU
    assert verdict["paged-threshold"] == "held"
    assert results["summary"]["failed"] == 0
    assert "| rocm-tests | skipped | needs ROCm and AITER" in (out / "REPORT.md").read_text()


def test_missing_prerequisites_stop_before_anything_runs(tmp_path, capsys):
    cpu = {**MI300X, "torch": "2.13.0+cpu", "hip": None, "gpu_count": 0, "device": None,
           "arch": None, "aiter": None, "aiter_error": "ModuleNotFoundError: No module named 'aiter'"}
    runner = Runner()
    rc = cli.main(["--parts", "rocm-tests,kernels", "--out", str(tmp_path / "out")],
                  probe=lambda root: cpu, runner=runner)
    assert rc == 2 and runner.calls == [] and not (tmp_path / "out").exists()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "validate-rocm: cannot run rocm-tests, kernels; missing:"
    assert err[1].startswith("  - torch 2.13.0+cpu is not a ROCm build")
    assert err[2].startswith("  - AITER does not import (ModuleNotFoundError")
    assert err[3].startswith("  - no GPU visible to torch 2.13.0+cpu")
    assert err[-1] == "Nothing was run. docs/rocm.md says what each part needs."


def test_make_verb_on_this_cpu_machine_says_what_is_missing():
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "validate-rocm",
                           "PARTS=kernels", f"GPU_PYTHON={sys.executable}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no GPU visible to torch" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_part_is_refused():
    with pytest.raises(SystemExit, match="unknown part"):
        cli.main(["--parts", "kernel"], probe=lambda root: MI300X, runner=Runner())
