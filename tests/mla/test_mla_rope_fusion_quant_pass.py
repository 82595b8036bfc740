"""vLLM's MLA attention + quant fusion pass keeps the attention op's inputs.

The pass rebuilds ``unified_mla_attention_with_output`` from the keyword
arguments its patterns list; an input they do not list is dropped.  A fused
layer's positions are such an input (patch 0303): without them the rebuilt op
runs upstream's path with no RoPE and no cache write.  Two checks: the real
pass over a compiled ``MLAAttention.forward`` + static fp8 quant, fused and
unfused (in a process of its own: ``_mla_quant_pass_probe.py`` says why), and
every pattern's calls of the op against the op's registered schema.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm.model_executor.layers.attention.mla_rope_kv_cache",
    reason="needs the patched vLLM tree (build/vllm) on PYTHONPATH",
)

import vllm
import vllm.model_executor.layers.attention.mla_attention  # noqa: F401 (registers the op)

PROBE = Path(__file__).resolve().parent / "_mla_quant_pass_probe.py"
PASS_SOURCE = (Path(vllm.__file__).resolve().parent / "compilation" / "passes" / "fusion"
               / "mla_attn_quant_fusion.py")
# Inputs upstream's patterns have never listed: a matched layer with a
# replicated DCP query or a prepared MQA query would lose it (upstream's
# behaviour, not changed here).
NOT_IN_UPSTREAMS_PATTERNS = {"q_dcp_replicated", "mqa_q_prepared"}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant_pass") / "probe.json"
    # The vLLM tree this process imports (PYTHONPATH may be relative).
    tree = str(Path(vllm.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(PROBE), str(out)], cwd=PROBE.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("layer", ["fused", "unfused"])
def test_pass_fuses_the_quant_and_keeps_the_inputs(probed, layer):
    got = probed[layer]
    assert got["matched"] == 1 and got["attention_nodes"] == 1
    kwargs = got["kwargs"]
    assert kwargs["output_scale"] == "placeholder"  # the quant went into the op
    assert got["output_dtype"] == "torch.float8_e4m3fn"
    if layer == "fused":
        assert kwargs["positions"] == "placeholder"
        assert kwargs["kv_cache_dummy_dep"] is None
    else:
        assert kwargs["positions"] is None
        assert kwargs["kv_cache_dummy_dep"] == "vllm.unified_mla_kv_cache_update.default"
    assert got["same_output"], "the rebuilt op gives another quantised output"
    assert got["same_cache"], "the rebuilt op writes another cache"


def _op_calls(tree: ast.Module) -> dict[str, list[set[str]]]:
    """Keyword names of each auto_functionalized(MLA_ATTN_OP, ...), by class."""
    calls: dict[str, list[set[str]]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "auto_functionalized" and node.args
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id == "MLA_ATTN_OP"):
                calls.setdefault(cls.name, []).append({k.arg for k in node.keywords})
    return calls


def test_every_pattern_passes_the_ops_tensor_inputs():
    """From the registered schema: each call of the op in the pass names only
    arguments of the op and every Tensor input of it (positions included),
    save the one upstream leaves out; a new input of the op fails here until
    the patterns carry it."""
    schema = torch.ops.vllm.unified_mla_attention_with_output.default._schema
    names = {a.name for a in schema.arguments}
    tensors = {a.name for a in schema.arguments
               if isinstance(a.type.getElementType() if isinstance(a.type, torch.OptionalType)
                             else a.type, torch.TensorType)}
    assert "positions" in tensors and "kv_cache_dummy_dep" in tensors
    calls = _op_calls(ast.parse(PASS_SOURCE.read_text()))
    # Pattern and replacement, each with and without the layer-name input.
    assert sorted(calls) == ["MLAAttnFp8GroupQuantPattern", "MLAAttnFp8StaticQuantPattern",
                             "MLAAttnNvfp4QuantPattern"]
    for cls, kwarg_sets in calls.items():
        assert len(kwarg_sets) == 4, cls
        for kwargs in kwarg_sets:
            assert kwargs <= names, (cls, kwargs - names)
            assert tensors - kwargs == NOT_IN_UPSTREAMS_PATTERNS, (cls, tensors - kwargs)
