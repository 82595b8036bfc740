# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``paged_context_workspace_size``: every step's workspace fits the bound.

The split count is computed as on a GPU (``_split_count`` with a CUDA device,
the SM count and the target set here: an MI300X-like 304-CU gfx942 and an
H200-like 132-SM sm_90), for every token count up to the bound and request
counts 1-T; the workspace made from the bound-sized buffers is views of them.
"""

import math

import pytest
import torch
from triton.backends.compiler import GPUTarget
from vllm.v1.attention.ops import triton_paged_context_attention as pc

TARGETS = {
    "gfx942": (GPUTarget("hip", "gfx942", 64), 304),
    "sm_90": (GPUTarget("cuda", 90, 32), 132),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(64, 8, 128), (8, 1, 64),
                                                                 (32, 32, 256)])
def test_every_step_fits_the_bound(monkeypatch, target, num_heads, num_kv_heads, head_size):
    gpu_target, sms = TARGETS[target]
    monkeypatch.setattr(pc, "_gpu_target", lambda: gpu_target)
    monkeypatch.setattr(pc, "num_compute_units", lambda index: sms)
    cuda = torch.device("cuda", 0)
    max_tokens = 512
    lse, part_out, part_lse = pc.paged_context_workspace_size(
        max_tokens, num_heads, num_kv_heads, head_size, torch.bfloat16, cuda
    )
    assert lse == num_heads * max_tokens
    tile = pc._tile_config(gpu_target, head_size, num_heads // num_kv_heads, torch.bfloat16)
    worst = 0
    for t in range(1, max_tokens + 1):
        for b in range(1, t + 1, max(1, t // 16)):  # request counts 1 .. T
            for ctx in (None, 1000, 10**6):  # max_context_len only lowers S
                s = pc._split_count(t, b, num_kv_heads, tile, cuda, ctx, None)
                assert 1 <= s <= pc._MAX_SPLITS
                if s > 1:
                    worst = max(worst, s * t)
                    assert s * t * num_heads * head_size <= part_out, (t, b, s)
                    assert s * num_heads * t <= part_lse, (t, b, s)
    # Tight: the largest step uses all of it; and the docstring's closed form.
    assert worst * num_heads * head_size == part_out
    assert worst <= min(pc._MAX_SPLITS * max_tokens,
                        max_tokens + pc._PROGRAMS_PER_SM * sms * tile.block_q / num_kv_heads)


def test_workspace_is_views_of_the_buffers():
    sizes = pc.paged_context_workspace_size(8, 4, 2, 16, torch.float32, "cpu")
    buffers = tuple(torch.empty(max(n, 1), dtype=torch.float32) for n in sizes)
    # The interpreter splits only when told: split counts up to 16 fit buffers
    # sized for 16 splits of the largest step.
    big = tuple(torch.empty(16 * 8 * 4 * n, dtype=torch.float32) for n in (1, 16, 1))
    def workspace(t, reqs, **kw):
        block_table = torch.zeros(reqs, 4, dtype=torch.int32)
        cu_seqlens_q = torch.zeros(reqs + 1, dtype=torch.int32)
        seq_lens = torch.zeros(reqs, dtype=torch.int32)
        return pc.paged_context_workspace(block_table, cu_seqlens_q, seq_lens, num_tokens=t,
                                          num_heads=4, num_kv_heads=2, head_size=16,
                                          dtype=torch.float32, **kw)

    for t, s in ((8, 1), (5, 1), (8, 16), (3, 7)):
        bufs = buffers if s == 1 else big
        ws = workspace(t, 2, num_splits=s, buffers=bufs)
        assert ws.num_splits == s
        assert ws.lse.shape == (4, t) and ws.lse.is_contiguous()
        assert ws.lse.untyped_storage().data_ptr() == bufs[0].untyped_storage().data_ptr()
        if s > 1:
            assert ws.partial_out.shape == (s, t, 4, 16)
            assert ws.partial_out.data_ptr() == bufs[1].data_ptr()
            assert ws.partial_lse.data_ptr() == bufs[2].data_ptr()
    with pytest.raises(ValueError, match="buffers: partial_out must be"):
        workspace(8, 1, num_splits=16,
                  buffers=(big[0], big[1][: math.prod((16, 8, 4, 16)) - 1], big[2]))
