"""A stand-in ROCm platform for the kit's CPU-tier tests: the facts
``validate_rocm.environment.probe`` would report on an MI300X with the pinned
stack (and on the lead's H200), and the stub outputs of the heavy parts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

MI300X = {
    "python": sys.executable, "python_version": "3.12.3", "host": "mi300x-node",
    "torch": "2.9.0+rocm7.0", "torch_error": None, "hip": "7.0.51831", "cuda": None,
    "gpu_count": 8, "device": "AMD Instinct MI300X", "arch": "gfx942",
    "triton": "3.8.0", "triton_error": None, "aiter": "0.1.28.post1", "aiter_error": None,
    "pytest": "8.4.2", "pytest_error": None, "pytest_benchmark": "5.2.0",
    "pytest_benchmark_error": None, "tree": True, "rocm_smi": "amd-smi",
    "commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False,
}
H200 = {**MI300X, "host": "h200", "torch": "2.11.0+cu130", "hip": None, "cuda": "13.0",
        "gpu_count": 1, "device": "NVIDIA H200", "arch": "sm_90", "triton": "3.6.0",
        "aiter": None, "aiter_error": "ModuleNotFoundError: No module named 'aiter'",
        "tree": False}


def junit(path: Path, cases: list[tuple[str, str, str]]) -> None:
    """A --junitxml file: (classname, name, outcome) per test."""
    rows = []
    for classname, name, outcome in cases:
        inner = {"passed": "", "failed": '<failure message="assert 1 == 2">x</failure>',
                 "skipped": '<skipped message="needs ROCm with AITER"/>'}[outcome]
        rows.append(f'<testcase classname="{classname}" name="{name}" time="0.1">{inner}</testcase>')
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                    + "".join(rows) + "</testsuite></testsuites>")


def device_facts(path: Path, target: str = "gfx942", change: int | None = None) -> None:
    """What validate_rocm.device_facts writes: the committed facts, the driver's
    registers; ``change``: that record compiles to one more VGPR here."""
    committed = json.loads((ROOT / "benchmarks/results/compile" / f"{target}.json").read_text())
    records = []
    for i, r in enumerate(committed["records"]):
        facts = {k: v for k, v in r.items() if k not in ("kernel", "case", "config", "key")}
        if i == change:
            facts["vgpr_total"] += 1
        records.append({"kernel": r["kernel"], "case": r["case"], "config": r["config"],
                        "facts": facts, "driver": {"n_regs": facts.get("vgpr_total", 0),
                                                   "n_spills": 0, "n_max_threads": 256}})
    path.write_text(json.dumps({"target": target, "triton": "3.8.0", "device": "MI300X",
                                "records": records}))


def bench(folder: Path, paged_speedup: float = 1.2) -> None:
    folder.mkdir(parents=True, exist_ok=True)

    def case(kernel, name, nbytes, us, speedup, shapes=None):
        return {"extra_info": {"kernel": kernel, "case": name, "nbytes": nbytes,
                               "shapes": shapes or {}, "speedup": speedup,
                               "results": {"ours": {"us": us}, "baseline": {"us": us * speedup}}}}

    paged = {"requests": 1, "new_tokens": 128, "num_heads": 32, "head_size": 128,
             "context_flops": 4 * 32 * 128 * 128 * 8192}
    doc = {"benchmarks": [
        case("fetch_kv", "nhd_bf16_h1_d128_b16_4k", 4194304, 1.582, 1.9),
        case("paged_context", "r1_ctx8k_new128", 64 << 20, 40.0, paged_speedup, paged),
        case("host_cost_fa", "fetch_kv", None, 11.0, 2.0),
    ]}
    (folder / "20261202-0900-amd-instinct-mi300x-0123456789.json").write_text(json.dumps(doc))


def e2e(folder: Path, gate: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for recipe in ("throughput", "mixed", "serve", "gsm8k"):
        doc = {"format": "e2e/1", "recipe": recipe, "failed": [],
               "gate": {"passed": gate, "rule": "3 sigma"} if recipe == "gsm8k" else None,
               "comparison": [{"case": "2048/16", "metric": "tokens_per_s", "upstream": 100.0,
                               "patched": 120.0, "ratio": 1.2}]}
        (folder / f"20261202-0900-mi300x-0123456789-{recipe}.json").write_text(json.dumps(doc))
