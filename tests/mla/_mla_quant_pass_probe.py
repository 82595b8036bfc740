"""vLLM's MLA attention + quant fusion pass over a compiled MLAAttention.forward.

Run as a script (``python _mla_quant_pass_probe.py OUT.json``) by
``test_mla_rope_fusion_quant_pass.py``: a process of its own, because
importing the pass (``mla_attn_quant_fusion.py``, through ``matcher_utils.py`` /
``rms_quant_fusion.py``) needs ops of ``vllm._C``, which the CPU tier does not
build; placeholders with those names are defined here (never called: the
pattern below matches the native quant), and must not reach the other tests.

For the harness layer (``_mla_rope_harness.py``), fused (positions given) and
unfused, ``forward`` then a static fp8 quant is compiled with the custom-op
path (``aot_autograd`` with Inductor's decompositions and auto_functionalized,
as vLLM's post-grad passes see it), ``MLAAttnFp8StaticQuantPattern`` applied,
and the compiled graph run against the eager function.  Written to OUT: per
case the number of matches, what the rebuilt attention node takes as
``positions`` / ``kv_cache_dummy_dep`` / ``output_scale``, and whether the
quantised output and the cache equal the eager run's, byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "fakes")]

# vllm._C's ops that the pass modules look up at import time (schema only).
_C_PLACEHOLDERS = torch.library.Library("_C", "FRAGMENT")
for _name in (
    "rotary_embedding", "static_scaled_fp8_quant", "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant", "silu_and_mul", "fused_add_rms_norm",
    "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_quant",
):  # fmt: skip
    _C_PLACEHOLDERS.define(f"{_name}(Tensor x) -> ()")

import vllm_from_source  # noqa: E402

vllm_from_source.bind()

import _mla_rope_harness as h  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._inductor.decomposition import select_decomp_table  # noqa: E402
from torch._inductor.pattern_matcher import PatternMatcherPass  # noqa: E402

import vllm.compilation.passes.vllm_inductor_pass as inductor_pass  # noqa: E402
from vllm.compilation.passes.fusion.mla_attn_quant_fusion import (  # noqa: E402
    MLA_ATTN_OP,
    MLAAttnFp8StaticQuantPattern,
)
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention.mla_rope_fusion import (  # noqa: E402
    RopeKVDecision,
    RopeKVPath,
)
from vllm.model_executor.layers.attention.mla_rope_kv_cache import (  # noqa: E402
    MLARopeKVFusion,
)
from vllm.model_executor.layers.quantization.input_quant_fp8 import (  # noqa: E402
    QuantFP8,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    GroupShape,
)

# The CPU tier's UnspecifiedPlatform has no device type; the patterns' example
# inputs need one.
inductor_pass.DEVICE_TYPE = "cpu"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _describe(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, torch.fx.Node):
        return "placeholder" if value.op == "placeholder" else str(value.target)
    return repr(value)


def probe(fused: bool) -> dict:
    case = h.CASES_BY_NAME["mixed_decode_first"]
    rope = h.make_rope(case.rope)
    inputs = h.make_inputs(case)
    layer = h.make_layer(case)
    if fused:
        decision = RopeKVDecision(RopeKVPath.TRITON, "test", requested=True)
        layer.rope_kv_fusion = MLARopeKVFusion(decision, rope, layer)
    layer.use_direct_call = False
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
        pattern = MLAAttnFp8StaticQuantPattern(layer, torch.float32)
        pm_pass = PatternMatcherPass(pass_name="mla_attn_quant_fusion")
        holder = object.__new__(inductor_pass.VllmFusionPatternMatcherPass)
        holder.pm_pass, holder._pattern_replacements = pm_pass, []
        inductor_pass.VllmFusionPatternMatcherPass.register(holder, pattern)
    # What forward_impl quantises with once the pass hands it output_scale.
    layer._quant_fp8_op = quant.forward_native
    layer._aiter_output_quant = False
    scale = torch.tensor([[0.25]], device=h.DEVICE)

    def step(q, kv_c, k_pe, positions):
        q = q.clone()
        if not fused:  # the wrapper's RoPE
            q[..., h.P :], k_pe = rope.forward_native(positions, q[..., h.P :], k_pe)
        out = layer.forward(
            q, kv_c, k_pe, output_shape=(q.shape[0], h.N * h.V),
            positions=positions if fused else None,
        )  # fmt: skip
        return quant.forward_native(out, scale)[0]

    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append((pm_pass.apply(gm.graph), gm))
        gm.recompile()
        return gm

    backend = aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table())
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    results = []
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        for fn in (step, compiled):
            layer.kv_cache = inputs["kv_cache"].clone()
            with h.forward_context(layer, inputs):
                out = fn(inputs["q"], inputs["kv_c"],
                         inputs["kv_lora"].clone()[:, h.L :].unsqueeze(1),
                         inputs["positions"])  # fmt: skip
            results.append((out, layer.kv_cache.clone()))
    (matched, gm), = graphs
    attn = [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.args and n.args[0] is MLA_ATTN_OP
    ]  # fmt: skip
    (eager_out, eager_cache), (compiled_out, compiled_cache) = results
    return {
        "matched": matched,
        "attention_nodes": len(attn),
        "kwargs": {k: _describe(v) for k, v in attn[0].kwargs.items()} if attn else {},
        "output_dtype": str(compiled_out.dtype),
        "same_output": torch.equal(_bytes(eager_out), _bytes(compiled_out)),
        "same_cache": torch.equal(_bytes(eager_cache), _bytes(compiled_cache)),
    }


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(
        json.dumps({name: probe(name == "fused") for name in ("fused", "unfused")})
    )
