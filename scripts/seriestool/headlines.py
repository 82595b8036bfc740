"""The figures readers see, named and rounded, each from one committed result file.

One definition per kernel of its headline (which cases, which ratio), used by ``make
report`` (README status table, benchmarks/RESULTS.md, docs/) and ``make pr`` (the PR
body's Claims), so the same claim shows the same figure everywhere.  Ratios and µs are
rounded to two significant digits, percentages to whole percent; a range collapses to one
value when its ends round alike.  A ``Headline`` has ``figures`` (name -> rounded text),
``claims`` (sentences for the PR body and RESULTS.md) and ``short`` (a table cell).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import benchmeta
from .results import ResultFile, Selection

# The paged-context goal the fetch-kv topic set itself (a target, not a measurement).
PAGED_CONTEXT_GOAL = 1.25
_ROUTE_DEFAULT_RE = re.compile(r'VLLM_ROCM_AITER_FA_PAGED_CONTEXT_MAX_TOKENS",\s*"(\d+)"')


# --- rounding -------------------------------------------------------------------------------

def _sig2(value: float) -> str:
    """About two significant digits: 0.45, 1.0 (from 0.95), 2.3, 12, 137."""
    if abs(value) >= 10:
        return f"{value:.0f}"
    if abs(value) >= 0.95:
        return f"{value:.1f}"
    return f"{value:.2g}"


def _span(values: list[float], fmt: Callable[[float], str], unit: str) -> str | None:
    if not values:
        return None
    lo, hi = fmt(min(values)), fmt(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def ratio(values: list[float]) -> str | None:
    """``2.2–2.4×``."""
    return _span(values, _sig2, "×")


def percent(fractions: list[float]) -> str | None:
    """``89–90%`` (from fractions)."""
    return _span([100 * f for f in fractions], lambda v: f"{v:.0f}", "%")


def microseconds(values: list[float]) -> str | None:
    """``2.2–3.7 µs``."""
    return _span(values, _sig2, " µs")


def listing(values) -> str:
    """``1/4/8``: the distinct values, sorted (shapes, not figures)."""
    return "/".join(str(v) for v in sorted(set(values)))


def tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


_HOST_MODES = {"host": "host µs per call", "eager": "eager wall clock"}


def modes(cases: list[dict]) -> str:
    """``cold L2`` / ``warm L2`` / ``L2: 20 warm, 16 flushed`` / ``host µs per call``."""
    counts = Counter(benchmeta.timing_mode(c) for c in cases)
    if len(counts) == 1:
        mode = next(iter(counts))
        return _HOST_MODES.get(mode, f"{mode} L2")
    return "L2: " + ", ".join(f"{n} {m}" for m, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _values(cases, fn) -> list[float]:
    return [v for v in map(fn, cases) if isinstance(v, (int, float))]


# --- headlines -----------------------------------------------------------------------------------

@dataclass
class Headline:
    kernel: str
    result: ResultFile
    figures: dict[str, str] = field(default_factory=dict)
    claims: list[str] = field(default_factory=list)
    short: str = ""
    sentence: str = ""  # none is generated since issue 35; export.py still reads the field
    compare: tuple[str, ...] = ()  # extra ratio columns of the kernel's table

    @property
    def device(self) -> str:
        return self.result.device

    def put(self, key: str, text: str | None) -> str:
        """Record a figure under ``<kernel>.<key>``; "n/a" when the data has none."""
        text = text or "n/a"
        self.figures[f"{self.kernel}.{key}"] = text
        return text


def paged_route_max_tokens(root: Path) -> int | None:
    """The paged-context route's default threshold, as the series' patch sets it."""
    for path in sorted((root / "patches").glob("*.patch")):
        match = _ROUTE_DEFAULT_RE.search(path.read_text(errors="replace"))
        if match:
            return int(match.group(1))
    return None


def _fetch_kv(h: Headline, cases: list[dict], root: Path) -> None:
    sel = [c for c in cases if c.get("shapes", {}).get("tokens") == 32768
           and c["shapes"].get("layout") == "NHD" and c["shapes"].get("head_size") == 128
           and c["shapes"].get("cache_dtype") == c["shapes"].get("out_dtype") == "torch.bfloat16"]
    speed = h.put("speedup_32k", ratio(_values(sel, lambda c: c.get("speedup"))))
    copy = h.put("copy_32k", percent(_values(sel, lambda c: c.get("frac_copy"))))
    heads = h.put("heads_32k", listing(c["shapes"]["num_kv_heads"] for c in sel) if sel else None)
    mode = h.put("mode_32k", modes(sel or cases))
    h.claims.append(f"`fetch_kv` gathers cached K/V at {speed} the speed of upstream's "
                    f"`cp_mha_gather_cache` and {copy} of a same-bytes copy (32K tokens, bf16, NHD, "
                    f"D 128, H_kv {heads}; {h.device}, {mode}).")
    h.short = f"{speed} upstream's gather, {copy} of copy (32K tokens, {mode})"


def _fetch_kv_plan(h: Headline, cases: list[dict], root: Path) -> None:
    cost = h.put("us", microseconds(_values(cases, lambda c: benchmeta.us(c, "ours"))))
    h.claims.append(f"The per-step plan (`fetch_kv_plan`, built once for all layers) costs {cost} "
                    f"({h.device}).")
    h.short = f"plan {cost} per step"


def _mla_rope_cache(h: Headline, cases: list[dict], root: Path) -> None:
    h.compare = ("compiled_unfused",)
    prefill = [c for c in cases if str(c.get("case", "")).startswith("prefill_")
               and c.get("shapes", {}).get("kv_cache_dtype") == "auto"
               and c["shapes"].get("T", 0) >= 8192]
    decode = [c for c in cases if str(c.get("case", "")).startswith("decode_")]
    p_speed = h.put("prefill_speedup", ratio(_values(prefill, lambda c: c.get("speedup"))))
    p_copy = h.put("prefill_copy", percent(_values(prefill, lambda c: c.get("frac_copy"))))
    p_tokens = h.put("prefill_tokens", " / ".join(tokens(t) for t in
                                                 sorted({c["shapes"]["T"] for c in prefill})) or None)
    d_speed = h.put("decode_speedup", ratio(_values(decode, lambda c: c.get("speedup"))))
    d_comp = h.put("decode_vs_compiled", ratio(_values(decode, lambda c: benchmeta.over(c, "compiled_unfused"))))
    d_tokens = h.put("decode_max_tokens", str(max(c["shapes"]["T"] for c in decode)) if decode else None)
    d_heads = h.put("decode_heads", listing(c["shapes"]["H"] for c in decode) if decode else None)
    d_caches = h.put("decode_caches", " and ".join(
        sorted({"bf16" if c["shapes"].get("kv_cache_dtype") == "auto" else c["shapes"].get("kv_cache_dtype")
                for c in decode})) if decode else None)
    p_mode, d_mode = h.put("prefill_mode", modes(prefill)), h.put("decode_mode", modes(decode))
    if prefill:
        h.claims.append(f"MLA prefill ({p_tokens} tokens, bf16 cache): RoPE + cache write at {p_speed} "
                        f"the speed of vLLM's CUDA `concat_and_cache_mla_rope_fused`, {p_copy} of a "
                        f"same-bytes copy ({h.device}, {p_mode}).")
    if decode:
        h.claims.append(f"MLA decode (T ≤ {d_tokens}, {d_heads} heads, {d_caches} caches): one launch "
                        f"at {d_speed} the CUDA kernel + concat and {d_comp} the compiled unfused "
                        f"sequence ({h.device}, {d_mode}).")
    h.short = f"prefill {p_speed} vLLM's CUDA kernel; decode {d_speed}"


def _paged_context(h: Headline, cases: list[dict], root: Path) -> None:
    h.compare = ("gather_fa2",)
    limit = paged_route_max_tokens(root)

    def new_total(c):
        s = c.get("shapes", {})
        return s.get("requests", 0) * s.get("new_tokens", 0)

    routed = [c for c in cases if limit is not None and new_total(c) <= limit]
    fa2 = h.put("routed_vs_fa2", ratio(_values(routed, lambda c: benchmeta.over(c, "gather_fa2"))))
    same = h.put("routed_vs_baseline", ratio(_values(routed, lambda c: c.get("speedup"))))
    # Counted as the per-case tables print them (two decimals): 1.246 shows as 1.25× and counts.
    goal = [c for c in routed if benchmeta.shown_ratio(c.get("speedup")) >= PAGED_CONTEXT_GOAL]
    at_goal = h.put("routed_at_goal", f"{len(goal)} of {len(routed)} cases at ≥ {PAGED_CONTEXT_GOAL:g}×"
                    if routed else None)
    contexts = sorted({c["shapes"]["context"] for c in cases if "context" in c.get("shapes", {})})
    span = h.put("contexts", f"{tokens(contexts[0])}–{tokens(contexts[-1])}" if contexts else None)
    mode = h.put("mode", modes(routed or cases))
    h.claims.append(f"Short extends (≤ {limit} new tokens a step) attend to their cached context straight "
                    f"from the paged cache: {fa2} the speed of gather + FlashAttention-2 and {same} that "
                    f"of gather + the same Triton kernel, {at_goal} "
                    f"({span} cached tokens; {h.device}, {mode}).")
    h.short = f"≤ {limit} new tokens: {fa2} gather + FA2, {same} gather + same kernel"


def _order_host(h: Headline, rows: list[dict], root: Path) -> None:
    speed = h.put("speedup", ratio(_values(rows, lambda r: r.get("speedup"))))
    h.put("cases", str(len(rows)))
    h.claims.append(f"Host time per step of the batch-order code: unpatched / patched = {speed} "
                    f"({h.device}, pytest-benchmark medians).")
    h.short = f"host time per step, unpatched / patched {speed}"


def _generic(h: Headline, cases: list[dict], root: Path) -> None:
    speed = h.put("speedup", ratio(_values(cases, lambda c: c.get("speedup"))))
    mode = modes(cases) if cases else "host"
    h.claims.append(f"`{h.kernel}`: {speed} the speed of its baseline over {len(cases)} cases "
                    f"({h.device}, {mode}).")
    h.short = f"{speed} its baseline"


KERNELS: dict[str, Callable[[Headline, list[dict], Path], None]] = {
    "fetch_kv": _fetch_kv,
    "fetch_kv_plan": _fetch_kv_plan,
    "mla_rope_cache": _mla_rope_cache,
    "paged_context": _paged_context,
    "order_host": _order_host,
}


def headline(root: Path, kernel: str, result: ResultFile) -> Headline:
    h = Headline(kernel, result)
    cases = result.cases(kernel)
    rows = benchmeta.host_cases(result.data, kernel) if not cases else []
    KERNELS.get(kernel, _generic)(h, cases or rows, root)
    return h


def headlines(root: Path, selection: Selection) -> dict[str, Headline]:
    """kernel -> the headline of its newest usable result file."""
    out = {}
    for kernel in sorted({k for f in selection.usable for k in f.kernels()}):
        result = selection.latest(kernel)
        if result is not None:
            out[kernel] = headline(root, kernel, result)
    return out


def figures(heads: dict[str, Headline]) -> dict[str, str]:
    return {name: text for h in heads.values() for name, text in h.figures.items()}
