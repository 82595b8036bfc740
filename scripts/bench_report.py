#!/usr/bin/env python3
"""make report: every benchmark figure readers see, written from committed result files.

Reads ``benchmarks/results/*.json`` as committed at HEAD, keeps the files that may back
claims (seriestool/results.py; the others are listed with the reasons) and, per kernel
and device, the newest of them; figures are rounded by seriestool/headlines.py.  Writes
``benchmarks/RESULTS.md`` (every case, per kernel and device) and, in
README.md and docs/**/*.md, only the regions ``<!-- gen:NAME -->`` ...
``<!-- /gen:NAME -->``, NAME one of ``status`` (per topic: what changes, where checked,
headline) and ``bench-summary`` (per kernel: cases, timing, ranges, file).  An unknown NAME stops the report
(exit 2) before anything is written.  Figures typed by hand outside generated regions
are listed as warnings (``--strict``: exit 1).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from seriestool import benchmeta, figures, headlines, results, topics  # noqa: E402

_BLOCK_RE = re.compile(r"(<!-- gen:(?P<name>[\w.:-]+) -->)(.*?)(<!-- /gen:(?P=name) -->)", re.S)


class ReportError(Exception):
    """A generated region names something the report does not make."""


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _short(version) -> str:
    """``2.11.0+cu130`` -> ``2.11``."""
    return ".".join(str(version).split("+")[0].split(".")[:2]) if version else "?"


class Report:
    def __init__(self, root: Path):
        self.root = root
        self.details = root / "benchmarks" / "RESULTS.md"
        self.selection = results.select(root)
        self.heads = headlines.headlines(root, self.selection)
        # Per (kernel, device): the newest usable file (RESULTS.md has a section each).
        self.sections = [headlines.headline(root, kernel, self.selection.latest(kernel, device))
                         for kernel in sorted({k for f in self.selection.usable for k in f.kernels()})
                         for device in self.selection.devices(kernel)]

    def link(self, base: Path, target: Path, kernel: str = "", device: str = "") -> str:
        rel = Path(os.path.relpath(target, base)).as_posix()
        return f"{rel}#{anchor(f'{kernel} on {device}')}" if kernel else rel

    def status(self, base: Path) -> str:
        rows = ["| topic | what changes | checked on | headline result | details |",
                "|---|---|---|---|---|"]
        for topic, kernels in topics.TOPIC_KERNELS.items():
            heads = [self.heads[k] for k in kernels if k in self.heads]
            tiers = ["CPU tier"] + [f"{d} (benchmarks)" for d in sorted({h.device for h in heads})]
            if not any(f.rocm for f in self.selection.usable if any(map(f.has, kernels))):
                tiers.append("ROCm: not run")
            shown = [h for h in heads if h.short][:2]
            headline = "; ".join(h.short for h in shown) or "no clean result yet"
            details = ", ".join(f"[{h.kernel}]({self.link(base, self.details, h.kernel, h.device)})"
                                for h in shown) or "n/a"
            rows.append(f"| `{topic}` | {topics.TOPIC_TITLES.get(topic, topic)} | "
                        f"{'; '.join(tiers)} | {headline} | {details} |")
        return "\n".join(rows)

    def summary(self, base: Path) -> str:
        if not self.sections:
            return "No usable benchmark results yet (`make bench` on a GPU, commit, `make report`)."
        rows = ["| kernel | device | torch / Triton | cases | timing | speedup vs baseline | "
                "of copy BW | results |", "|---|---|---|---:|---|---|---|---|"]
        for h in self.sections:
            cases = h.result.cases(h.kernel) or benchmeta.host_cases(h.result.data, h.kernel)
            speed = headlines.ratio([c["speedup"] for c in cases
                                     if isinstance(c.get("speedup"), (int, float))]) or "n/a"
            copy = headlines.percent([f for f in map(benchmeta.copy_fraction, cases)
                                      if isinstance(f, (int, float))]) or "n/a"
            timing = headlines.modes(cases) if h.result.cases(h.kernel) else "host"
            s = h.result.series
            rows.append(f"| [{h.kernel}]({self.link(base, self.details, h.kernel, h.device)}) | "
                        f"{h.device} | {_short(s.get('torch'))} / {_short(s.get('triton'))} | "
                        f"{len(cases)} | {timing} | {speed} | {copy} | "
                        f"[`{h.result.name}`]({self.link(base, self.root / h.result.path)}) |")
        rows += ["", f"Per-case tables: [{self.details.name}]({self.link(base, self.details)})."]
        return "\n".join(rows)

    def block(self, name: str, base: Path) -> str:
        if name == "status":
            return self.status(base)
        if name == "bench-summary":
            return self.summary(base)
        raise ReportError(f"unknown generated block {name!r} (status, bench-summary)")

    def fill(self, text: str, path: Path) -> str:
        return _BLOCK_RE.sub(lambda m: f"{m.group(1)}\n{self.block(m.group('name'), path.parent)}"
                             f"\n{m.group(4)}", text)

    def kernel_section(self, h: headlines.Headline) -> list[str]:
        s = h.result.series
        cases = h.result.cases(h.kernel)
        host = benchmeta.host_cases(h.result.data, h.kernel) if not cases else []
        baseline = ("the unpatched (pristine vLLM) functions, host code timed by pytest-benchmark"
                    if host else benchmeta.baseline_of(self.root, h.kernel, cases))
        out = [f"## {h.kernel} on {h.device}", ""]
        out += [f"- {c}" for c in h.claims] + [""]
        out += [f"Baseline: {baseline}.", ""] if baseline else []
        out += [f"From `{h.result.path}` ({h.result.when}; commit {s.get('commit', '?')}, "
                f"torch {s.get('torch', '?')}, triton {s.get('triton', '?')}).", "",
                benchmeta.host_table(host) if host
                else benchmeta.suite_table(h.kernel, cases, h.compare), ""]
        return out

    def results_md(self) -> str:
        out = ["# Kernel benchmark results", "",
               "Generated by `make report` from the result files committed under `benchmarks/results/` "
               "that come from a clean tree at a commit of this history (newest per kernel and device). "
               "µs are medians; `copy` is a same-bytes device copy in the same run. Timing: `cold ×N` "
               "rotates each call over N buffer sets holding at least 4× the L2, so every call reads "
               "HBM (benchmarks/timing.py); `warm` repeats the call on the same buffers; `flushed` is "
               "`do_bench` with its L2 flush (files from before the rotation). Cold cases show their "
               "warm speedup and fraction of copy beside.", ""]
        for h in self.sections:
            out += self.kernel_section(h)
        skipped = [f"- `{f.path}`: {'; '.join(why)}" for f, why in self.selection.skipped]
        out += ["## Result files not used", "", "\n".join(skipped) or "Every committed result file is used.", ""]
        return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the series repository")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when README/docs carry figures outside generated regions")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    report = Report(root)
    print(f"[report] {len(report.selection.usable)} usable of "
          f"{len(report.selection.usable) + len(report.selection.skipped)} committed result file(s)")
    for note in report.selection.notes():
        print(f"[report] {note}")
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    try:
        filled = {path: report.fill(path.read_text(), path) for path in pages if path.is_file()}
    except ReportError as exc:
        print(f"[report] error: {exc}; nothing written", file=sys.stderr)
        return 2
    report.details.parent.mkdir(parents=True, exist_ok=True)
    report.details.write_text(report.results_md())
    print(f"[report] wrote {report.details.relative_to(root)}")
    hand = 0
    for path, text in filled.items():
        if text != path.read_text():
            path.write_text(text)
            print(f"[report] updated {path.relative_to(root)}")
        for line, fig in figures.hand_typed(text):
            hand += 1
            print(f"[report] {'error' if args.strict else 'warning'}: {path.relative_to(root)}:"
                  f"{line}: hand-typed figure {fig.text!r} (use a generated region)")
    return 1 if args.strict and hand else 0


if __name__ == "__main__":
    sys.exit(main())
