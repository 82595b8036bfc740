"""Committed benchmark results: which files may back a claim, and the figures readers see of them.

Only ``benchmarks/results/*.json`` as committed at HEAD count, and only a file ``make bench``
wrote on a clean tree (``machine_info.series.dirty`` false) at a commit of HEAD's history,
unedited since (no ``commit_note``; its ``series_seal``, if any, matches).  Other files are
skipped with the reasons.  Each kernel's headline (which cases, which ratio) is defined once,
in ``headline``, for ``make report`` and ``make pr`` alike.  Ratios and µs are rounded to two
significant digits, percentages to whole percent; a range collapses when its ends round alike.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import SeriesError, gitrepo

SEAL_KEY = "series_seal"
# Suites that time the host: host µs per call (bench_host_cost.py) and eager wall clock
# of whole steps (bench_eager_step.py); no L2 mode.
HOST_TIMED = {"host_cost": "host", "eager_step": "eager"}


def _digest(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(data: dict) -> dict:
    """``data`` with a seal over everything else in it."""
    return {**data, SEAL_KEY: {"by": "scripts/run_bench.py", "sha256": _digest(data)}}


def timing_mode(case: dict) -> str:
    """host / eager (host-timed suites), else cold / warm as recorded; files from before
    the cold rotation: graph replays were warm, the rest ``do_bench`` with its L2 flush."""
    for prefix, mode in HOST_TIMED.items():
        if str(case.get("kernel", "")).startswith(prefix):
            return mode
    return case.get("mode") or ("warm" if case.get("graph") else "flushed")


class ResultFile:
    def __init__(self, path: str, data: dict):
        self.path = path  # relative to the repository root
        self.data = data
        self.name = Path(path).name
        self.series = data.get("machine_info", {}).get("series", {})
        self.device = str(self.series.get("device", "unknown device"))
        self.when = str(data.get("datetime", ""))
        self.commit = str(self.series.get("commit") or "")
        self.rocm = bool(self.series.get("hip"))

    def kernels(self) -> list[str]:
        return sorted({b["extra_info"]["kernel"] for b in self.data.get("benchmarks", [])
                       if "kernel" in b.get("extra_info", {})})

    def cases(self, kernel: str) -> list[dict]:
        """extra_info of the kernel's device-timed cases (those with ``results``)."""
        infos = [b.get("extra_info", {}) for b in self.data.get("benchmarks", [])]
        return [i for i in infos if i.get("kernel") == kernel and "results" in i]


def host_cases(data: dict, kernel: str) -> list[dict]:
    """A kernel's host-side (CPU) benchmarks, pytest-benchmark's own median per variant:
    rows of case, before/after µs and before / after as the speedup."""
    by_case: dict[str, dict] = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if info.get("kernel") == kernel and "variant" in info and "results" not in info:
            by_case.setdefault(info.get("case", "?"), {})[info["variant"]] = bench["stats"]["median"] * 1e6
    return [{"case": case, "before_us": v.get("before"), "after_us": v.get("after"),
             "speedup": v["before"] / v["after"] if v.get("before") and v.get("after") else None}
            for case, v in by_case.items()]


def problems(root: Path, result: ResultFile) -> list[str]:
    """Why a result file may not back claims (empty: it may)."""
    out = []
    dirty = result.series.get("dirty")
    if dirty is True:
        out.append("from a dirty tree (machine_info.series.dirty = true)")
    elif dirty is not False:
        out.append(f"tree state not recorded as clean (machine_info.series.dirty = {dirty!r})")
    commit = result.commit or "(none)"
    if gitrepo.git(root, "merge-base", "--is-ancestor", commit, "HEAD", check=False).returncode:
        out.append(f"series commit {commit} is not in HEAD's history")
    if "commit_note" in result.series:
        out.append("its commit was edited after the run (machine_info.series.commit_note)")
    mark = result.data.get(SEAL_KEY)
    if mark is not None and mark.get("sha256") != _digest(result.data):
        out.append("edited after the run (series_seal does not match the content)")
    return out


@dataclass
class Selection:
    usable: list[ResultFile]
    skipped: list[tuple[ResultFile, list[str]]]

    def latest(self, kernel: str, device: str | None = None) -> ResultFile | None:
        """The newest usable file with cases of ``kernel`` (on ``device`` when given)."""
        having = [f for f in self.usable if kernel in f.kernels() and device in (None, f.device)]
        return max(having, key=lambda f: (f.when, f.path)) if having else None

    def devices(self, kernel: str) -> list[str]:
        return sorted({f.device for f in self.usable if kernel in f.kernels()})


def select(root: Path) -> Selection:
    """Every ``benchmarks/results/*.json`` committed at HEAD, as committed, usable or skipped."""
    selection = Selection([], [])
    # Without a commit yet (a new series repository) the listing fails: nothing is committed.
    listed = gitrepo.git(root, "ls-tree", "--name-only", "HEAD", "--", "benchmarks/results/", check=False)
    for path in sorted(p for p in listed.stdout.splitlines() if p.endswith(".json")):
        try:
            result = ResultFile(path, json.loads(gitrepo.out(root, "show", f"HEAD:{path}")))
        except ValueError as exc:
            raise SeriesError(f"{path} as committed is not JSON: {exc}") from None
        reasons = problems(root, result)
        if reasons:
            selection.skipped.append((result, reasons))
        else:
            selection.usable.append(result)
    return selection


# --- what readers see of them: rounded figures, per-case tables, each kernel's headline ---------

# The paged-context goal the fetch-kv topic set itself (a target, not a measurement).
PAGED_CONTEXT_GOAL = 1.25
_ROUTE_DEFAULT_RE = re.compile(r'VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS",\s*"(\d+)"')


def _sig2(value: float) -> str:
    """About two significant digits: 0.45, 1.0 (from 0.95), 2.3, 12, 137."""
    if abs(value) >= 10:
        return f"{value:.0f}"
    if abs(value) >= 0.95:
        return f"{value:.1f}"
    return f"{value:.2g}"


def _span(values: list, fmt: Callable[[float], str], unit: str) -> str:
    """The range of the numbers among ``values``, rounded; "n/a" when there are none."""
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        return "n/a"
    lo, hi = fmt(min(values)), fmt(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def ratio(values: list) -> str:
    """``2.2–2.4×``."""
    return _span(values, _sig2, "×")


def percent(fractions: list) -> str:
    """``89–90%`` (from fractions)."""
    return _span([100 * f for f in fractions if f is not None], lambda v: f"{v:.0f}", "%")


def listing(values) -> str:
    """``1/4/8``: the distinct values, sorted (shapes, not figures)."""
    return "/".join(str(v) for v in sorted(set(values))) or "n/a"


def tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def modes(cases: list[dict]) -> str:
    """``cold L2`` / ``warm L2`` / ``L2: 20 warm, 16 flushed``."""
    counts = Counter(timing_mode(c) for c in cases)
    if len(counts) == 1:
        return f"{next(iter(counts))} L2"
    return "L2: " + ", ".join(f"{n} {m}" for m, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def us(case: dict, impl: str) -> float | None:
    return case.get("results", {}).get(impl, {}).get("us")


def over(case: dict, impl: str) -> float | None:
    """``impl`` µs / ours µs (how much faster ours is), or None."""
    a, b = us(case, impl), us(case, "ours")
    return a / b if a and b else None


def _fmt(value, spec: str, unit: str = "") -> str:
    """A table cell: ``value`` formatted, or ``n/a`` (never ``n/a×``)."""
    return format(value, spec) + unit if isinstance(value, (int, float)) else "n/a"


def _us(case: dict, impl: str) -> str:
    return _fmt(us(case, impl), ".1f")


def _x(value) -> str:
    return _fmt(value, ".2f", "×")


def _of_copy(case: dict, key: str) -> str:
    """Percent of copy bandwidth; n/a where the case's suite says the copy is no ceiling."""
    fraction = None if case.get("copy_ceiling") is False else case.get(key)
    return _fmt(fraction * 100 if fraction is not None else None, ".0f", "%")


def _table(rows: list[dict], columns: list[tuple[str, str, Callable[[dict], object]]]) -> str:
    """Markdown: one line per row; ``columns`` are (title, ``---`` or ``---:``, cell of a row)."""
    out = ["| " + " | ".join(title for title, _, _ in columns) + " |",
           "|" + "".join(f"{align}|" for _, align, _ in columns)]
    out += ["| " + " | ".join(str(cell(row)) for _, _, cell in columns) + " |" for row in rows]
    return "\n".join(out)


HOST_ROW_COLUMNS = [  # host rows (pytest-benchmark medians, before / after the series)
    ("case", "---", lambda r: r["case"]),
    ("before µs (median)", "---:", lambda r: _fmt(r["before_us"], ".1f")),
    ("after µs (median)", "---:", lambda r: _fmt(r["after_us"], ".1f")),
    ("before / after", "---:", lambda r: _x(r["speedup"]))]
HOST_COST_COLUMNS = [  # host µs per call of each entry point beside one torch op
    ("entry", "---", lambda c: c["case"]),
    ("call", "---", lambda c: c.get("call", "n/a")),
    ("ours µs", "---:", lambda c: _us(c, "ours")),
    ("torch op µs", "---:", lambda c: _us(c, "torch_op")),
    ("ours / torch op", "---:", lambda c: _x(c.get("ratio_to_torch_op"))),
    ("target", "---:", lambda c: "none" if c.get("target_ratio") is None else _fmt(c["target_ratio"], ".1f", "×")),
    ("met", "---", lambda c: {None: "n/a", True: "yes", False: "no"}[c.get("meets_target")]),
    ("plain path µs", "---:", lambda c: _us(c, "ours_plain")),
    ("upstream µs", "---:", lambda c: _us(c, "baseline")),
    ("GPU µs (ours)", "---:", lambda c: _fmt(c["results"]["ours"].get("gpu_us"), ".1f"))]
EAGER_STEP_COLUMNS = [  # eager wall clock of a step, ours vs upstream, and GPU-only time
    ("step", "---", lambda c: c["case"]),
    ("ours µs", "---:", lambda c: _us(c, "ours")),
    ("upstream µs", "---:", lambda c: _us(c, "baseline")),
    ("speedup", "---:", lambda c: _x(c.get("speedup"))),
    ("ours GPU µs", "---:", lambda c: _us(c, "ours_gpu")),
    ("upstream GPU µs", "---:", lambda c: _us(c, "baseline_gpu")),
    ("GPU speedup", "---:", lambda c: _x(c.get("gpu_speedup"))),
    ("ours", "---", lambda c: f"{c.get('ours_bound', 'n/a')}-bound"),
    ("upstream", "---", lambda c: f"{c.get('baseline_bound', 'n/a')}-bound")]


@dataclass
class Headline:
    kernel: str
    result: ResultFile
    device: str
    cases: list[dict]  # the kernel's device-timed cases, or else its host rows (pytest-benchmark)
    host: bool  # cases are host rows
    claims: list[str] = field(default_factory=list)  # sentences for the PR body and RESULTS.md
    short: str = ""  # the README status table's cell
    compare: tuple[str, ...] = ()  # extra ratio columns of the kernel's table

    def baseline(self) -> str | None:
        """What "baseline" was, as the run recorded it (``baseline_desc``)."""
        if self.host:
            return "the unpatched (pristine vLLM) functions, host code timed by pytest-benchmark"
        return next((c["baseline_desc"] for c in self.cases if c.get("baseline_desc")), None)

    def table(self) -> str:
        """The per-case table; of device-timed cases: every measured variant, speedup, fraction of
        copy, a ratio column for each of ``compare``, and cold cases' warm figures beside."""
        if self.host:
            return _table(self.cases, HOST_ROW_COLUMNS)
        suite = timing_mode({"kernel": self.kernel})
        if suite in ("host", "eager"):
            return _table(self.cases, HOST_COST_COLUMNS if suite == "host" else EAGER_STEP_COLUMNS)

        def timing(c):
            sets = c.get("buffer_sets")
            return f"cold ×{sets}" if timing_mode(c) == "cold" and sets else timing_mode(c)

        extra = sorted({impl for c in self.cases for impl in c["results"]} - {"ours", "baseline", "copy"})
        columns = [("case", "---", lambda c: c["case"]), ("timing", "---", timing)]
        columns += [(f"{impl} µs", "---:", lambda c, impl=impl: _us(c, impl))
                    for impl in ["ours", "baseline", *extra, "copy"]]
        columns += [("speedup vs baseline", "---:", lambda c: _x(c.get("speedup")))]
        columns += [(f"vs {impl}", "---:", lambda c, impl=impl: _x(over(c, impl))) for impl in self.compare]
        columns += [("ours GB/s", "---:", lambda c: _fmt(c["results"]["ours"].get("gbps"), ".0f")),
                    ("of copy BW", "---:", lambda c: _of_copy(c, "frac_copy"))]
        if any("results_warm" in c for c in self.cases):
            columns += [("warm: speedup", "---:", lambda c: _x(c.get("speedup_warm"))),
                        ("warm: of copy", "---:", lambda c: _of_copy(c, "frac_copy_warm"))]
        return _table(self.cases, columns)


def headline(root: Path, kernel: str, result: ResultFile) -> Headline:
    """The kernel's claims and README cell from ``result``: one definition per kernel."""
    cases = result.cases(kernel)
    h = Headline(kernel, result, result.device, cases or host_cases(result.data, kernel), host=not cases)
    if kernel == "fetch_kv":
        shape = {"tokens": 32768, "layout": "NHD", "head_size": 128, "cache_dtype": "torch.bfloat16",
                 "out_dtype": "torch.bfloat16"}
        sel = [c for c in cases if shape.items() <= c.get("shapes", {}).items()]
        speed = ratio([c.get("speedup") for c in sel])
        copy = percent([c.get("frac_copy") for c in sel])
        mode = modes(sel or cases)
        h.claims.append(f"`fetch_kv` gathers cached K/V at {speed} the speed of upstream's "
                        f"`cp_mha_gather_cache` and {copy} of a same-bytes copy (32K tokens, bf16, NHD, "
                        f"D 128, H_kv {listing(c['shapes']['num_kv_heads'] for c in sel)}; {h.device}, {mode}).")
        h.short = f"{speed} upstream's gather, {copy} of copy (32K tokens, {mode})"
    elif kernel == "fetch_kv_plan":
        cost = _span([us(c, "ours") for c in cases], _sig2, " µs")
        h.claims.append(f"The per-step plan (`fetch_kv_plan`, built once for all layers) costs {cost} "
                        f"({h.device}).")
        h.short = f"plan {cost} per step"
    elif kernel == "mla_rope_cache":
        h.compare = ("compiled_unfused",)
        prefill = [c for c in cases if c["case"].startswith("prefill_")
                   and c.get("shapes", {}).get("kv_cache_dtype") == "auto" and c["shapes"].get("T", 0) >= 8192]
        decode = [c for c in cases if c["case"].startswith("decode_")]
        p_speed = ratio([c.get("speedup") for c in prefill])
        d_speed = ratio([c.get("speedup") for c in decode])
        if prefill:
            p_tokens = " / ".join(tokens(t) for t in sorted({c["shapes"]["T"] for c in prefill}))
            h.claims.append(f"MLA prefill ({p_tokens} tokens, bf16 cache): RoPE + cache write at {p_speed} "
                            f"the speed of vLLM's CUDA `concat_and_cache_mla_rope_fused`, "
                            f"{percent([c.get('frac_copy') for c in prefill])} of a same-bytes copy "
                            f"({h.device}, {modes(prefill)}).")
        if decode:
            dtypes = {c["shapes"]["kv_cache_dtype"] for c in decode}
            caches = sorted("bf16" if d == "auto" else d for d in dtypes)
            h.claims.append(f"MLA decode (T ≤ {max(c['shapes']['T'] for c in decode)}, "
                            f"{listing(c['shapes']['H'] for c in decode)} heads, {' and '.join(caches)} "
                            f"caches): one launch at {d_speed} the CUDA kernel + concat and "
                            f"{ratio([over(c, 'compiled_unfused') for c in decode])} the compiled unfused "
                            f"sequence ({h.device}, {modes(decode)}).")
        h.short = f"prefill {p_speed} vLLM's CUDA kernel; decode {d_speed}"
    elif kernel == "paged_context":
        h.compare = ("gather_fa2",)
        limit = None  # the route's default threshold, as the series' patch sets it
        for patch in sorted((root / "patches").glob("*.patch")):
            if match := _ROUTE_DEFAULT_RE.search(patch.read_text()):
                limit = int(match[1])
                break
        routed = [c for c in cases if limit is not None
                  and c.get("shapes", {}).get("requests", 0) * c.get("shapes", {}).get("new_tokens", 0) <= limit]
        fa2 = ratio([over(c, "gather_fa2") for c in routed])
        same = ratio([c.get("speedup") for c in routed])
        # Counted as the per-case tables print them (two decimals): 1.246 shows as 1.25× and counts.
        goal = [c for c in routed if round(c.get("speedup") or 0, 2) >= PAGED_CONTEXT_GOAL]
        at_goal = f"{len(goal)} of {len(routed)} cases at ≥ {PAGED_CONTEXT_GOAL:g}×" if routed else "n/a"
        contexts = sorted({c["shapes"]["context"] for c in cases if "context" in c.get("shapes", {})})
        span = f"{tokens(contexts[0])}–{tokens(contexts[-1])}" if contexts else "n/a"
        h.claims.append(f"Short extends (≤ {limit} new tokens a step) attend to their cached context straight "
                        f"from the paged cache: {fa2} the speed of gather + FlashAttention-2 and {same} that "
                        f"of gather + the same Triton kernel, {at_goal} "
                        f"({span} cached tokens; {h.device}, {modes(routed or cases)}).")
        h.short = f"≤ {limit} new tokens: {fa2} gather + FA2, {same} gather + same kernel"
    elif kernel == "order_host":
        speed = ratio([r["speedup"] for r in h.cases])
        h.claims.append(f"Host time per step of the batch-order code: unpatched / patched = {speed} "
                        f"({h.device}, pytest-benchmark medians).")
        h.short = f"host time per step, unpatched / patched {speed}"
    return h


def headlines(root: Path, selection: Selection) -> dict[str, Headline]:
    """kernel -> the headline of its newest usable result file."""
    kernels = sorted({k for f in selection.usable for k in f.kernels()})
    return {k: headline(root, k, selection.latest(k)) for k in kernels}
