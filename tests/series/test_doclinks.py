"""make check's docs link check (seriestool/doclinks.py): relative links and anchors resolve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import doclinks  # noqa: E402


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    return tmp_path


def test_github_slugs():
    assert doclinks.slug("AITER FA KV fetch (`fetch-kv`, 0200, 0250, 0260)") == \
        "aiter-fa-kv-fetch-fetch-kv-0200-0250-0260"
    assert doclinks.slug("MLA RoPE + KV-cache fusion") == "mla-rope--kv-cache-fusion"
    assert doclinks.slug("order_host on CPU AMD EPYC (2 cores)") == "order_host-on-cpu-amd-epyc-2-cores"


def test_broken_files_and_anchors_are_found_good_ones_pass(tmp_path):
    root = _repo(tmp_path, {
        "README.md": ("# Top\n\n## Same\n\n## Same\n\n[ok](docs/a.md#part-two) [ok2](#same-1) [dir](ci)\n"
                      "[url](https://example.com/x) ![img](missing.png)\n"
                      "`[in code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
                      "[bad anchor](docs/a.md#part-three) [rel](patches/x)\n"),
        "docs/a.md": "# A\n\n## Part two\n\n[up](../README.md#top) [wrong](patches/x) <a id=\"here\"></a>\n"
                     "[explicit](#here)\n",
        "patches/x": "x\n",
        "ci/sweeps/s.yaml": "a: 1\n",
        "untracked.md": "[never read](nothing.md)\n",
    })
    (root / "untracked.md").write_text("[never read](nothing.md)\n")
    subprocess.run(["git", "-C", str(root), "rm", "-q", "--cached", "untracked.md"], check=True)
    findings = doclinks.lint_links(root)
    assert findings == [
        "README.md:8: link 'missing.png': missing.png does not exist",
        "README.md:14: link 'docs/a.md#part-three': no heading or anchor #part-three in docs/a.md",
        "docs/a.md:5: link 'patches/x': docs/patches/x does not exist",
    ], findings


def test_the_repository_docs_have_no_broken_links():
    assert doclinks.lint_links(REPO) == []


def test_readme_is_for_a_reviewer_with_five_minutes():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
