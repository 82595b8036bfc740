"""make pr's PR_DESCRIPTION.md: vLLM's template sections, short, figures only from clean results."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from fake_upstream import UPSTREAM, ok
from test_export import _identity

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import buildtree, export, figures, patchfile, results, topics  # noqa: E402
from seriestool.pins import load_pins  # noqa: E402

# vLLM's PR template: its sections (ours replace them) and the checklist footer (kept).
TEMPLATE = """## Overview

<!-- Summarize the change. -->

---

<details>
<summary> Pull Request Checklist </summary>

- [ ] **Testing and Validation:** the fake checklist item.
</details>
"""


def _result(commit: str, when: str, speedups: list[float], *, device: str = "NVIDIA H200",
            dirty=False, hip=None) -> dict:
    cases = [{"kernel": "fetch_kv", "case": f"nhd_bf16_h{h}_d128_b16_32k", "mode": "cold",
              "buffer_sets": 4, "speedup": s, "frac_copy": 0.9, "graph": True,
              "shapes": {"tokens": 32768, "layout": "NHD", "head_size": 128, "num_kv_heads": h,
                         "cache_dtype": "torch.bfloat16", "out_dtype": "torch.bfloat16"},
              "results": {"ours": {"us": 10.0}, "baseline": {"us": 10.0 * s}, "copy": {"us": 9.0}},
              "results_warm": {"ours": {"us": 8.0}, "baseline": {"us": 30.0}, "copy": {"us": 7.0}},
              "speedup_warm": 3.75, "frac_copy_warm": 0.875}
             for h, s in zip((1, 4, 8), speedups)]
    data = {"datetime": when, "benchmarks": [{"extra_info": c} for c in cases],
            "machine_info": {"series": {"device": device, "cuda": None if hip else "13.0", "hip": hip,
                                        "torch": "2.11.0", "triton": "3.6.0", "commit": commit,
                                        "dirty": dirty}}}
    return results.seal(data)


def _claims(text: str) -> list[str]:
    body = text.split("## Claims\n", 1)[1].split("\n## ", 1)[0]
    return [ln[2:] for ln in body.splitlines() if ln.startswith("- ")]


def test_pr_body_quotes_only_clean_committed_results(fake_series, tmp_path):
    fs = fake_series
    fs.upstream({**UPSTREAM, ".github/PULL_REQUEST_TEMPLATE.md": TEMPLATE})
    patch = (fs.patches / "0002-check-sub.patch").read_text()
    (fs.patches / "0002-check-sub.patch").write_text(
        patch.replace("Upstream: none", "Upstream: vllm#25763 (merged v0.11.1); related vllm#27367 "
                      "(open)"))
    fs.commit("the series")
    commit = fs.git("rev-parse", "HEAD", cwd=fs.root)
    out = fs.root / "benchmarks" / "results"
    out.mkdir(parents=True)
    # The one committed clean result; the dirty and edited ones make report leaves out
    # (tests/test_bench_report.py) are left out here too.
    (out / "20261120-h200.json").write_text(json.dumps(_result(commit, "2026-11-20T00:00:00", [2.04, 2.5, 2.96])))
    (out / "20261121-dirty.json").write_text(json.dumps(_result(commit, "2026-11-21T00:00:00", [9.0] * 3,
                                                                dirty=True)))
    fs.commit("results")
    # Newest of all, but not committed: not a result the PR may quote.
    (out / "20261129-mi300.json").write_text(
        json.dumps(_result(commit, "2026-11-29T00:00:00", [9.0] * 3, device="AMD Instinct MI300X", hip="7.0")))

    ok(fs.run("pr", "--topic", "fetch-kv", env=_identity(tmp_path)))
    text = (fs.root / "dist" / "fetch-kv" / "PR_DESCRIPTION.md").read_text()
    assert text.startswith("# [ROCm] AITER FA: faster KV-cache fetch")
    assert [ln for ln in text.splitlines() if ln.startswith("#")][1:] == [
        "## Overview", "## Claims", "## Validation", "## Details"]
    assert "Related: vllm#25763 (merged), vllm#27367 (open)." in text
    claims = _claims(text)
    assert 2 <= len(claims) <= 6 and "Comment sub." in claims
    assert "New files (none replaces an upstream file):\n- `vllm/ops/new_kernel.py`: new module." in text
    assert claims[0] == ("`fetch_kv` gathers cached K/V at 2.0–3.0× the speed of upstream's "
                         "`cp_mha_gather_cache` and 90% of a same-bytes copy (32K tokens, bf16, NHD, D 128, "
                         "H_kv 1/4/8; NVIDIA H200, cold L2).")
    assert "Results: `benchmarks/results/20261120-h200.json` (NVIDIA H200, CUDA 13.0" in text
    assert "No committed clean results for `fetch_kv_plan`, `paged_context`." in text
    # The per-case table is folded, with the warm numbers beside the cold ones.
    fold = text.split("<summary>Per-case results: <code>fetch_kv</code> on NVIDIA H200</summary>", 1)[1]
    fold = fold.split("</details>", 1)[0]
    assert "| nhd_bf16_h8_d128_b16_32k | cold ×4 | 10.0 | 29.6 | 9.0 | 2.96× | " in fold
    assert "| 3.75× | 88% |" in fold
    assert "9.00×" not in text and "MI300X" not in text
    assert export.lines_outside_folds(text) <= export.MAX_BODY_LINES
    assert text.endswith("---\n\n<details>\n<summary> Pull Request Checklist </summary>\n\n"
                         "- [ ] **Testing and Validation:** the fake checklist item.\n</details>\n")
    assert "Not run on ROCm hardware: benchmarks of `fetch_kv`, `fetch_kv_plan`, `paged_context`" in text


# --- the real series ------------------------------------------------------------------------

def _real_bodies() -> dict[str, str]:
    layout = buildtree.Layout(root=REPO, build=REPO / "build" / "vllm")
    template = layout.build / export.TEMPLATE
    if not template.is_file():
        pytest.skip("no build/vllm (make apply) with the pinned PR template")
    pins = load_pins(REPO)
    out = {}
    for topic in patchfile.TOPICS:
        mine = [p for p in buildtree.series_patches(layout) if p.topic == topic]
        overlay = topics.overlay_files_of(layout.patches, buildtree.overlay_files(layout), topic)
        plan = export.export_plan(layout, topic, buildtree.overlay_files(layout))
        changed = sorted({f for p in mine for f in p.files()} | set(overlay) | {t.dest for t in plan.tests})
        out[topic] = export.describe(layout, topic, pins, mine, changed, template.read_text(),
                                     "HEAD", plan)
    return out


def test_real_pr_bodies_are_short_say_each_thing_once_and_quote_only_generated_figures():
    layout = buildtree.Layout(root=REPO, build=REPO / "build" / "vllm")
    bodies = _real_bodies()
    generated = {f.text for h in results.headlines(REPO, results.select(REPO)).values()
                 for claim in h.claims for f in figures.find_figures(claim)}
    for topic, text in bodies.items():
        assert export.lines_outside_folds(text) <= export.MAX_BODY_LINES, topic
        assert "n/a×" not in text and "n/a%" not in text, topic
        for patch in (p for p in buildtree.series_patches(layout) if p.topic == topic):
            assert text.count(patch.fields()["How"]) == 1, (topic, patch.name)
        validation = text.split("## Validation", 1)[1].split("Results:", 1)[0]
        for line in validation.splitlines():
            if "pytest" in line and not line.startswith("make "):
                assert "# GPU" in line or "VLLM_TARGET_DEVICE=cpu" in line, (topic, line)
        claims = _claims(text)
        assert 3 <= len(claims) <= 6, (topic, claims)
        for fig in (f for claim in claims for f in figures.find_figures(claim)):
            assert any(fig.text in g or g in fig.text for g in generated), (topic, fig.text)
        for table in re.findall(r"^\|.*\|$", text, flags=re.M):
            assert text.rfind("<details>", 0, text.find(table)) > text.rfind("</details>", 0, text.find(table)), \
                f"{topic}: a table outside <details>"
    assert "Depends on PR `fetch-kv`: its first commit adds `vllm/v1/attention/ops/triton_launch.py`" \
        in bodies["mla-fusion"]
