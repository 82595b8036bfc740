"""Each part's command, as the kit builds it, and the readers of the parts' outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from rocm_standin import MI300X, ROOT
from seriestool.pins import load_pins
from validate_rocm import bench_roofline, device_facts, junit, prereqs
from validate_rocm.parts import PARTS, Context, facts_target, fake_test_files


@pytest.fixture
def ctx(tmp_path):
    opts = prereqs.Options(root=ROOT, pins=load_pins(ROOT), model="/models/llama",
                           upstream="/opt/up/bin/python", patched="docker exec vllm python3")
    return Context(root=ROOT, out=tmp_path, python="/usr/bin/python3", env=MI300X, opts=opts,
                   base_env={"PYTHONPATH": "/site", "TRITON_INTERPRET": "1"})


PYTEST = ["/usr/bin/python3", "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def test_rocm_tests_run_the_rocm_marker_on_the_patched_tree(ctx):
    part = PARTS["rocm-tests"]
    assert part.command(ctx) == [*PYTEST, "-m", "rocm", "tests/mla/test_mla_rope_fusion_aiter.py",
                                 f"--junitxml={ctx.out / 'rocm-tests.xml'}"]
    env = part.env(ctx)
    assert env["PYTHONPATH"] == os.pathsep.join([str(ROOT / "build/vllm"), "/site"])
    assert env["VLLM_BUILD_TREE"] == str(ROOT / "build/vllm")


def test_conformance_runs_every_test_file_that_goes_through_the_fakes(ctx):
    files = fake_test_files(ROOT)
    for f in ("tests/aiter_fa/test_aiter_fa_fakes.py", "tests/aiter_fa/test_extend_path.py",
              "tests/mla/test_mla_rope_fusion_aiter.py"):
        assert f in files
    assert not any(f.startswith(("tests/fakes/", "tests/validate_rocm/")) for f in files)
    assert "tests/kernels/test_triton_fetch_kv.py" not in files
    part = PARTS["conformance"]
    cmd = part.command(ctx)
    assert cmd[:8] == [*PYTEST, "-p", "conformance"] and cmd[8:-1] == files
    env = part.env(ctx)
    assert env["AITER_CONFORMANCE"] == str(ctx.out / "conformance.json")
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(ROOT / "build/vllm"),
                                                        str(ROOT / "tests/fakes")]


def test_kernels_and_bench_run_as_make_test_gpu_and_make_bench(ctx):
    assert PARTS["kernels"].command(ctx) == [*PYTEST, "tests/kernels",
                                             f"--junitxml={ctx.out / 'kernels.xml'}"]
    gpu_path = os.pathsep.join([str(ROOT / "vllm_overlay"), str(ROOT / "tests/without_vllm"),
                                str(ROOT), "/site"])
    assert PARTS["kernels"].env(ctx)["PYTHONPATH"] == gpu_path
    assert PARTS["bench"].command(ctx) == ["/usr/bin/python3", str(ROOT / "scripts/run_bench.py"),
                                           "--out", str(ctx.out / "bench")]
    assert PARTS["bench"].env(ctx)["PYTHONPATH"] == gpu_path
    makefile = (ROOT / "Makefile").read_text()
    assert ("PYTHONPATH=vllm_overlay:tests/without_vllm:. $(GPU_PYTHON) -m pytest -q -p "
            "no:cacheprovider tests/kernels") in makefile
    assert "PYTHONPATH=vllm_overlay:tests/without_vllm:. $(GPU_PYTHON) scripts/run_bench.py" in makefile


def test_facts_compile_the_devices_own_target_without_the_interpreter(ctx):
    cmd = PARTS["facts"].command(ctx)
    assert cmd == ["/usr/bin/python3", "-m", "validate_rocm.device_facts", "--target", "gfx942",
                   "--out", str(ctx.out / "device-facts.json")]
    env = PARTS["facts"].env(ctx)
    assert env["TRITON_INTERPRET"] is None  # removed
    assert env["TRITON_ALWAYS_COMPILE"] == "1"
    assert env["TRITON_CACHE_DIR"] == str(ctx.out / "triton-cache")
    assert env["PYTHONPATH"].split(os.pathsep)[:3] == [str(ROOT / "vllm_overlay"),
                                                        str(ROOT / "tests/without_vllm"),
                                                        str(ROOT / "scripts")]
    assert [facts_target(a) for a in ("gfx942", "gfx950", "sm_90", "gfx90a", None)] == [
        "gfx942", "gfx950", "sm_90", None, None]


def test_e2e_command_parses_with_the_e2e_cli_and_stays_offline(ctx):
    cmd = PARTS["e2e"].command(ctx)
    assert cmd[:3] == ["/usr/bin/python3", str(ROOT / "scripts/e2e.py"), "all"]
    sys.path.insert(0, str(ROOT / "scripts"))
    from e2e.cli import build_parser

    args = build_parser().parse_args(cmd[2:])
    assert args.model == "/models/llama" and args.recipes == ["all"]
    assert (args.upstream, args.patched) == ("/opt/up/bin/python", "docker exec vllm python3")
    assert args.out == ctx.out / "e2e" and args.work == ctx.out / "e2e-work"
    assert args.env == ["HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"]
    assert PARTS["e2e"].env(ctx)["HF_HUB_OFFLINE"] == "1"


def test_junit_node_ids(tmp_path):
    from rocm_standin import junit as write_junit

    path = tmp_path / "j.xml"
    write_junit(path, [("tests.mla.test_mla_rope_fusion_aiter",
                        "test_real_aiter_op_matches_the_triton_kernel[fp8-False]", "failed"),
                       ("tests.kernels.test_triton_launch", "test_x", "skipped"),
                       ("tests.kernels.test_triton_launch.TestGroup", "test_y", "passed")])
    tests = junit.read(path, ROOT)
    assert [t["test"] for t in tests] == [
        "tests/mla/test_mla_rope_fusion_aiter.py::test_real_aiter_op_matches_the_triton_kernel[fp8-False]",
        "tests/kernels/test_triton_launch.py::test_x",
        "tests/kernels/test_triton_launch.py::TestGroup::test_y"]
    assert [t["outcome"] for t in tests] == ["failed", "skipped", "passed"]
    assert tests[0]["message"] == "assert 1 == 2"
    assert junit.summary(tests) == {"failed": 1, "skipped": 1, "passed": 1}


def test_bench_cases_beside_the_roofline_of_docs_roofline_amd():
    results = ROOT / "benchmarks/results/20261201-1039-nvidia-h200-98d223cb1f.json"
    rows = {(r["kernel"], r["case"]): r for r in bench_roofline.cases(results, "gfx942")}
    row = rows[("fetch_kv", "nhd_bf16_h1_d128_b16_4k")]
    # docs/roofline-amd.md: 4.0 MiB, MI300X bound 0.791 µs, MI355X 0.524 µs.
    assert row["bounds_us"] == {"MI300X": pytest.approx(0.7914, abs=1e-4),
                                "MI355X": pytest.approx(0.5243, abs=1e-4)}
    assert row["fraction_of_bound"] == pytest.approx(0.7914 / 3.56, abs=1e-3)
    assert row["vs_upstream"] == 1.408 and row["bound_device"] == "MI300X"
    assert "nhd_bf16_h1_d128_b16_4k" in (ROOT / "docs/roofline-amd.md").read_text()
    assert all(r["fraction_of_bound"] is None for r in bench_roofline.cases(results, "sm_90"))


def test_device_facts_compare_with_the_committed_target(tmp_path):
    from rocm_standin import device_facts as write_facts

    committed = json.loads((ROOT / "benchmarks/results/compile/gfx942.json").read_text())
    path = tmp_path / "f.json"
    write_facts(path, change=3)
    cmp = device_facts.compare(json.loads(path.read_text()), committed)
    assert cmp["cases"] == len(committed["records"]) and cmp["spills"] == [] and cmp["errors"] == []
    [diff] = cmp["differences"]
    rec = committed["records"][3]
    assert diff == {"case": f"{rec['kernel']}/{rec['case']}",
                    "committed_vs_here": {"vgpr_total": (rec["vgpr_total"], rec["vgpr_total"] + 1)}}
    device = json.loads(path.read_text())
    device["records"][0]["driver"]["n_spills"] = 4
    device["records"][1]["driver"]["waves_per_simd"] = 1
    cmp = device_facts.compare(device, committed)
    assert len(cmp["spills"]) == 1
    rec = committed["records"][1]
    assert cmp["occupancy_differs"] == [{"case": f"{rec['kernel']}/{rec['case']}",
                                         "facts": rec["waves_per_simd"], "runtime": 1}]
    from validate_rocm import claims

    verdict, detail = claims.check("facts:waves", {"facts": {"status": "passed", **cmp}})
    assert verdict == "failed" and detail.startswith("1 cases under 2 waves per SIMD")


def test_device_facts_refuses_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert device_facts.main(["--target", "gfx942", "--out", str(tmp_path / "x.json")]) == 2


def test_device_facts_compiles_a_case_as_the_compile_tier_does(tmp_path):
    """One gfx942 case compiled here (Triton's AMD backend works on the CPU); loading on a
    device is stood in for: the record carries the driver's numbers beside the facts."""
    script = textwrap.dedent("""
        import json, sys
        from compile_tier import cases
        from triton.compiler import CompiledKernel
        from validate_rocm import device_facts

        first = cases.build_specs
        cases.build_specs = lambda target: first(target)[:1]
        def init_handles(self):  # what the HIP driver sets when it loads the kernel
            self.n_regs, self.n_spills, self.n_max_threads = 32, 0, 1024
        CompiledKernel._init_handles = init_handles
        [rec] = device_facts.run("gfx942")
        json.dump(rec, sys.stdout)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "vllm_overlay"), str(ROOT / "tests/without_vllm"),
                                         str(ROOT / "scripts")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    committed = json.loads((ROOT / "benchmarks/results/compile/gfx942.json").read_text())
    ref = next(r for r in committed["records"] if (r["kernel"], r["case"]) == (rec["kernel"], rec["case"]))
    assert rec["driver"] == {"n_regs": 32, "n_spills": 0, "n_max_threads": 1024,
                             "occupancy_source": None}  # no HIP / CUDA runtime here
    for key in ("vgpr_total", "vgpr_spill", "scratch_bytes", "waves_per_simd"):
        assert isinstance(rec["facts"][key], int), key
    assert rec["facts"]["vgpr_spill"] == ref["vgpr_spill"] == 0
