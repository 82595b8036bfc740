"""Sweep configs: matrix expansion, stable cell keys, YAML = TOML, clear errors (no Ray)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from sweep import SweepError, cli  # noqa: E402
from sweep import config as sweep_config  # noqa: E402
from sweep.cells import run_cell  # noqa: E402

YAML = """
name: demo
installs:
  upstream: {python: /opt/up/bin/python}
  patched: {python: "docker exec vllm-patched python3", env: {VLLM_X: 1}}
defaults:
  gpus: 1
  env: {VLLM_ROCM_USE_AITER: "1"}
matrix:
  - kind: e2e
    recipe: throughput
    model: m
    axes:
      lengths: [{input_len: 2048, output_len: 16}, {input_len: 8192, output_len: 16}]
      install: [upstream, patched]
      env: [{}, {VLLM_ROCM_USE_AITER_MHA: "0"}]
  - kind: fake
    gpus: 0
    axes:
      size: [{size: 1, gpus: 0.5}, {size: 2}]
"""

TOML = """
name = "demo"
[installs.upstream]
python = "/opt/up/bin/python"
[installs.patched]
python = "docker exec vllm-patched python3"
env = {VLLM_X = 1}
[defaults]
gpus = 1
env = {VLLM_ROCM_USE_AITER = "1"}
[[matrix]]
kind = "e2e"
recipe = "throughput"
model = "m"
[matrix.axes]
lengths = [{input_len = 2048, output_len = 16}, {input_len = 8192, output_len = 16}]
install = ["upstream", "patched"]
env = [{}, {VLLM_ROCM_USE_AITER_MHA = "0"}]
[[matrix]]
kind = "fake"
gpus = 0
[matrix.axes]
size = [{size = 1, gpus = 0.5}, {size = 2}]
"""


def _load(tmp_path: Path, text: str, suffix: str = ".yaml") -> sweep_config.SweepConfig:
    path = tmp_path / f"demo{suffix}"
    path.write_text(text)
    return sweep_config.load(path)


def test_matrix_expands_axes_zipped_pairs_and_env(tmp_path):
    cfg = _load(tmp_path, YAML)
    e2e = [c for c in cfg.cells if c.kind == "e2e"]
    assert len(e2e) == 2 * 2 * 2 and len(cfg.cells) == 10
    first = e2e[0]
    assert first.params == {"recipe": "throughput", "model": "m", "input_len": 2048,
                            "output_len": 16}
    assert first.install == "upstream" and first.gpus == 1
    assert e2e[1].env == {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MHA": "0"}
    fake = [c for c in cfg.cells if c.kind == "fake"]
    assert [(c.params["size"], c.gpus) for c in fake] == [(1, 0.5), (2, 0)]
    assert cfg.installs["patched"].env == {"VLLM_X": "1"}
    assert len({c.key for c in cfg.cells}) == len(cfg.cells)


def test_keys_are_stable_and_yaml_equals_toml(tmp_path):
    yaml_cells = _load(tmp_path, YAML).cells
    toml_cells = _load(tmp_path, TOML, ".toml").cells
    assert [c.key for c in yaml_cells] == [c.key for c in toml_cells]
    # A key depends on what defines the result, not on dict order or timeouts.
    cell = yaml_cells[0]
    shuffled = sweep_config.Cell(kind=cell.kind, params=dict(reversed(cell.params.items())),
                                 install=cell.install, gpus=cell.gpus, timeout_s=1.0,
                                 env=dict(reversed(cell.env.items())))
    assert shuffled.key == cell.key
    assert json.loads(json.dumps(cell.identity)) == cell.identity


@pytest.mark.parametrize("text, message", [
    ("name: x\nmatrix:\n  - kind: nope\n", "kind must be one of"),
    ("name: x\nmatrix:\n  - kind: e2e\n    recipe: mixed\n    install: patched\n",
     "install 'patched' is not in `installs`"),
    ("name: x\nmatrix:\n  - kind: fake\n  - kind: fake\n", "is the same as"),
    ("name: x\nmatrix:\n  - kind: fake\n    gpus: -1\n", "gpus must be a number >= 0"),
    ("name: x\nmatrix:\n  - kind: fake\n    axes: {size: 3}\n", "must be a non-empty list"),
    ("name: x/y\nmatrix:\n  - kind: fake\n", "plain folder name"),
    ("name: x\nmatrx: []\n", "unknown top-level key"),
])
def test_config_errors_are_clear(tmp_path, text, message):
    with pytest.raises(SweepError, match=message):
        _load(tmp_path, text)


def test_list_verb_needs_no_ray(tmp_path, capsys):
    path = tmp_path / "demo.yaml"
    path.write_text(YAML)
    assert cli.main(["list", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "10 cell(s)" in out and out.count("todo") == 10


def _spec(kind: str, params: dict, install: dict | None = None, **extra) -> dict:
    cell = sweep_config.Cell(kind=kind, params=params, install=install and install["name"])
    return {"sweep": "t", "key": cell.key, "label": cell.label, "cell": cell.to_dict(),
            "series": {"commit": "abc"}, "install": install, **extra}


def test_kernel_cell_runs_the_bench_runner_and_keeps_its_cases(tmp_path):
    """A stand-in scripts/run_bench.py (the real one needs a GPU) writes a bench JSON."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run_bench.py").write_text(
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "assert sys.argv[sys.argv.index('-k') + 1] == 'fetch_kv'\n"
        "info = {'kernel': 'fetch_kv', 'case': 'h8', 'shapes': {}, 'nbytes': 1, 'graph': False,\n"
        "        'results': {'ours': {'us': 1.0}}, 'speedup': 2.0, 'frac_copy': 0.9}\n"
        "json.dump({'machine_info': {'series': {'device': 'stand-in', 'commit': 'unknown'}},\n"
        "           'benchmarks': [{'name': 't', 'group': 'fetch_kv', 'extra_info': info}]},\n"
        "          open(os.path.join(out, 'r.json'), 'w'))\n")
    record = run_cell(_spec("kernel", {"select": "fetch_kv", "python": sys.executable},
                            repo=str(tmp_path)))
    assert record["status"] == "ok", record.get("error")
    assert record["benchmarks"][0]["extra_info"]["speedup"] == 2.0
    assert record["metrics"] == {"cases": 1, "speedup_min": 2.0, "speedup_max": 2.0}
    # The driver's commit wins over the copied tree's "unknown"; the device comes from the run.
    assert record["machine_info"]["series"] == {"commit": "abc", "device": "stand-in"}


def test_e2e_cell_off_rocm_is_recorded_with_the_preflight_message(tmp_path):
    fake_torch = tmp_path / "site" / "torch"
    fake_torch.mkdir(parents=True)
    (fake_torch / "__init__.py").write_text("raise ImportError('no torch on this test path')\n")
    install = {"name": "patched", "python": f"env PYTHONPATH={tmp_path / 'site'} {sys.executable}",
               "env": {}}
    record = run_cell(_spec("e2e", {"recipe": "throughput", "model": "m"}, install=install))
    assert record["status"] == "error"
    message = record["error"]["message"]
    assert "e2e preflight failed" in message and "torch does not import" in message
    assert "nothing was run" in message


def test_e2e_cell_records_the_recipe_results(tmp_path, monkeypatch):
    """The e2e kind end to end with the preflight passed and a stand-in `vllm bench throughput`
    (writes vLLM 0.34.0's --output-json format; its numbers are fixtures)."""
    from e2e import preflight

    cli = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for pkg in (cli.parents[1], cli.parent, cli):
        (pkg / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import json, sys\n"
        "a = sys.argv[1:]\n"
        "json.dump({'requests_per_second': 3.0, 'tokens_per_second': 6000.0,\n"
        "           'elapsed_time': 1.0, 'num_requests': 3, 'total_num_tokens': 6000},\n"
        "          open(a[a.index('--output-json') + 1], 'w'))\n")
    monkeypatch.setattr(preflight, "check", lambda installs, envs, **kw: {
        "host": {}, "installs": {i.name: {"device": "Stand-in GPU"} for i in installs}})
    install = {"name": "patched", "python": f"env PYTHONPATH={tmp_path / 'site'} {sys.executable}",
               "env": {}}
    record = run_cell(_spec("e2e", {"recipe": "throughput", "model": "m", "input_len": 1024,
                                    "output_len": 16, "num_prompts": 3}, install=install))
    assert record["status"] == "ok", record.get("error")
    assert record["metrics"] == {"requests_per_second": 3.0, "tokens_per_second": 6000.0,
                                 "elapsed_time": 1.0, "num_requests": 3, "total_num_tokens": 6000}
    info = record["benchmarks"][0]["extra_info"]
    assert info["case"] == "1024/16" and info["env"]["VLLM_ROCM_USE_AITER"] == "1"
    assert record["machine_info"]["series"]["device"] == "Stand-in GPU"
