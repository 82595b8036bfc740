"""The shape matrix, and one compile spec per (kernel, shape) the wrappers can meet: runtime
arguments (representative values, specialised by the worker as Triton's JIT would),
constexprs and options.  Every tunable comes from the wrapper module's own config selection
called with the target; only the mapping of shapes to arguments is written here.  Each config
is compiled at a base shape, with every value of every other axis once and at its heaviest
combination (docs/compile-tier.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
import triton

OPS = "vllm.v1.attention.ops"

HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64)
GROUPS = (1, 2, 4, 8, 16)
NUM_KV_HEADS = 8
MAX_BLOCKS_PER_REQ = 2048  # block-table row stride
NUM_REQS = 3  # not 1 (a constexpr at launch) and not a multiple of 16
MAX_TOKENS = 8192  # token bound of the step buffers
WINDOW = 4096
SPLITS = 4

_MODEL = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Ptr:
    """A pointer argument: its dtype, and whether its allocation passes 2 GiB (a KV cache)."""

    dtype: torch.dtype
    big: bool = False

    def data_ptr(self) -> int:
        return 1 << 20  # 16-byte aligned, as every torch allocation

    def ptr_range(self) -> int:
        return 1 << 40 if self.big else 1 << 20


@dataclass
class Spec:
    kernel: str  # the public entry point, for reports
    fn: object  # the @triton.jit kernel
    case: str  # shape key
    config: dict  # what the wrapper chose (tiles, warps, ...), for reports
    args: dict  # runtime argument -> Ptr | int | float
    constexprs: dict
    options: dict
    expect: dict = field(default_factory=dict)  # extra checks (vector widths)


def _dname(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.").replace("float8_", ""))


def _paged_points():
    """(head, block, group, model, fp8, with_new, window, splits) points: at each head size the
    base, every other axis varied once and the heaviest combination; block and group sizes at
    head size 128."""
    base = dict(head=128, block=16, group=8, model="bf16", fp8=False, with_new=True,
                window=False, splits=1)
    points = []
    for head in HEAD_SIZES:
        at = dict(base, head=head)
        points += [at, dict(at, fp8=True), dict(at, model="fp16", fp8=True), dict(at, model="fp16"),
                   dict(at, with_new=False), dict(at, window=True), dict(at, splits=SPLITS),
                   dict(at, fp8=True, window=True, splits=SPLITS)]
    points += [dict(base, block=block) for block in BLOCK_SIZES]
    points += [dict(base, group=group) for group in GROUPS]
    return points


def _paged_spec(target, mod, p) -> Spec:
    """The main kernel's spec at point ``p``, with the tile the wrapper picks."""
    d, bs, g = p["head"], p["block"], p["group"]
    model = _MODEL[p["model"]]
    tile = mod._tile_config(target.gpu_target(), d, g, model)
    cache = getattr(torch, target.fp8_e4m3) if p["fp8"] else model
    hq, hkv = g * NUM_KV_HEADS, NUM_KV_HEADS
    split = p["splits"] > 1
    out_dtype = torch.float32 if split else model
    t = MAX_TOKENS
    qkv_row = (hq + 2 * hkv) * d  # q / k / v are views of the fused qkv output
    cache_strides = (hkv * bs * 2 * d, 2 * d, bs * 2 * d)  # packed (blocks, H, bs, 2D)
    o_strides = (t * hq * d if split else 0, hq * d, d)  # a split's partials: [splits, T, H, D]
    l_strides = (hq * t if split else 0, t, 1)
    new = p["with_new"]
    args = dict(
        q_ptr=Ptr(model), k_cache_ptr=Ptr(cache, True), v_cache_ptr=Ptr(cache, True),
        k_new_ptr=Ptr(model) if new else Ptr(cache, True),
        v_new_ptr=Ptr(model) if new else Ptr(cache, True),
        block_table_ptr=Ptr(torch.int32), cu_seqlens_q_ptr=Ptr(torch.int32),
        seq_lens_ptr=Ptr(torch.int32),
        k_scale_ptr=Ptr(torch.float32 if p["fp8"] else torch.int32),
        v_scale_ptr=Ptr(torch.float32 if p["fp8"] else torch.int32),
        out_ptr=Ptr(out_dtype), lse_ptr=Ptr(torch.float32),
        num_reqs=NUM_REQS, num_splits=p["splits"], qk_scale_log2=0.1275,
        window_left=WINDOW - 1 if p["window"] else 0,
        stride_qt=qkv_row, stride_qh=d,
        stride_kb=cache_strides[0], stride_kt=cache_strides[1], stride_kh=cache_strides[2],
        stride_vb=cache_strides[0], stride_vt=cache_strides[1], stride_vh=cache_strides[2],
        stride_knt=qkv_row if new else 0, stride_knh=d if new else 0,
        stride_vnt=qkv_row if new else 0, stride_vnh=d if new else 0,
        stride_bt=MAX_BLOCKS_PER_REQ,
        stride_os=o_strides[0], stride_otok=o_strides[1], stride_oh=o_strides[2],
        stride_ls=l_strides[0], stride_lh=l_strides[1], stride_lt=l_strides[2],
    )
    constexprs = dict(
        GROUP=g, GROUP_PAD=triton.next_power_of_2(g), BLOCK_Q=tile.block_q,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HEAD_DIM=d,
        HEAD_DIM_PAD=triton.next_power_of_2(d), PAGE_SIZE=bs,
        USE_WINDOW=p["window"], FP8=p["fp8"], WITH_NEW=new,
        DOT_IEEE=False, RESCALE_SLACK=mod._RESCALE_SLACK,  # DOT_IEEE: fp32 models only
    )
    case = (f"d{d}_b{bs}_g{g}_{p['model']}_{_dname(cache) if p['fp8'] else 'kv=q'}"
            f"{'_new' if new else ''}{'_win' if p['window'] else ''}"
            f"{'_split' if split else ''}")
    config = dict(block_m=tile.block_m, block_n=tile.block_n, num_warps=tile.num_warps,
                  num_stages=tile.num_stages)
    options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    return Spec("paged_context_attention", mod._paged_context_attention_kernel, case, config,
                args, constexprs, options)


def paged_context_specs(target, mod) -> list[Spec]:
    specs, combines = [], {}
    for p in _paged_points():
        specs.append(_paged_spec(target, mod, p))
        if p["splits"] > 1:
            hq = p["group"] * NUM_KV_HEADS
            combines[(p["head"], p["model"], hq)] = mod._combine_config(hq)
    for (d, model_name, hq), (block_h, warps) in sorted(combines.items()):
        model = _MODEL[model_name]
        t = MAX_TOKENS
        args = dict(
            part_out_ptr=Ptr(torch.float32), part_lse_ptr=Ptr(torch.float32),
            out_ptr=Ptr(model), lse_ptr=Ptr(torch.float32), cu_seqlens_q_ptr=Ptr(torch.int32),
            num_reqs=NUM_REQS, num_splits=SPLITS, num_heads=hq,
            stride_ps=t * hq * d, stride_pt=hq * d, stride_ph=d,
            stride_pls=hq * t, stride_plh=t, stride_plt=1,
            stride_otok=hq * d, stride_oh=d, stride_lh=t, stride_lt=1,
        )
        constexprs = dict(HEAD_DIM=d, HEAD_DIM_PAD=triton.next_power_of_2(d), BLOCK_H=block_h)
        specs.append(Spec("paged_context_attention (combine)", mod._combine_splits_kernel,
                          f"d{d}_h{hq}_{model_name}", dict(block_h=block_h, num_warps=warps),
                          args, constexprs, dict(num_warps=warps)))
    return specs


def _fetch_points(target):
    """(layout, head, block, cache dtype, out dtype, plan) points."""
    fp8 = getattr(torch, target.fp8_e4m3)
    points = []
    for layout in ("NHD", "SHUFFLE"):
        for head in HEAD_SIZES:
            for block in BLOCK_SIZES:
                points.append((layout, head, block, torch.bfloat16, torch.bfloat16, True))
                points.append((layout, head, block, fp8, torch.bfloat16, True))
            points.append((layout, head, 16, torch.float16, torch.float16, True))
            points.append((layout, head, 16, fp8, torch.float16, True))
            points.append((layout, head, 16, torch.bfloat16, torch.bfloat16, False))
            points.append((layout, head, 16, fp8, torch.bfloat16, False))
        points.append((layout, 128, 16, fp8, fp8, True))  # an fp8 workspace: a plain copy
    return points


def _plan_spec(mod, bs: int, ppp: int, num_reqs: int) -> Spec:
    step = mod._req_step(num_reqs)
    args = dict(plan_ptr=Ptr(torch.int32), block_table_ptr=Ptr(torch.int32),
                cu_seqlens_ptr=Ptr(torch.int32), seq_starts_ptr=Ptr(torch.int32),
                num_reqs=num_reqs, stride_bt_req=MAX_BLOCKS_PER_REQ, stride_bt_blk=1,
                stride_cu=1, stride_ss=1)
    constexprs = dict(PAGE=bs, PAGES_PER_PROGRAM=ppp, PLAN_WIDTH=mod._plan_width(ppp),
                      PLAN_HEADER=mod._PLAN_HEADER, REQ_STEP=step)
    warps = mod._PLAN_NUM_WARPS
    return Spec("fetch_kv_plan", mod._fetch_kv_plan_kernel, f"b{bs}_pages{ppp}_reqstep{step}",
                dict(pages_per_program=ppp, num_warps=warps), args, constexprs,
                dict(num_warps=warps))


def fetch_kv_specs(target, mod) -> list[Spec]:
    specs = []
    hkv = NUM_KV_HEADS
    req_step = mod._req_step(NUM_REQS)
    for layout, d, bs, cache, out, plan in _fetch_points(target):
        shuffle = layout == "SHUFFLE"
        es, oes = cache.itemsize, out.itemsize
        ppp = mod._pages_per_program(bs, d, es, oes, shuffle)
        width = mod._plan_width(ppp)
        dequant = cache != out
        if shuffle:  # (blocks, 2, bs, H * D) unflattened and unbound, as the backend does
            cstr = (2 * bs * hkv * d, hkv * d, d, 1)
        else:  # vLLM's packed (blocks, H, bs, 2D) viewed as K / V
            cstr = (hkv * bs * 2 * d, 2 * d, bs * 2 * d, 1)
        ostr = (hkv * d, d, 1)
        args = dict(
            key_cache_ptr=Ptr(cache, True), value_cache_ptr=Ptr(cache, True),
            key_out_ptr=Ptr(out), value_out_ptr=Ptr(out),
            block_table_ptr=Ptr(torch.int32), cu_seqlens_ptr=Ptr(torch.int32),
            seq_starts_ptr=Ptr(torch.int32), plan_ptr=Ptr(torch.int32),
            k_scale_ptr=Ptr(torch.float32 if dequant else torch.int32),
            v_scale_ptr=Ptr(torch.float32 if dequant else torch.int32),
            num_reqs=NUM_REQS, num_kv_heads=hkv,
            stride_bt_req=MAX_BLOCKS_PER_REQ, stride_bt_blk=1, stride_cu=1, stride_ss=1,
            stride_kc_blk=cstr[0], stride_kc_slot=cstr[1], stride_kc_head=cstr[2],
            stride_kc_dim=cstr[3], stride_vc_blk=cstr[0], stride_vc_slot=cstr[1],
            stride_vc_head=cstr[2], stride_vc_dim=cstr[3],
            stride_ko_tok=ostr[0], stride_ko_head=ostr[1], stride_ko_dim=ostr[2],
            stride_vo_tok=ostr[0], stride_vo_head=ostr[1], stride_vo_dim=ostr[2],
        )
        constexprs = dict(
            HEAD_SIZE=d, BLOCK_D=triton.next_power_of_2(d), PAGE=bs, PAGES_PER_PROGRAM=ppp,
            SHUFFLE=shuffle, X=mod._VECTOR_BYTES // es if shuffle else 1, DEQUANT=dequant,
            PLAN=plan, PLAN_WIDTH=width, PLAN_HEADER=mod._PLAN_HEADER, REQ_STEP=req_step,
        )
        rows = ppp * bs
        warps = mod._num_warps(target.warp_size, rows, d, es, oes)
        # Bytes of K and V each thread loads and stores: what 16-byte vectors must carry.
        threads = warps * target.warp_size
        expect = dict(vector_bytes=mod._VECTOR_BYTES,
                      load_bytes_per_thread=2 * rows * d * es // threads,
                      store_bytes_per_thread=2 * rows * d * oes // threads)
        case = (f"{layout.lower()}_d{d}_b{bs}_{_dname(cache)}_to_{_dname(out)}"
                f"{'_plan' if plan else '_lookup'}")
        specs.append(Spec("fetch_kv", mod._fetch_kv_kernel, case,
                          dict(pages_per_program=ppp, num_warps=warps), args,
                          constexprs, dict(num_warps=warps), expect))
        if plan:
            specs.append(_plan_spec(mod, bs, ppp, NUM_REQS))
    for num_reqs in (200, 5000):  # the request-lookup step grows with the batch
        specs.append(_plan_spec(mod, 16, mod._pages_per_program(16, 128, 2, 2, False), num_reqs))
    return specs


MLA_L, MLA_R, MLA_NOPE = 512, 64, 128  # DeepSeek-V2/V3: kv_lora_rank, rope dim, nope dim
MLA_BLOCK = 64


def _mla_points():
    """(decode, tokens, heads, model, cache, q_fp8, neox) points: each axis varied from a
    decode base (64 tokens) and a prefill base (8192 tokens), 16 heads."""
    decode = dict(decode=True, tokens=64, heads=16, model="bf16", cache="model", q_fp8=False,
                  neox=False)
    prefill = dict(decode, decode=False, tokens=8192)
    return [
        *(dict(decode, heads=heads) for heads in (8, 16, 128)),  # TP 16 / 8 / 1 of DeepSeek-V3
        dict(decode, cache="fp8"),
        dict(decode, cache="fp8", q_fp8=True),
        dict(decode, neox=True),
        dict(decode, model="fp16"),
        dict(decode, model="fp16", cache="fp8", q_fp8=True),
        *(dict(prefill, tokens=tokens) for tokens in (128, 256, 512, 8192)),  # BLOCK_T 1 to 8
        dict(prefill, cache="fp8"),
        dict(prefill, heads=128),
        dict(prefill, neox=True),
        dict(prefill, model="fp16", cache="fp8"),
    ]


def mla_specs(target, mod) -> list[Spec]:
    specs = []
    fp8 = getattr(torch, target.fp8_e4m3)
    fp8_max = float(torch.finfo(fp8).max)
    for p in _mla_points():
        model = _MODEL[p["model"]]
        cache = fp8 if p["cache"] == "fp8" else model
        q_out = fp8 if p["q_fp8"] else model
        t, h, decode = p["tokens"], p["heads"], p["decode"]
        block_l, block_half, block_t, block_h, warps = mod._tile_config(
            t, h, MLA_L, MLA_R, decode)
        q_row = MLA_NOPE + MLA_R  # q_pe is q[..., P:] of q [T, H, P + R]
        kv_row = MLA_L + MLA_R  # kv_c, k_pe are views of kv_a [T, L + R]
        args = dict(
            ql_nope_ptr=Ptr(model), q_pe_ptr=Ptr(model),
            q_out_ptr=Ptr(q_out) if decode else Ptr(model),
            kv_c_ptr=Ptr(model), k_pe_ptr=Ptr(model), kv_cache_ptr=Ptr(cache, True),
            slot_mapping_ptr=Ptr(torch.int64), positions_ptr=Ptr(torch.int64),
            cos_sin_ptr=Ptr(model),
            k_scale_ptr=Ptr(torch.float32 if cache == fp8 else torch.int64),
            q_scale_ptr=Ptr(torch.float32 if p["q_fp8"] else torch.int64),
            num_tokens=t, num_slots=t, num_heads=h, block_size=MLA_BLOCK,
            stride_qn_t=h * MLA_L if decode else h * q_row,
            stride_qn_h=MLA_L if decode else q_row,
            stride_qp_t=h * q_row, stride_qp_h=q_row,
            stride_qo_t=h * (MLA_L + MLA_R) if decode else h * q_row,
            stride_qo_h=MLA_L + MLA_R if decode else q_row,
            stride_kvc_t=kv_row, stride_kpe_t=kv_row,
            stride_cache_b=MLA_BLOCK * kv_row, stride_cache_s=kv_row, stride_cs_p=MLA_R,
        )
        constexprs = dict(
            L=MLA_L, HALF=MLA_R // 2, BLOCK_L=block_l, BLOCK_HALF=block_half,
            BLOCK_T=block_t, BLOCK_H=block_h, IS_NEOX=p["neox"], DECODE=decode,
            Q_FP8_MAX=fp8_max if p["q_fp8"] else 0.0,
            KV_FP8_MAX=fp8_max if cache == fp8 else 0.0,
        )
        kernel = "mla_rope_concat_and_cache" if decode else "mla_rope_and_cache"
        case = (f"{'decode' if decode else 'prefill'}_T{t}_h{h}_{p['model']}_kv"
                f"{_dname(cache) if cache == fp8 else '=model'}"
                f"{'_qfp8' if p['q_fp8'] else ''}{'_neox' if p['neox'] else '_gptj'}")
        specs.append(Spec(kernel, mod._mla_rope_cache_kernel, case,
                          dict(block_t=block_t, block_h=block_h, num_warps=warps), args,
                          constexprs, dict(num_warps=warps, enable_fp_fusion=False)))
    return specs


BUILDERS = {
    "triton_paged_context_attention": paged_context_specs,
    "triton_fetch_kv": fetch_kv_specs,
    "triton_mla_rope_cache": mla_specs,
}


def build_specs(target) -> list[Spec]:
    """Every spec of every kernel for ``target``, argument names checked."""
    specs, seen = [], set()
    for module, builder in BUILDERS.items():
        for spec in builder(target, importlib.import_module(f"{OPS}.{module}")):
            if (spec.fn.__name__, spec.case) in seen:  # a base point met twice
                continue
            seen.add((spec.fn.__name__, spec.case))
            names = spec.fn.arg_names
            runtime = [n for n in names if n not in spec.constexprs]
            if sorted(runtime) != sorted(spec.args) or any(n not in names for n in spec.constexprs):
                raise RuntimeError(
                    f"compile tier: {module}.{spec.fn.__name__}'s arguments changed; update "
                    f"scripts/compile_tier/cases.py (kernel: {names}, spec: "
                    f"{sorted(spec.args) + sorted(spec.constexprs)})")
            specs.append(spec)
    return specs
