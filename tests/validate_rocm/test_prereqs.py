"""validate-rocm's prerequisites: what each part needs, one line per missing thing."""

from __future__ import annotations

import pytest
from rocm_standin import H200, MI300X, ROOT
from seriestool.pins import load_pins
from validate_rocm import prereqs
from validate_rocm.parts import ORDER


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def opts(**kw):
    return prereqs.Options(root=ROOT, pins=load_pins(ROOT), **kw)


def test_the_pinned_stack_runs_every_part(model):
    o = opts(model=model, upstream="/opt/up/bin/python", patched="python3")
    assert prereqs.plan(list(ORDER), MI300X, o) == (list(ORDER), {}, [])


@pytest.mark.parametrize("change, part, words", [
    ({"torch": "2.13.0+cpu", "hip": None, "gpu_count": 0, "arch": None}, "rocm-tests",
     ["torch 2.13.0+cpu is not a ROCm build", "make image"]),
    ({"torch": None, "torch_error": "ModuleNotFoundError: No module named 'torch'"}, "kernels",
     ["torch does not import (ModuleNotFoundError", "make image"]),
    ({"gpu_count": 0, "device": None, "arch": None}, "kernels",
     ["no GPU visible to torch 2.9.0+rocm7.0", "--device /dev/kfd"]),
    ({"arch": None}, "conformance", ["reports no gfx arch"]),
    ({"aiter": None, "aiter_error": "ModuleNotFoundError: No module named 'aiter'"},
     "conformance", ["AITER does not import (ModuleNotFoundError",
                     "AITER v0.1.28.post1 (pins.env AITER_REF)", "make image",
                     "https://github.com/ROCm/aiter.git at v0.1.28.post1"]),
    ({"aiter": "0.1.20.dev46+ge4048607"}, "rocm-tests",
     ["AITER 0.1.20.dev46+ge4048607 is not the pinned v0.1.28.post1"]),
    ({"aiter": "0.1.26"}, "rocm-tests", ["AITER 0.1.26 is not the pinned v0.1.28.post1"]),
    ({"aiter": "0.1.280"}, "rocm-tests", ["is not the pinned v0.1.28.post1"]),
    ({"triton": "3.6.0"}, "kernels", ["Triton 3.6.0 is not the pinned 3.8.x (pins.env TRITON_VERSION=3.8.0)"]),
    ({"tree": False}, "conformance", ["build/vllm (the patched tree) is missing: run `make apply`"]),
    ({"pytest": None, "pytest_error": "ModuleNotFoundError"}, "kernels", ["pip install pytest"]),
    ({"pytest_benchmark": None}, "bench", ["pip install pytest-benchmark"]),
])
def test_each_missing_thing_is_one_line_saying_how_to_get_it(change, part, words):
    run, skipped, missing = prereqs.plan([part], {**MI300X, **change}, opts())
    assert run == [] and skipped == {}
    assert len(missing) == 1, missing
    for w in words:
        assert w in missing[0]


def test_accepted_pins_with_local_build_suffixes():
    env = {**MI300X, "aiter": "0.1.28.post1+rocm7.0", "triton": "3.8.1+rocm"}
    assert prereqs.plan(["rocm-tests"], env, opts())[2] == []


def test_e2e_needs_a_local_model_and_both_installs(tmp_path):
    _, _, missing = prereqs.plan(["e2e"], MI300X, opts())
    assert len(missing) == 2
    assert missing[0].startswith("MODEL= is not given") and "never downloads" in missing[0]
    assert missing[1].startswith("UPSTREAM= and PATCHED= not given")
    _, _, missing = prereqs.plan(["e2e"], MI300X, opts(model="meta-llama/Llama-3.1-8B",
                                                     upstream="a", patched="b"))
    assert missing == ["MODEL=meta-llama/Llama-3.1-8B is not a local model directory (no "
                       "config.json there); the e2e part never downloads"]


def test_shared_problems_are_listed_once():
    env = {**MI300X, "torch": "2.13.0+cpu", "hip": None}
    _, _, missing = prereqs.plan(["rocm-tests", "conformance"], env, opts())
    assert len(missing) == 1


def test_allow_cuda_skips_the_rocm_parts_with_a_reason_and_runs_the_rest():
    run, skipped, missing = prereqs.plan(list(ORDER), H200, opts(allow_cuda=True))
    assert run == ["kernels", "facts", "bench"] and missing == []
    assert set(skipped) == {"rocm-tests", "conformance", "e2e"}
    assert all("skipped under ALLOW_CUDA on NVIDIA H200 (sm_90)" in r for r in skipped.values())
    # Without ALLOW_CUDA the same machine is refused, and says why.
    _, _, missing = prereqs.plan(["kernels"], H200, opts())
    assert missing == ["Triton 3.6.0 is not the pinned 3.8.x (pins.env TRITON_VERSION=3.8.0): "
                       "ROCm Triton 3.8; the ROCm image has it: `make image` (ci/Dockerfile.rocm), "
                       "then run inside the container"]


def test_allow_cuda_without_a_gpu_still_refuses():
    cpu = {**H200, "gpu_count": 0, "device": None, "arch": None}
    run, skipped, missing = prereqs.plan(["kernels", "rocm-tests"], cpu, opts(allow_cuda=True))
    assert run == [] and skipped == {}
    assert any(m.startswith("no GPU visible") for m in missing)


# Where the series cites AITER's source: each names the ref it was read at and
# the pinned AITER_REF, so a pin bump fails here until the citations are re-checked.
AITER_SOURCE_READ = "e4048607"
AITER_CITATIONS = ["docs/aiter-calls.md", "docs/aiter-calls-fa.md", "docs/rocm.md",
                   "tests/fakes/aiter_fa.py", "tests/fakes/aiter_mla.py",
                   "tests/fakes/aiter_export.py", "benchmarks/notes/paged_context.md"]


@pytest.mark.parametrize("path", AITER_CITATIONS)
def test_aiter_citations_name_the_ref_read_and_the_pinned_ref(path):
    text = " ".join((ROOT / path).read_text(encoding="utf-8").split())
    pin = load_pins(ROOT)["AITER_REF"]
    assert AITER_SOURCE_READ in text, f"{path} does not say which AITER ref it was read at"
    assert pin in text, f"{path} does not name the pinned AITER {pin} (re-check its citations)"


def test_the_fakes_claim_names_the_pinned_aiter():
    from validate_rocm import claims

    claim = next(c for c in claims.load() if c["id"] == "fakes-read-memory-as-aiter")
    assert load_pins(ROOT)["AITER_REF"] in claim["claim"]
