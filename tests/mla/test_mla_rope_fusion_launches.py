"""The step's launches: a step's first layer of a geometry checks its tensors
and builds the kernel's launch (a ``KernelCall``) into the step's rows; the
step's other layers of that geometry launch it with their own tensors and
build nothing; a layer of another geometry is checked (clear errors before
any launch) and gets its own."""

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

from vllm.model_executor.layers.attention import mla_rope_kv_cache as kvc
from vllm.v1.attention.ops import triton_mla_rope_cache as mla

T, H, L, R, MAX_POS = 3, 2, 32, 16, 16


def _layer(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        ql_nope=torch.randn(T, H, L, generator=g),
        q_pe=torch.randn(T, H, R, generator=g),
        kv_c=torch.randn(T, L, generator=g),
        k_pe=torch.randn(T, R, generator=g),
        kv_cache=torch.zeros(4, 4, L + R),
        cos_sin_cache=torch.rand(MAX_POS, R, generator=g),
        q_out=torch.empty(T, H, L + R),
    )


def _rows():
    positions = torch.tensor([3, 5, 9, 1, 2])
    slots = torch.tensor([1, 2, 3, 4, -1])
    return kvc.build_mla_rope_step_rows(positions, slots, T, 5)


@pytest.fixture
def built(monkeypatch):
    """Counts the launches built."""
    count = []
    real = mla.KernelCall

    def counting(*args, **kwargs):
        count.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(mla, "KernelCall", counting)
    return count


def _decode(x: dict, rows, launches):
    return mla.mla_rope_concat_and_cache(
        x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"], x["kv_cache"],
        rows.slot_mapping, rows.positions, x["cos_sin_cache"], False,
        q_out=x["q_out"], launches=launches,
    )  # fmt: skip


def test_second_layer_of_a_step_builds_nothing(built):
    step = _rows()
    first, second = _layer(0), _layer(1)
    _decode(first, step.decode, step.decode.launches)
    assert len(built) == 1 and len(step.decode.launches) == 1
    _decode(second, step.decode, step.decode.launches)
    assert len(built) == 1 and len(step.decode.launches) == 1
    # The same results as a call that checks and builds its own launch.
    alone = _layer(1)
    _decode(alone, step.decode, None)
    assert len(built) == 2
    assert torch.equal(second["q_out"], alone["q_out"])
    assert torch.equal(second["kv_cache"], alone["kv_cache"])
    assert not torch.equal(first["q_out"], second["q_out"])
    # A new step has new rows: its first layer builds its launch.
    _decode(_layer(0), _rows().decode, _rows().decode.launches)
    assert len(built) == 3


def test_another_geometry_is_checked_before_any_launch(built):
    step = _rows()
    _decode(_layer(0), step.decode, step.decode.launches)
    bad = _layer(1)
    bad["k_pe"] = torch.randn(T, R + 2)
    before = bad["kv_cache"].clone()
    with pytest.raises(AssertionError, match="k_pe must be"):
        _decode(bad, step.decode, step.decode.launches)
    assert torch.equal(bad["kv_cache"], before)
    strided = _layer(2)
    strided["kv_c"] = torch.randn(T, L + R)[:, :L]  # another stride: its own launch
    _decode(strided, step.decode, step.decode.launches)
    assert len(built) == 2 and len(step.decode.launches) == 2


def test_prefill_launches_are_the_prefill_rows(built):
    step = _rows()
    positions = step.prefill.positions
    for seed in (0, 1):
        x = _layer(seed)
        n = positions.shape[0]
        mla.mla_rope_and_cache(
            x["q_pe"][:n], x["kv_c"][:n], x["k_pe"][:n], x["kv_cache"],
            step.prefill.slot_mapping, positions, x["cos_sin_cache"], False,
            launches=step.prefill.launches,
        )  # fmt: skip
    assert len(built) == 1 and not step.decode.launches


def test_ops_find_the_steps_launches_in_the_forward_context(monkeypatch, built):
    """The custom ops are given the layer's name and read its metadata's rows
    from the forward context, as vLLM's attention ops do."""
    step = _rows()
    meta = type("Meta", (), {"mla_rope_rows": step})()
    ctx = type("Ctx", (), {"attn_metadata": {"layer.0": meta, "layer.1": meta}})()
    monkeypatch.setattr(kvc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(kvc, "get_forward_context", lambda: ctx)
    for name, seed in (("layer.0", 0), ("layer.1", 1)):
        x = _layer(seed)
        torch.ops.vllm.mla_rope_concat_and_cache(
            x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"], x["kv_cache"], x["q_out"],
            step.decode.slot_mapping, step.decode.positions, x["cos_sin_cache"], False,
            "auto", torch.ones(1), None, False, False, name,
        )  # fmt: skip
    assert len(built) == 1 and len(step.decode.launches) == 1
