"""A stand-in ROCm install: torch (HIP, one GPU), aiter, vllm's CLI and lm_eval writing vLLM
0.34.0's / lm_eval's files with STANDIN_RATE (requests/s), STANDIN_ACC (gsm8k); STANDIN_FAIL=1:
the vllm tools fail."""

import sys
from pathlib import Path

FILES = {
    "torch/__init__.py": """
from types import SimpleNamespace
__version__ = "2.9.0+rocm7.0"
version = SimpleNamespace(hip="7.0")
cuda = SimpleNamespace(device_count=lambda: 1, get_device_name=lambda i: "Stand-in MI300X")
""",
    "aiter/__init__.py": "__version__ = '0.1.28.post1'\n",
    **{f"{pkg}/__init__.py": "" for pkg in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli")},
    "vllm/entrypoints/cli/main.py": """
import json, os, sys, time
args = sys.argv[1:]
arg = lambda flag: args[args.index(flag) + 1]
if os.environ.get("STANDIN_FAIL"):
    sys.exit("RuntimeError: stand-in failure")
rate = float(os.environ["STANDIN_RATE"])
if args[:2] == ["bench", "throughput"]:
    json.dump({"requests_per_second": rate, "num_requests": int(arg("--num-prompts"))},
              open(arg("--output-json"), "w"))
elif args[:2] == ["bench", "serve"]:
    json.dump({"completed": int(arg("--num-prompts")), "request_throughput": rate,
               "median_ttft_ms": 10 / rate, "ttfts": [0.1]},
              open(os.path.join(arg("--result-dir"), arg("--result-filename")), "w"))
elif args[0] == "serve":
    time.sleep(600)  # the server, until stopped
""",
    "lm_eval/__init__.py": "",
    "lm_eval/__main__.py": """
import json, os, sys
out = os.path.join(sys.argv[sys.argv.index("--output_path") + 1], "org__model")
os.makedirs(out)
json.dump({"results": {"gsm8k": {"exact_match,strict-match": float(os.environ["STANDIN_ACC"]),
                                 "exact_match_stderr,strict-match": 0.01}}},
          open(os.path.join(out, "results_2026-12-01T00-00-00.json"), "w"))
""",
}


def install(tmp: Path, rate: float, acc: float, fail: bool = False) -> str:
    """The command running a stand-in install's Python (``env ... python``)."""
    site = tmp / f"site-{rate}-{acc}"
    for name, text in FILES.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    flags = " STANDIN_FAIL=1" if fail else ""
    return f"env PYTHONPATH={site} STANDIN_RATE={rate} STANDIN_ACC={acc}{flags} {sys.executable}"
