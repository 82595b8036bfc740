"""What a benchmark case means: its baseline, and its per-case table.

Shared by ``make report`` (scripts/bench_report.py) and ``make pr``
(seriestool/export.py), so both say the same thing about the same JSON.
"""

from __future__ import annotations

from pathlib import Path


def baseline_of(root: Path, kernel: str, cases: list[dict]) -> str | None:
    """What "baseline" was in these results, as the run recorded it (``baseline_desc``).
    ``root`` and ``kernel`` are unused since issue 35 (no fallback to the suite's source)."""
    return next((c["baseline_desc"] for c in cases if c.get("baseline_desc")), None)


def _us(case: dict, impl: str) -> str:
    value = case.get("results", {}).get(impl, {})
    return f"{value['us']:.1f}" if isinstance(value, dict) and "us" in value else "n/a"


def _fmt(value, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


def _x(value) -> str:
    """A ratio cell: ``1.25×``, or ``n/a`` (never ``n/a×``)."""
    return f"{value:.2f}×" if isinstance(value, (int, float)) else "n/a"


def _pct(fraction) -> str:
    """A fraction as a percent cell: ``88%``, or ``n/a``."""
    return f"{100 * fraction:.0f}%" if isinstance(fraction, (int, float)) else "n/a"


def shown_ratio(value) -> float:
    """The ratio as a table cell shows it (two decimals); 0 when there is none."""
    return round(value, 2) if isinstance(value, (int, float)) else 0.0


def copy_fraction(case: dict):
    """The case's fraction of same-bytes copy bandwidth, or None where the copy
    is no ceiling for the operation (its suite says ``copy_ceiling=False``)."""
    if case.get("copy_ceiling") is False:
        return None
    return case.get("frac_copy")


# Suites that time the host: host µs per call (bench_host_cost.py) and eager
# wall clock of whole steps (bench_eager_step.py); no L2 mode.
HOST_TIMED = {"host_cost": "host", "eager_step": "eager"}


def timing_mode(case: dict) -> str:
    """host / eager (host-timed suites), else cold / warm as recorded; files from
    before the cold rotation: graph replays were warm, the rest ``do_bench``
    with its L2 flush ("flushed")."""
    for prefix, mode in HOST_TIMED.items():
        if str(case.get("kernel", "")).startswith(prefix):
            return mode
    return case.get("mode") or ("warm" if case.get("graph") else "flushed")


def _mode(case: dict) -> str:
    """cold ×N (buffer sets) / warm / flushed / host / eager."""
    mode = timing_mode(case)
    sets = case.get("buffer_sets")
    return f"{mode} ×{sets}" if mode == "cold" and sets else mode


def host_cost_table(cases: list[dict]) -> str:
    """Markdown: host µs per call of each entry point beside one torch op."""
    rows = ["| entry | call | ours µs | torch op µs | ours / torch op | target | met | "
            "plain path µs | upstream µs | GPU µs (ours) |",
            "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for case in cases:
        res = case.get("results", {})
        target, met = case.get("target_ratio"), case.get("meets_target")
        rows.append(
            f"| {case.get('case', '?')} | {case.get('call', 'n/a')} | {_us(case, 'ours')} | "
            f"{_us(case, 'torch_op')} | {_x(case.get('ratio_to_torch_op'))} | "
            f"{_fmt(target, '.1f') + '×' if target is not None else 'none'} | "
            f"{'n/a' if met is None else 'yes' if met else 'no'} | {_us(case, 'ours_plain')} | "
            f"{_us(case, 'baseline')} | {_fmt(res.get('ours', {}).get('gpu_us'), '.1f')} |")
    return "\n".join(rows)


def eager_step_table(cases: list[dict]) -> str:
    """Markdown: eager wall clock of a step, ours vs upstream, and GPU-only time."""
    rows = ["| step | ours µs | upstream µs | speedup | ours GPU µs | upstream GPU µs | "
            "GPU speedup | ours | upstream |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for case in cases:
        rows.append(
            f"| {case.get('case', '?')} | {_us(case, 'ours')} | {_us(case, 'baseline')} | "
            f"{_x(case.get('speedup'))} | {_us(case, 'ours_gpu')} | "
            f"{_us(case, 'baseline_gpu')} | {_x(case.get('gpu_speedup'))} | "
            f"{case.get('ours_bound', 'n/a')}-bound | {case.get('baseline_bound', 'n/a')}-bound |")
    return "\n".join(rows)


def suite_table(kernel: str, cases: list[dict], compare: tuple[str, ...] = ()) -> str:
    """The per-case table a kernel's results are shown in."""
    mode = timing_mode({"kernel": kernel})
    if mode == "host":
        return host_cost_table(cases)
    if mode == "eager":
        return eager_step_table(cases)
    return case_table(cases, compare)


def us(case: dict, impl: str) -> float | None:
    value = case.get("results", {}).get(impl, {})
    return value.get("us") if isinstance(value, dict) else None


def over(case: dict, impl: str) -> float | None:
    """``impl`` µs / ours µs (how much faster ours is), or None."""
    a, b = us(case, impl), us(case, "ours")
    return a / b if a and b else None


def case_table(cases: list[dict], compare: tuple[str, ...] = ()) -> str:
    """Markdown: every measured variant of every case, speedup and fraction of copy.

    ``compare``: implementations that also get a ratio column (their µs / ours).
    Cases timed cold carry their warm speedup and fraction of copy beside.
    """
    extra = sorted({impl for case in cases for impl in case.get("results", {})}
                   - {"ours", "baseline", "copy"})
    warm = any("results_warm" in case for case in cases)
    head = ("| case | timing | ours µs | baseline µs | " + "".join(f"{impl} µs | " for impl in extra)
            + "copy µs | speedup vs baseline | " + "".join(f"vs {impl} | " for impl in compare)
            + "ours GB/s | of copy BW |" + (" warm: speedup | warm: of copy |" if warm else ""))
    rows = [head, "|---|---|" + "---:|" * (len(extra) + len(compare) + 6 + (2 if warm else 0))]
    for case in cases:
        ours = case.get("results", {}).get("ours", {})
        frac = copy_fraction(case)
        frac_warm = case.get("frac_copy_warm") if case.get("copy_ceiling") is not False else None
        row = (f"| {case.get('case', '?')} | {_mode(case)} | "
               f"{_us(case, 'ours')} | {_us(case, 'baseline')} | "
               + "".join(f"{_us(case, impl)} | " for impl in extra)
               + f"{_us(case, 'copy')} | {_x(case.get('speedup'))} | "
               + "".join(f"{_x(over(case, impl))} | " for impl in compare)
               + f"{_fmt(ours.get('gbps'), '.0f')} | "
               f"{_pct(frac)} |")
        if warm:
            row += (f" {_x(case.get('speedup_warm'))} | "
                    f"{_pct(frac_warm)} |")
        rows.append(row)
    return "\n".join(rows)


def host_cases(data: dict, kernel: str) -> list[dict]:
    """Host-side (CPU) benchmarks of a kernel: pytest-benchmark's own timing, before vs after.

    Each row: case, before/after median µs, and before/after as the speedup.
    """
    by_case: dict[str, dict] = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if info.get("kernel") != kernel or "variant" not in info or "results" in info:
            continue
        median = bench.get("stats", {}).get("median")
        if isinstance(median, (int, float)):
            by_case.setdefault(info.get("case", "?"), {})[info["variant"]] = median * 1e6
    rows = []
    for case, values in by_case.items():
        before, after = values.get("before"), values.get("after")
        rows.append({"case": case, "before_us": before, "after_us": after,
                     "speedup": before / after if before and after else None})
    return rows


def host_table(rows: list[dict]) -> str:
    out = ["| case | before µs (median) | after µs (median) | before / after |",
           "|---|---:|---:|---:|"]
    for row in rows:
        out.append(f"| {row['case']} | {_fmt(row['before_us'], '.1f')} | "
                   f"{_fmt(row['after_us'], '.1f')} | {_x(row['speedup'])} |")
    return "\n".join(out)
