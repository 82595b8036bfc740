"""Recipe plumbing on CPU: commands, parsers, gates, the results JSON.

vLLM's tools are replaced by a stand-in ``vllm`` package on the install's PYTHONPATH that
writes files in vLLM 0.34.0's formats; the numbers are test fixtures, not measurements.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from e2e import mixed_batch, recipes  # noqa: E402
from e2e.installs import Install  # noqa: E402

STAND_IN_CLI = '''
import json, os, sys
args = sys.argv[1:]
with open(os.environ["STAND_IN_LOG"], "a") as fh:
    fh.write(json.dumps(args) + "\\n")
if os.environ.get("STAND_IN_FAIL"):
    print("RuntimeError: stand-in failure", flush=True)
    sys.exit(1)
assert args[:2] == ["bench", "throughput"], args
rate = float(os.environ["STAND_IN_RATE"])
n = int(args[args.index("--num-prompts") + 1])
def arg(flag):
    return args[args.index(flag) + 1]
total = n * (int(arg("--random-input-len")) + int(arg("--random-output-len")))
print(f"Throughput: {rate:.2f} requests/s, {rate * total / n:.2f} total tokens/s, "
      f"{rate * 4:.2f} output tokens/s")
json.dump({"model_id": "m", "elapsed_time": n / rate, "num_requests": n, "total_num_tokens": total,
           "requests_per_second": rate, "tokens_per_second": rate * total / n},
          open(args[args.index("--output-json") + 1], "w"))
'''


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for pkg in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (pkg / "__init__.py").write_text("")
    (cli / "main.py").write_text(STAND_IN_CLI)
    return site


def _install(name: str, site: Path, log: Path, rate: float, fail: bool = False) -> Install:
    env = {"STAND_IN_RATE": str(rate), "STAND_IN_LOG": str(log)}
    if fail:
        env["STAND_IN_FAIL"] = "1"
    return Install.parse(name, f"env PYTHONPATH={site} {sys.executable}", env)


PROBES = {"host": {"smi": "stand-in"},
          "installs": {"upstream": {"device": "Stand-in GPU", "hip": "7.0"},
                       "patched": {"device": "Stand-in GPU", "hip": "7.0"}}}


def test_throughput_recipe_writes_the_results_json(tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    log = tmp_path / "calls.jsonl"
    installs = [_install("upstream", stand_in, log, 2.0), _install("patched", stand_in, log, 2.5)]
    opts = recipes.Options(model="org/model", lengths=[(128, 4), (256, 8)], num_prompts=10,
                           engine_args=["--max-num-seqs", "8"])
    doc = recipes.run_recipe("throughput", installs, opts, out_dir=tmp_path / "out",
                             work_dir=tmp_path / "work", env={"VLLM_ROCM_USE_AITER_MHA": "0"},
                             probes=PROBES, echo=False)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4 and calls[0][:2] == ["bench", "throughput"]
    first = calls[0]
    for flag, value in (("--model", "org/model"), ("--random-input-len", "128"),
                        ("--random-output-len", "4"), ("--num-prompts", "10"),
                        ("--max-model-len", str(128 + 4 + recipes.MODEL_LEN_MARGIN)),
                        ("--dataset-name", "random"), ("--max-num-seqs", "8")):
        assert first[first.index(flag) + 1] == value
    saved = json.loads(Path(doc["path"]).read_text())
    assert saved["format"] == "e2e/1" and saved["recipe"] == "throughput"
    assert saved["machine_info"]["series"]["device"] == "Stand-in GPU"
    assert saved["failed"] is None
    cases = {(b["extra_info"]["case"], b["extra_info"]["install"]): b["extra_info"]
             for b in saved["benchmarks"]}
    assert set(cases) == {("128/4", "upstream"), ("128/4", "patched"), ("256/8", "upstream"),
                          ("256/8", "patched")}
    patched = cases[("128/4", "patched")]
    assert patched["results"]["requests_per_second"] == 2.5
    assert patched["results"]["output_tokens_per_second"] == 10.0
    assert patched["env"]["VLLM_ROCM_USE_AITER"] == "1"
    assert patched["env"]["VLLM_ROCM_USE_AITER_MHA"] == "0"
    assert patched["env"]["VLLM_API_KEY"] == "<redacted>"
    assert "s3cret" not in Path(doc["path"]).read_text()
    ratio = next(r for r in saved["comparison"]
                 if r["case"] == "128/4" and r["metric"] == "requests_per_second")
    assert ratio["ratio"] == pytest.approx(1.25)
    assert "| 128/4 | requests_per_second | 2 | 2.5 | 1.250 |" in recipes.summary_table(saved)


def test_cpu_mode_runs_the_same_path_and_labels_the_file(tmp_path, stand_in):
    """--device cpu: the same command and parser, the CPU's defaults, a "cpu" file name."""
    log = tmp_path / "calls.jsonl"
    installs = [_install("upstream", stand_in, log, 2.0), _install("patched", stand_in, log, 2.5)]
    opts = recipes.Options(model="tiny", device="cpu", lengths=[(64, 4)], num_prompts=4)
    probes = {"host": {}, "installs": {n: {"device": "CPU Stand-in (2 cores)"}
                                       for n in ("upstream", "patched")}}
    docs = [recipes.run_recipe("throughput", installs, opts, out_dir=tmp_path / "out",
                               work_dir=tmp_path / "work", probes=probes, echo=False)
            for _ in range(2)]
    names = [Path(d["path"]).name for d in docs]
    assert "-cpu-" in names[0] and names[0] != names[1]  # a second run in the minute: new name
    saved = json.loads(Path(docs[0]["path"]).read_text())
    assert saved["machine_info"]["series"]["device"] == "CPU Stand-in (2 cores)"
    assert saved["options"]["device"] == "cpu" and saved["failed"] is None
    assert "not performance data" in saved["note"]
    env = saved["benchmarks"][0]["extra_info"]["env"]
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and "VLLM_ROCM_USE_AITER" not in env
    assert json.loads(log.read_text().splitlines()[0])[:2] == ["bench", "throughput"]


def test_a_failing_install_is_recorded_and_the_other_still_runs(tmp_path, stand_in):
    log = tmp_path / "calls.jsonl"
    installs = [_install("upstream", stand_in, log, 2.0, fail=True),
                _install("patched", stand_in, log, 2.5)]
    doc = recipes.run_recipe("throughput", installs,
                             recipes.Options(model="m", lengths=[(64, 4)], num_prompts=4),
                             out_dir=tmp_path / "out", probes=PROBES, echo=False)
    up, pa = (b["extra_info"] for b in doc["benchmarks"])
    assert up["error"] == "exit 1: RuntimeError: stand-in failure" and up["results"] == {}
    assert pa["results"]["requests_per_second"] == 2.5
    assert doc["failed"] == ["throughput 64/4 upstream: exit 1: RuntimeError: stand-in failure"]
    assert Path(up["log"]).read_text().count("stand-in failure") == 1


def test_sweep_params_map_to_options():
    opts = recipes.options_from_params({"model": "m", "input_len": 2048, "output_len": 16,
                                        "concurrency": 8, "tp": 2})
    assert opts.lengths == [(2048, 16)] and opts.concurrency == [8] and opts.tp == 2
    with pytest.raises(recipes.RecipeError, match="unknown recipe option"):
        recipes.options_from_params({"model": "m", "prompt_len": 5})


def test_serve_and_lm_eval_parsers(tmp_path):
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"completed": 20, "failed": 0, "request_throughput": 1.5,
                                 "median_ttft_ms": 12.0, "p99_ttft_ms": 30.0, "ttfts": [0.1],
                                 "generated_texts": ["x"]}))
    assert recipes.parse_serve(serve) == {"completed": 20, "failed": 0, "request_throughput": 1.5,
                                          "median_ttft_ms": 12.0, "p99_ttft_ms": 30.0}
    out = tmp_path / "lm" / "org__model"
    out.mkdir(parents=True)
    (out / "results_2026-11-30T00-00-00.json").write_text(json.dumps({
        "results": {"gsm8k": {"exact_match,strict-match": 0.75,
                              "exact_match_stderr,strict-match": 0.012,
                              "exact_match,flexible-extract": 0.77,
                              "exact_match_stderr,flexible-extract": 0.011}},
        "n-samples": {"gsm8k": {"original": 1319, "effective": 1319}}}))
    assert recipes.parse_lm_eval(tmp_path / "lm") == {
        "exact_match,strict-match": 0.75, "exact_match_stderr,strict-match": 0.012,
        "exact_match,flexible-extract": 0.77, "exact_match_stderr,flexible-extract": 0.011,
        "samples": 1319}


def _gsm8k(install: str, acc: float, se: float = 0.01) -> dict:
    return {"extra_info": {"install": install, "case": "gsm8k-5shot", "results": {
        "exact_match,strict-match": acc, "exact_match_stderr,strict-match": se}}}


@pytest.mark.parametrize("upstream, patched, passed", [
    (0.80, 0.80, True), (0.80, 0.76, True), (0.80, 0.70, False)])
def test_gsm8k_gate_uses_the_combined_standard_error(upstream, patched, passed):
    gate = recipes.gsm8k_gate([_gsm8k("upstream", upstream), _gsm8k("patched", patched)], 3.0,
                              None)
    assert gate["passed"] is passed
    assert gate["tolerance"] == pytest.approx(3.0 * (2 * 0.01 ** 2) ** 0.5)
    only = recipes.gsm8k_gate([_gsm8k("patched", patched)], 3.0, 0.75)
    assert only["passed"] is (patched >= 0.75) and "upstream" not in only["rule"]


def test_mixed_verdicts():
    ref = {"needle_found": True, "requests": {"long": {"token_ids": [1, 2, 3, 4]},
                                              "fresh-0": {"token_ids": [5, 6]}}}
    good = {"needle_found": True, "mixed_steps": 3, "steps": [{}] * 8,
            "requests": {"long": {"token_ids": [1, 2, 3, 9]}, "fresh-0": {"token_ids": [5, 6]}}}
    result = recipes.compare_mixed(good, ref)
    assert result["verdict"] == "pass" and result["long_prompt_agreement"] == 0.75
    assert result["fresh_prompts_agreement_min"] == 1.0
    assert recipes.compare_mixed({**good, "needle_found": False}, ref)["verdict"] == "fail"
    assert recipes.compare_mixed({**good, "mixed_steps": 0}, ref)["verdict"] == "not-triggered"
    assert recipes.compare_mixed(good, {**ref, "needle_found": False})["verdict"] == "inconclusive"


def test_mixed_gate_in_cpu_mode_gates_on_the_tokens():
    def benches(patched: dict) -> list:
        up = {"verdict": "inconclusive", "mixed_steps": 2, "long_prompt_agreement": 1.0,
              "fresh_prompts_agreement_min": 1.0, "decoder_agreement": 1.0}
        return [{"extra_info": {"install": "upstream", "results": up}},
                {"extra_info": {"install": "patched", "results": {**up, **patched}}}]

    assert recipes.mixed_gate(benches({}), device="cpu")["passed"] is True
    assert recipes.mixed_gate(benches({"long_prompt_agreement": 0.5}), device="cpu")["passed"] \
        is False
    gate = recipes.mixed_gate(benches({"verdict": "not-triggered", "mixed_steps": 0}), device="cpu")
    assert gate["passed"] is None and gate["patched_verdict"] == "not-triggered"
    assert recipes.mixed_gate(benches({}))["passed"] is False  # ROCm: the needle verdict


def test_mixed_batch_helpers_need_no_vllm():
    kinds = mixed_batch.classify({"decoder": 1, "long": 2048, "fresh-0": 40},
                                 {"decoder": 30, "long": 4096, "fresh-0": 0},
                                 {"decoder": 20, "long": 12288, "fresh-0": 40})
    assert kinds == {"decoder": "decode", "long": "extend", "fresh-0": "prefill"}
    assert mixed_batch.is_mixed(kinds) and not mixed_batch.is_mixed({"a": "decode"})

    def encode(text, special):  # one token per character, a BOS when asked
        return ([0] if special else []) + [ord(c) for c in text]

    ids = mixed_batch.build_long_prompt(encode, 3000, "123456")
    assert len(ids) == 3000 and ids[0] == 0
    text = "".join(map(chr, ids[1:]))
    assert text.startswith("Remember this carefully: the secret code is 123456.")
    assert text.endswith("Answer: The secret code is")
    assert mixed_batch.parse_engine_args(["--max-num-seqs", "64", "--enforce-eager",
                                          "--kv-cache-dtype=fp8"]) == {
        "max_num_seqs": 64, "enforce_eager": True, "kv_cache_dtype": "fp8"}


class _StandInScheduler:
    """Chunked prefill as vLLM 0.34.0's scheduler does it: running requests first (prefills
    capped at the long-prefill threshold), then waiting ones, within the token budget."""

    def __init__(self, budget: int, threshold: int):
        self.budget, self.threshold = budget, threshold
        self.running: list[dict] = []
        self.waiting: list[dict] = []

    def schedule(self, *_args):
        from types import SimpleNamespace as NS

        budget, tokens, new, cached = self.budget, {}, [], ([], [])
        for req in self.running:
            left = req["plen"] - req["computed"]
            n = 1 if left <= 0 else min(left, self.threshold or left, budget)
            if n > 0:
                tokens[req["id"]] = n
                cached[0].append(req["id"])
                cached[1].append(req["computed"])
                budget -= n
        while self.waiting and budget > 0:
            req = self.waiting.pop(0)
            n = min(req["plen"], self.threshold or req["plen"], budget)
            tokens[req["id"]] = n
            new.append(NS(req_id=req["id"], num_computed_tokens=0))
            budget -= n
            self.running.append(req)
        return NS(num_scheduled_tokens=tokens, scheduled_new_reqs=new,
                  scheduled_cached_reqs=NS(req_ids=cached[0], num_computed_tokens=cached[1]),
                  total_num_scheduled_tokens=sum(tokens.values()))


def _stand_in_vllm():
    """A `vllm` module with just what mixed_batch.py touches; the 'model' answers with the
    six-digit number of the prompt it saw."""
    import itertools
    import re
    from types import ModuleType
    from types import SimpleNamespace as NS

    counter = itertools.count()

    def answer(ids, n):
        digits = re.findall(r"\d{6}", "".join(chr(i) for i in ids if i > 0))
        text = (f" {digits[0]}." if digits else " x") * n
        return text[:n]

    class Engine:
        def __init__(self, kw):
            self.sched = _StandInScheduler(kw["max_num_batched_tokens"],
                                           kw.get("long_prefill_token_threshold", 0))
            self.engine_core = NS(engine_core=NS(scheduler=self.sched))

        def add_request(self, rid, prompt, params):
            engine_id = f"{rid}-{next(counter):08x}"
            self.sched.waiting.append({"id": engine_id, "ext": rid, "plen": len(
                prompt["prompt_token_ids"]), "ids": prompt["prompt_token_ids"], "computed": 0,
                "out": [], "max": params.max_tokens})
            return engine_id

        def has_unfinished_requests(self):
            return bool(self.sched.running or self.sched.waiting)

        def step(self):
            out = self.engine_core.engine_core.scheduler.schedule(False)
            done = []
            for req in list(self.sched.running):
                if req["id"] not in out.num_scheduled_tokens:
                    continue
                req["computed"] += out.num_scheduled_tokens[req["id"]]
                if req["computed"] >= req["plen"]:
                    req["out"].append(ord(answer(req["ids"], req["max"])[len(req["out"])]))
                if len(req["out"]) >= req["max"]:
                    self.sched.running.remove(req)
                    done.append(NS(request_id=req["ext"], finished=True, outputs=[
                        NS(token_ids=req["out"], text="".join(map(chr, req["out"])))]))
            return done

    class LLM:
        def __init__(self, **kw):
            self.llm_engine = Engine(kw)

        def get_tokenizer(self):
            return NS(encode=lambda text, add_special_tokens: ([0] if add_special_tokens else [])
                      + [ord(c) for c in text])

        def generate(self, prompts, params, use_tqdm=False):
            ids = prompts[0]["prompt_token_ids"]
            text = answer(ids, params.max_tokens)
            return [NS(outputs=[NS(token_ids=[ord(c) for c in text], text=text)])]

    module = ModuleType("vllm")
    module.__version__ = "stand-in"
    module.LLM = LLM
    module.SamplingParams = lambda **kw: NS(**kw)
    return module


@pytest.mark.parametrize("mode", ["mixed", "reference"])
def test_mixed_batch_forms_decode_extend_prefill_steps(tmp_path, monkeypatch, mode):
    monkeypatch.setitem(sys.modules, "vllm", _stand_in_vllm())
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    out = tmp_path / f"{mode}.json"
    assert mixed_batch.main(["--model", "m", "--mode", mode, "--out", str(out),
                             "--long-prompt-len", "6000", "--chunk", "1024",
                             "--max-num-batched-tokens", "2048", "--fresh-prompts", "3"]) == 0
    result = json.loads(out.read_text())
    assert result["needle_found"] and set(result["requests"]) == {
        "decoder", "long", "fresh-0", "fresh-1", "fresh-2"}
    assert result["requests"]["long"]["prompt_len"] == 6000
    if mode == "reference":
        assert result["mixed_steps"] == 0 and result["steps"] == []
        return
    assert result["mixed_steps"] >= 3
    first = result["steps"][result["first_mixed_step"]]
    assert first["kinds"] == {"decoder": "decode", "long": "extend", "fresh-0": "prefill"}
    assert first["tokens"]["long"] == 1024
