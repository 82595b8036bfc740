"""The merged report of a sweep folder: ``REPORT.md`` next to the cell files.

One table per cell group (e2e recipe, kernel, fake) with the parameters that
vary inside the group as columns and the cell's metrics after them; an
upstream-vs-patched table for every pair of cells that differ only in their
install (named ``upstream`` and ``patched``); every kernel case; failures with
the first line of their error; cells of the manifest that have no result yet.
Every number is copied from a cell file: nothing is estimated or filled in.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .results import MANIFEST, REPORT, index

PAIR = ("upstream", "patched")


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _columns(records: list[dict]) -> tuple[list[str], dict[str, object]]:
    """(parameters that vary across records, parameters that are the same in all)."""
    values: dict[str, set] = defaultdict(set)
    names: list[str] = []
    for record in records:
        flat = _flat_params(record)
        for name, value in flat.items():
            if name not in values:
                names.append(name)
            values[name].add(json.dumps(value, sort_keys=True))
    varying = [n for n in names if len(values[n]) > 1
               or any(n not in _flat_params(r) for r in records)]
    fixed = {n: json.loads(next(iter(values[n]))) for n in names if n not in varying}
    return varying, fixed


def _flat_params(record: dict) -> dict:
    cell = record.get("cell", {})
    flat = {k: v for k, v in cell.get("params", {}).items()
            if k != "recipe" and not isinstance(v, dict)}  # mappings: see the cell file
    flat.update({f"env.{k}": v for k, v in cell.get("env", {}).items()})
    if cell.get("install") is not None:
        flat["install"] = cell["install"]
    flat["gpus"] = cell.get("gpus")
    return flat


def _group_name(record: dict) -> str:
    cell = record.get("cell", {})
    recipe = cell.get("params", {}).get("recipe")
    return f"{cell.get('kind', '?')} {recipe}" if recipe else cell.get("kind", "?")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


def _rows_of(record: dict) -> list[tuple[str | None, dict]]:
    """(case, numbers) rows of a record: e2e cells one per measured case, others one."""
    cell = record.get("cell", {})
    benches = record.get("benchmarks") or []
    if cell.get("kind") == "e2e" and benches:
        return [(b["extra_info"].get("case"), b["extra_info"].get("results") or {})
                for b in benches]
    return [(None, record.get("metrics") or {})]


def _group_section(name: str, records: list[dict]) -> list[str]:
    varying, fixed = _columns(records)
    rows_by_record = [(r, _rows_of(r)) for r in records]
    with_case = any(case is not None for _, rows in rows_by_record for case, _ in rows)
    metrics: list[str] = []
    for _, rows in rows_by_record:
        for _, numbers in rows:
            metrics += [m for m in numbers if m not in metrics]
    lines = [f"## {name}", ""]
    if fixed:
        lines += ["Same in every cell: " + ", ".join(f"`{k}={_fmt(v)}`" for k, v in fixed.items()),
                  ""]
    table = []
    for record, rows in rows_by_record:
        flat = _flat_params(record)
        device = record.get("machine_info", {}).get("series", {}).get("device")
        for case, numbers in rows:
            seconds = record.get("duration_s")
            table.append([*(flat.get(v) for v in varying), *([case] if with_case else []),
                          record["status"], *(numbers.get(m) for m in metrics), device,
                          f"{seconds:.1f}" if isinstance(seconds, (int, float)) else None])
    lines += _table([*varying, *(["case"] if with_case else []), "status", *metrics, "device",
                     "s"], table)
    return lines + [""]


def _pairs(records: list[dict]) -> list[str]:
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    for record in records:
        cell = record.get("cell", {})
        if cell.get("install") in PAIR:
            ident = json.dumps({k: cell.get(k) for k in ("kind", "params", "env", "gpus")},
                               sort_keys=True)
            groups[ident][cell["install"]] = record
    rows = []
    for pair in groups.values():
        if set(pair) != set(PAIR) or any(r["status"] != "ok" for r in pair.values()):
            continue
        up = dict(_rows_of(pair["upstream"]))
        label = pair["patched"]["label"].removesuffix(" patched")
        for case, numbers in _rows_of(pair["patched"]):
            base_numbers = up.get(case, {})
            for metric, value in numbers.items():
                base = base_numbers.get(metric)
                name = f"{label} [{case}]" if case is not None else label
                if isinstance(value, (bool, str)) or isinstance(base, (bool, str)):
                    rows.append([name, metric, base, value, None])
                elif isinstance(value, (int, float)) and isinstance(base, (int, float)):
                    rows.append([name, metric, base, value, value / base if base else None])
    if not rows:
        return []
    return ["## upstream vs patched", "",
            ("Pairs of cells that differ only in the install; the ratio is patched / upstream "
             "(higher is better for throughputs, lower for latencies)."), "",
            *_table(["cell", "metric", "upstream", "patched", "patched / upstream"], rows), ""]


def _kernel_cases(records: list[dict]) -> list[str]:
    rows = []
    for record in records:
        device = record.get("machine_info", {}).get("series", {}).get("device")
        for bench in record.get("benchmarks", []):
            info = bench.get("extra_info", {})
            res = info.get("results", {})
            rows.append([record["label"], info.get("kernel"), info.get("case"),
                         res.get("ours", {}).get("us"), res.get("baseline", {}).get("us"),
                         res.get("copy", {}).get("us"), info.get("speedup"),
                         info.get("frac_copy"), device])
    if not rows:
        return []
    return ["## kernel cases", "",
            *_table(["cell", "kernel", "case", "ours µs", "baseline µs", "copy µs", "speedup",
                     "of copy BW", "device"], rows), ""]


def render(out_dir: Path) -> str:
    found = index(out_dir)
    manifest = {}
    if (out_dir / MANIFEST).is_file():
        try:
            manifest = json.loads((out_dir / MANIFEST).read_text())
        except json.JSONDecodeError:
            manifest = {}
    name = manifest.get("name") or out_dir.name
    planned = manifest.get("cells") or []
    order = {c["key"]: i for i, c in enumerate(planned)}
    records = sorted((r for _, r in found.values()),
                     key=lambda r: (order.get(r["key"], len(order)), r["label"]))
    paths = {key: path.name for key, (path, _) in found.items()}
    ok = sum(r["status"] == "ok" for r in records)
    missing = [c for c in planned if c["key"] not in found]
    commits = sorted({str(r.get("machine_info", {}).get("series", {}).get("commit", "unknown"))[:12]
                      for r in records})
    devices = sorted({str(r.get("machine_info", {}).get("series", {}).get("device", "unknown"))
                      for r in records if r["status"] == "ok"})
    lines = [f"# Sweep `{name}`", "",
             ("Generated by `scripts/sweep.py report` from the cell files in this folder. Every "
              "number below was measured by the cell named in its row and copied from that "
              "cell's JSON file; nothing is estimated."), "",
             (f"- cells: {len(records) + len(missing)} — ok {ok}, failed {len(records) - ok}, "
              f"not run {len(missing)}"),
             f"- series commit(s): {', '.join(commits) or '–'}",
             f"- device(s) of successful cells: {', '.join(devices) or '–'}"]
    if manifest.get("config"):
        lines.append(f"- config: `{manifest['config']}`")
    lines.append("")
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[_group_name(record)].append(record)
    for group, members in groups.items():
        lines += _group_section(group, members)
    lines += _pairs(records)
    lines += _kernel_cases([r for r in records if r.get("cell", {}).get("kind") == "kernel"
                            and r["status"] == "ok"])
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        rows = []
        for record in failed:
            error = record.get("error", {})
            first = (error.get("message") or "").strip().splitlines()
            text = f"{error.get('type', '?')}: {first[0] if first else ''}"
            rows.append([record["label"], text[:300], paths.get(record["key"])])
        lines += ["## failures", "", "Tracebacks and output tails are in the cell files.", "",
                  *_table(["cell", "error", "file"], rows), ""]
    if missing:
        lines += ["## not run yet", "", *[f"- {c['label']}" for c in missing], ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(out_dir: Path) -> Path:
    path = out_dir / REPORT
    path.write_text(render(out_dir))
    return path
