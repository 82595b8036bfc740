"""The fake-conformance harness (tests/fakes/conformance.py) on the CPU tier.

Real AITER is replaced by a stand-in (tests/validate_rocm/standins.py): a
second copy of the fakes, which must agree call for call, or a copy with two
fakes made to disagree, which must be reported by name with the call that
showed it.  The plugin itself runs once in a pytest subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import conformance
import fake_aiter
import standins
from aiter_mla import AiterCheckError
from conformance import Harness, Rule, compare_tensor

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def harness_with(request):
    """(reference) -> a patched Harness; the fakes installed after it are wrapped."""
    made = []

    def make(reference):
        h = Harness(reference).patch()
        made.append(h)
        return h

    yield make
    for h in made:
        h.unpatch()


def _install(arch=standins.ARCH):
    return fake_aiter.install(arch)


def _mla(**over):
    import aiter

    args = {**standins.mla_inputs(), **over}
    aiter.fused_qk_rope_concat_and_cache_mla(*args.values())
    return args


def _varlen(**kw):
    import aiter

    return aiter.flash_attn_varlen_func(**standins.varlen_inputs(), causal=True, **kw)


def test_identical_stand_in_agrees_on_accepts_refusals_and_outputs(harness_with):
    h = harness_with(standins.identical())
    fake = _install()
    try:
        args = _mla()
        assert args["kv_cache"].abs().sum() > 0  # the fake ran for the test as always
        with pytest.raises(AiterCheckError, match="not supported"):
            _mla(kv_cache=torch.zeros(4, 4, 24, dtype=torch.float64))
        out, lse = _varlen(return_lse=True)
        assert out.shape == (8, 4, 32) and lse.shape == (4, 8)
    finally:
        fake.uninstall()
    report = h.report()
    assert report["disagreeing"] == [] and report["disagreements"] == []
    mla = report["fakes"]["fused_qk_rope_concat_and_cache_mla"]
    assert mla["compared"] == mla["agreed"] == 2
    # The varlen ops under flash_attn_varlen_func are not compared a second time.
    assert report["fakes"]["flash_attn_varlen_func"]["agreed"] == 1
    assert "mha_varlen_fwd" not in report["fakes"]


def test_disagreeing_fakes_are_reported_by_name_with_their_call(harness_with):
    h = harness_with(standins.disagreeing())
    fake = _install()
    try:
        with pytest.raises(AiterCheckError):  # the test still sees the fake's refusal
            _mla(kv_cache=torch.zeros(4, 4, 24, dtype=torch.float64))
        _mla()
        _varlen()
    finally:
        fake.uninstall()
    report = h.report()
    assert report["disagreeing"] == ["flash_attn_varlen_func", "fused_qk_rope_concat_and_cache_mla"]
    by_fake = {d["fake"]: d for d in report["disagreements"]}
    mla = by_fake["fused_qk_rope_concat_and_cache_mla"]
    assert "the fake refuses (AiterCheckError: kv cache data type is not supported" in mla["problem"]
    assert "a call AITER accepts" in mla["problem"]
    assert mla["call"]["kv_cache"] == "Tensor(4, 4, 24) float64 stride=(96, 24, 1) on cpu"
    assert mla["test"].endswith("test_disagreeing_fakes_are_reported_by_name_with_their_call")
    assert report["fakes"]["fused_qk_rope_concat_and_cache_mla"]["agreed"] == 1  # the good call
    fa = by_fake["flash_attn_varlen_func"]
    assert fa["problem"].startswith("result: error") and "exceeds 4 u" in fa["problem"]
    assert fa["function"] == "aiter.flash_attn_varlen_func"


def test_other_arch_compared_only_without_fp8_and_not_modelled_counted(harness_with):
    h = harness_with(standins.identical())  # a gfx942 device
    fake = _install("gfx950")
    try:
        _varlen()  # fp16: the arch does not matter
        args = standins.mla_inputs()
        args["kv_cache"] = args["kv_cache"].to(torch.float8_e4m3fn)  # gfx950's fp8
        _mla(kv_cache=args["kv_cache"])
    finally:
        fake.uninstall()
    fake = _install()
    try:
        with pytest.raises(NotImplementedError, match="fake:"):
            _varlen(alibi_slopes=torch.zeros(4))
    finally:
        fake.uninstall()
    report = h.report()["fakes"]
    fa = report["flash_attn_varlen_func"]
    assert (fa["compared_other_arch"], fa["agreed"], fa["not_modelled"]) == (1, 1, 1)
    mla = report["fused_qk_rope_concat_and_cache_mla"]
    assert (mla["not_compared_arch"], mla["compared"]) == (1, 0)


def test_clone_keeps_aliasing_and_strides():
    base = torch.arange(24.0).view(2, 12)
    k, v = base[:, :6], base[:, 6:]
    ck, cv = conformance._clone((k, v), {}, torch.device("cpu"))
    assert ck.untyped_storage().data_ptr() == cv.untyped_storage().data_ptr()
    assert ck.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert (ck.stride(), cv.storage_offset()) == (k.stride(), 6)
    assert torch.equal(ck, k) and torch.equal(cv, v)


def test_compare_tensor_rules():
    exact = Rule()
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    b = a.clone()
    b[1] = 2.015625  # one bf16 ulp (2**-6) above 2.0
    assert compare_tensor(a, a.clone(), exact, {}, False) == (None, 0.0)
    problem, worst = compare_tensor(a, b, exact, {}, False)
    assert "1 elements beyond 0 ulp" in problem and worst == 1
    assert compare_tensor(a, b, Rule(ulps=1), {}, False) == (None, 1.0)
    # fp8 bytes in a uint8 cache: ulps over the bit patterns, signs handled.
    fp8 = torch.tensor([0.5, -0.5, 1.0], dtype=torch.float8_e4m3fn).view(torch.uint8)
    off = fp8.clone()
    off[1] += 1  # -0.5 -> the next fp8 magnitude, still negative
    assert compare_tensor(fp8, off, Rule(ulps=1), {}, False)[0] is None
    assert "beyond 0 ulp" in compare_tensor(fp8, off, exact, {}, False)[0]
    # Integers: exact, whatever the rule.
    assert compare_tensor(torch.tensor([1, 2]), torch.tensor([1, 3]), Rule(ulps=5), {},
                          False)[0] == "1 of 2 elements differ"
    # Attention: relative bound in u; NaN the fake left in a tensor it allocated is skipped.
    f = torch.tensor([1.0, float("nan")], dtype=torch.float16)
    r = torch.tensor([1.0 + 2**-10, 7.0], dtype=torch.float16)
    assert compare_tensor(f, r, Rule(rel=4.0), {}, True)[0] is None
    assert "exceeds" in compare_tensor(f, r, Rule(rel=0.5), {}, True)[0]
    # The copied columns of an MLA row must be bit-exact even where ulps are allowed.
    row = torch.zeros(2, 6)
    off = row.clone()
    off[0, 1] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    named = {"kv_c": torch.zeros(2, 4), "k_pe": torch.zeros(2, 2), "is_nope_first": True}
    rule = conformance.RULES["fused_qk_rope_concat_and_cache_mla"]
    assert "copied elements not bit-exact" in compare_tensor(row, off, rule, named, False)[0]
    off = row.clone()
    off[0, 5] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))  # a RoPE column: 1 ulp
    assert compare_tensor(row, off, rule, named, False)[0] is None


def test_plugin_writes_the_disagreements_of_a_pytest_run(tmp_path):
    """``-p conformance`` as make validate-rocm runs it, against the disagreeing stand-in."""
    (tmp_path / "test_uses_fakes.py").write_text(textwrap.dedent("""
        import pytest, torch, fake_aiter, standins
        from aiter_mla import AiterCheckError

        def test_mla_refusal():
            fake = fake_aiter.install(standins.ARCH)
            try:
                import aiter
                args = {**standins.mla_inputs(), "kv_cache": torch.zeros(4, 4, 24, dtype=torch.float64)}
                with pytest.raises(AiterCheckError):
                    aiter.fused_qk_rope_concat_and_cache_mla(*args.values())
            finally:
                fake.uninstall()
    """))
    out = tmp_path / "conformance.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fakes"),
                                                        str(Path(__file__).parent)]),
           conformance.ENV: str(out), conformance.REFERENCE_ENV: "standins:disagreeing"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conformance", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_uses_fakes.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "disagreeing: fused_qk_rope_concat_and_cache_mla" in proc.stdout
    report = json.loads(out.read_text())
    assert report["reference"] == "stand-in" and report["arch"] == "gfx942"
    [d] = report["disagreements"]
    assert d["fake"] == "fused_qk_rope_concat_and_cache_mla"
    assert d["test"] == "test_uses_fakes.py::test_mla_refusal"


def test_the_fa_fakes_own_tests_pass_under_the_plugin_and_agree_with_a_copy(tmp_path):
    """tests/aiter_fa/test_aiter_fa_fakes.py as the conformance part runs it: the wrapping
    keeps every export check true (identity, signatures, schemas) and a copy of the fakes
    agrees with them call for call."""
    out = tmp_path / "conformance.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fakes"),
                                                        str(Path(__file__).parent)]),
           conformance.ENV: str(out), conformance.REFERENCE_ENV: "standins:identical_gfx950"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conformance", "tests/aiter_fa/test_aiter_fa_fakes.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["disagreeing"] == []
    assert sum(e["compared"] for e in report["fakes"].values()) >= 50
    assert {"flash_attn_varlen_func", "unified_attention", "paged_attention_v1"} <= set(report["fakes"])
