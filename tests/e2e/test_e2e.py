"""scripts/e2e.py here: the preflight with real Pythons, the recipes with stand-in installs
(e2e_standin.py), the gates, and the parts of mixed_batch.py that need no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import e2e  # noqa: E402
import e2e_standin  # noqa: E402
import mixed_batch  # noqa: E402


def _e2e(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "e2e.py"), "--out", str(out),
                           "--work", str(tmp_path / "work"), *args],
                          capture_output=True, text=True, timeout=300)
    docs = [json.loads(p.read_text()) for p in out.glob("*.json")]
    return proc, {doc["recipe"]: doc for doc in docs}


def test_preflight_fails_fast_off_rocm_and_names_every_problem(tmp_path):
    """Through scripts/e2e.py and then `make e2e`: exit 2, every problem, nothing written."""
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text("raise ImportError('no torch')\n")
    proc, docs = _e2e(tmp_path, "gsm8k", "--model", "m",
                      "--upstream", f"env -u PYTHONPATH {sys.executable}",
                      "--patched", f"env PYTHONPATH={tmp_path / 'site'} {sys.executable}")
    err = proc.stderr
    assert proc.returncode == 2 and "e2e preflight failed" in err and "nothing was run" in err
    assert "upstream (`env -u PYTHONPATH" in err and "vllm is not installed" in err
    assert "lm_eval is not installed" in err and "import aiter failed (ModuleNotFoundError" in err
    assert "patched (`env PYTHONPATH=" in err and "torch does not import (ImportError" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    make = subprocess.run(["make", "e2e", "RECIPES=mixed", "MODEL=m", "UPSTREAM=python3",
                           "PATCHED=/no/such/python"], cwd=REPO, capture_output=True, text=True)
    assert make.returncode == 2 and "/no/such/python" in make.stderr


def test_recipes_measure_both_installs_compare_and_gate(tmp_path):
    proc, docs = _e2e(tmp_path, "throughput", "serve", "gsm8k", "--model", "org/model",
                      "--upstream", e2e_standin.install(tmp_path, rate=2.0, acc=0.80),
                      "--patched", e2e_standin.install(tmp_path, rate=2.5, acc=0.76),
                      "--lengths", "128/4", "--num-prompts", "10", "--concurrency", "4",
                      "--env", "VLLM_API_KEY=s3cret", "--env", "HF_HUB_OFFLINE=1",
                      "--", "--max-num-seqs", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(docs) == {"throughput", "serve", "gsm8k"}
    assert docs["throughput"]["machine_info"]["series"]["device"] == "Stand-in MI300X"
    command = docs["throughput"]["benchmarks"][0]["extra_info"]["command"]
    assert "--max-model-len 196 " in command and command.endswith("--max-num-seqs 8")
    assert "VLLM_ROCM_USE_AITER=1" in command.split() and "s3cret" not in json.dumps(docs)
    assert "HF_HUB_OFFLINE=1" in command.split()  # reaches a `docker exec` install too
    ratios = {(r["case"], r["metric"]): r["ratio"] for d in docs.values() for r in d["comparison"]}
    assert ratios[("128/4", "requests_per_second")] == pytest.approx(1.25)
    assert ratios[("c4", "request_throughput")] == pytest.approx(1.25)
    assert ratios[("c4", "median_ttft_ms")] == pytest.approx(0.8)
    serve = docs["serve"]["benchmarks"][0]["extra_info"]["results"]
    assert serve["completed"] == 32 and "ttfts" not in serve  # max(32, 5 x 4) prompts
    assert docs["gsm8k"]["gate"]["passed"] is True  # 0.76 >= 0.80 - 3 x sqrt(2) x 0.01


def test_a_failed_run_and_a_failed_gate_are_recorded(tmp_path):
    proc, docs = _e2e(tmp_path, "throughput", "gsm8k", "--model", "m", "--lengths", "64/4",
                      "--upstream", e2e_standin.install(tmp_path, rate=2, acc=0.8, fail=True),
                      "--patched", e2e_standin.install(tmp_path, rate=2.5, acc=0.75))
    assert proc.returncode == 1
    up, pa = (run["extra_info"] for run in docs["throughput"]["benchmarks"])
    assert up["error"] == "RuntimeError: exit 1: RuntimeError: stand-in failure"
    assert up["results"] == {} and pa["results"]["requests_per_second"] == 2.5
    assert docs["throughput"]["failed"] == [f"throughput 64/4 upstream: {up['error']}"]
    assert docs["gsm8k"]["failed"] == [  # 0.75 < 0.80 - 0.0424
        "gate failed: patched >= upstream - 3 x combined stderr (0.0424)"]


def test_mixed_batch_verdict_steps_needle_prompt_and_the_gate():
    cases = [(3, True, True), (3, True, False), (0, True, True), (3, False, False)]
    assert [mixed_batch.verdict(*case) for case in cases] == [  # mixed steps, needle found in
        "pass", "fail", "not-triggered", "inconclusive"]        # the reference, in the answer
    runs = [{"extra_info": {"install": "upstream", "results": {"verdict": "fail"}}},
            {"extra_info": {"install": "patched", "results": {"verdict": "pass"}}}]
    assert e2e.gate("mixed", runs)["passed"] is True  # upstream's verdict is not gated
    runs[1]["extra_info"]["results"] = {}  # the patched run failed
    assert e2e.gate("mixed", runs)["passed"] is False
    step = SimpleNamespace(  # vLLM 0.34.0's SchedulerOutput fields that step_kinds reads
        num_scheduled_tokens={"decoder": 1, "long": 2048, "fresh-0": 40},
        scheduled_new_reqs=[SimpleNamespace(req_id="fresh-0", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["decoder", "long"],
                                              num_computed_tokens=[30, 4096]))
    assert mixed_batch.step_kinds(step, {"decoder": 20, "long": 12288, "fresh-0": 40}) == {
        "decoder": "decode", "long": "extend", "fresh-0": "prefill"}
    ids = mixed_batch.build_long_prompt(lambda text, bos: [0] * bos + [ord(c) for c in text],
                                        3000, "123456")
    text = "".join(map(chr, ids[1:]))
    assert len(ids) == 3000 and ids[0] == 0
    assert text.startswith("Remember this carefully: the secret code is 123456.")
    assert text.endswith("Answer: The secret code is")
    assert mixed_batch.parse_engine_args(["--max-num-seqs", "64", "--enforce-eager",
                                          "--kv-cache-dtype=fp8"]) == {
        "max_num_seqs": 64, "enforce_eager": True, "kv_cache_dtype": "fp8"}
