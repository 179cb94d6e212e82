"""Compile every kernel of the layer for Hopper (sm_90a) on a machine without a GPU.

Triton's wheel carries ptxas and cuobjdump, so a CPU machine can compile the kernels exactly as
the layer launches them (the same Python path, arguments and constexprs, with launches turned
into compile-only calls) and read the machine code: shared memory, registers, stack (spills)
and whether the GEMMs use Hopper's warpgroup MMA (HGMMA in SASS). This catches errors that only
the GPU compiler sees (the interpreter accepts more), before any GPU time is spent.

    TRITON_INTERPRET=0 python -m moestream.tools.aot [--shape dsv3] [--json] [--loops]
    TRITON_INTERPRET=0 python -m moestream.tools.aot --fp8 [--block-m 64] [--warps 8] [--json]
    TRITON_INTERPRET=0 python -m moestream.tools.aot --fused-forms [--shapes qwen3] [--json]

Each kernel's row also carries its innermost SASS loops (``loops``: instructions, MMAs and
local-memory spill operations per trip; the K loops of the GEMMs) and ``sass_hash``, a hash
of the instruction text with addresses and kernel-parameter offsets left out: two revisions
whose kernels have equal hashes compile to the same machine code (compile the other revision
in a ``git worktree`` and compare; a new kernel parameter alone does not change the hash),
and ``hinted_stores``, its global stores with an L2 cache policy (decode pieces' outputs).

Must run in a fresh process: it needs Triton in compiler mode (see moestream/kernels/common.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["compile_layer", "compile_quant_gemms", "compile_fused_forms", "main"]

SM90_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on H100/H200


class _CompileOnlyDriver:
    """Stands in for the CUDA driver: a target to compile for, no device to launch on."""

    def __init__(self, capability: int = 90) -> None:
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _sass_facts(cubin: bytes) -> dict:
    """Registers, stack and MMA counts from the bundled cuobjdump: HGMMA (bf16/fp16 warpgroup
    MMAs), HMMA (warp MMAs), QGMMA (fp8 warpgroup MMAs, e.g. QGMMA.64x128x32.F32.E4M3.E4M3;
    e4m3_gmma: those on e4m3 x e4m3), CALLs (e.g. the slow path of correctly rounded
    divisions) and tensormap_fences (UTMACCTL: a tensor descriptor built in the kernel, made
    visible to the TMA unit)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ins = sass_instructions(sass)
    return dict(loops=sass_loops(ins), sass_hash=sass_hash(ins),
                registers=int(regs.group(1)) if regs else None,
                stack_bytes=int(stack.group(1)) if stack else None,
                hgmma=len(re.findall(r"\bHGMMA\b", sass)),
                hmma=len(re.findall(r"\bHMMA\b", sass)),
                qgmma=len(re.findall(r"\bQGMMA\b", sass)),
                e4m3_gmma=len(re.findall(r"\b[HQ]GMMA\.\S*E4M3\.E4M3\b", sass)),
                calls=len(re.findall(r"\bCALL\b", sass)),
                tensormap_fences=len(re.findall(r"\bUTMACCTL\b", sass)))


_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_MMA = re.compile(r"\b(?:HGMMA|QGMMA|HMMA)\b")
_LOCAL = re.compile(r"\b(?:STL|LDL)\b")


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction in cuobjdump --dump-sass output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, sass.splitlines())
            if m]


def sass_loops(ins: list[tuple[int, str]]) -> list[dict]:
    """The innermost loops of a kernel's SASS, in address order: a backward branch closes a loop
    from its target to itself; innermost = no other such range inside. Per loop (one trip):
    ``instructions``, ``mma`` (HGMMA / QGMMA / HMMA) and ``local_ops`` (STL / LDL: spill
    traffic). Loops without an MMA are polls and copies; the GEMMs' K loops have MMAs."""
    spans = []
    for addr, text in ins:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    inner = [(lo, hi) for lo, hi in spans
             if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in spans)]
    out = []
    for lo, hi in sorted(set(inner)):
        body = [t for a, t in ins if lo <= a <= hi]
        out.append(dict(start=lo, instructions=len(body),
                        mma=sum(bool(_MMA.search(t)) for t in body),
                        local_ops=sum(bool(_LOCAL.search(t)) for t in body)))
    return out


_TARGET = re.compile(r"\b(BRA|BSSY|CALL\S*|JMP|BRX)\b(.*?)0x[0-9a-f]+")
_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def sass_hash(ins: list[tuple[int, str]]) -> str:
    """Hash of the instruction text without addresses (nor branch and call targets) and
    without kernel-parameter offsets (``c[0x0][..]``), so that an added parameter or code that
    moved does not count as a change; immediates and registers do."""
    import hashlib
    text = "\n".join(_PARAM.sub("c[]", _TARGET.sub(r"\1\2X", t)) for _, t in ins)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


@contextlib.contextmanager
def _compile_only(capability: int, compiled: dict, label: list):
    """Within: every Triton launch compiles for sm_``capability`` instead of running;
    ``compiled[name[warps,stages] + label[0]] = (kernel name, compiled kernel)``."""
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise RuntimeError("set TRITON_INTERPRET=0 before importing triton/moestream")
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_CompileOnlyDriver(capability))
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        key = f"{self.fn.__name__}[{kwargs.get('num_warps', 4)}w{kwargs.get('num_stages', 3)}s]"
        compiled.setdefault(key + label[0], (self.fn.__name__, kernel))

    JITFunction.run = compile_only
    try:
        yield
    finally:
        JITFunction.run = original_run
        driver._active = None   # back to "whatever the machine has" (reset_active needs one)


# global loads/stores of one 1- or 2-byte value (not vectors): what row copies compile to
# when the compiler cannot see that their addresses are aligned (kernels/common.at)
_NARROW_GLOBAL = re.compile(r"\b(?:ld|st)\.global(?:\.[A-Za-z0-9_:]+)*?\.[bsu](?:8|16)\b")


# global stores with an L2 cache policy (``tl.store(..., eviction_policy=...)``: PTX's
# createpolicy operand): decode pieces' stores (kernels/common.DECODE_STORE_EVICT)
_HINTED_STORE = re.compile(r"\bst\.global\S*\.L2::cache_hint\b")


def _facts(compiled: dict) -> list[dict]:
    out = []
    for key, (name, kernel) in sorted(compiled.items()):
        md = kernel.metadata
        ptx = kernel.asm["ptx"]
        narrow = [m for m in _NARROW_GLOBAL.findall(ptx) if ".v2." not in m and ".v4." not in m]
        out.append(dict(kernel=key, name=name, num_warps=md.num_warps, num_stages=md.num_stages,
                        shared_bytes=md.shared, narrow_global=len(narrow),
                        hinted_stores=len(_HINTED_STORE.findall(ptx)),
                        **_sass_facts(kernel.asm["cubin"])))
    return out


def compile_quant_gemms(*, fmt: str = "fp8", hidden: int = 7168, intermediate: int = 2048,
                        block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                        num_stages: int = 3, capability: int = 90) -> list[dict]:
    """Compile the standalone quantized GEMMs for sm_90a through their launchers, one dict per
    kernel (as ``compile_layer``): ``fmt`` "fp8" (moestream.tools.fp8) or "fp4w"
    (moestream.tools.fp4, MXFP4 weights). Their MMAs show as QGMMA, not HGMMA."""
    import torch

    from .fp8 import pack_block_meta
    if fmt not in ("fp8", "fp4w"):
        raise ValueError(f"fmt must be 'fp8' or 'fp4w', got {fmt!r}")
    fp8, u8 = torch.float8_e4m3fn, torch.uint8
    compiled: dict[str, tuple] = {}
    with _compile_only(capability, compiled, [""]):
        H, I, E, P = hidden, intermediate, 1, 2 * block_m
        meta = pack_block_meta([0, 0], [block_m, 1])
        kw = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        act = torch.empty(P, I, dtype=fp8)
        act_s = torch.empty(P, I // 128)
        l1_in = dict(pool_x_q=torch.empty(P, H, dtype=fp8), pool_x_scale=torch.empty(P, H // 128),
                     block_meta=meta, pool_weight=torch.empty(P), act_q=act, act_scale=act_s)
        l2_in = dict(act_q=act, act_scale=act_s, block_meta=meta)
        if fmt == "fp8":
            from .fp8 import l1_fp8, l2_fp8
            l1_fp8(w13_q=torch.empty(E, 2 * I, H, dtype=fp8),
                   w13_scale_inv=torch.empty(E, 2 * I // 128, H // 128), **l1_in, **kw)
            l2_fp8(w2_q=torch.empty(E, H, I, dtype=fp8),
                   w2_scale_inv=torch.empty(E, H // 128, I // 128), **l2_in, **kw)
        else:
            from .fp4 import l1_fp4w, l2_fp4w
            l1_fp4w(w13_packed=torch.empty(E, 2 * I, H // 2, dtype=u8),
                    w13_scale=torch.zeros(E, 2 * I, H // 32, dtype=u8), **l1_in, **kw)
            l2_fp4w(w2_packed=torch.empty(E, H, I // 2, dtype=u8),
                    w2_scale=torch.zeros(E, H, I // 32, dtype=u8), **l2_in, **kw)
    return _facts(compiled)


def compile_layer(*, shape: str = "dsv3", capability: int = 90,
                  variants: dict[str, dict] | None = None) -> list[dict]:
    """Run the staged and the fused path (token and chunked mode) of a small call of
    ``shape`` with launches replaced by compile-only calls, then both paths in fp8 (kernels
    labelled " fp8"); one dict per distinct compiled kernel. ``variants``: name ->
    ``Tuning`` fields (dotted names), each also compiled (fused path)."""
    import torch

    from ..buffer import SymmBuffer
    from ..config import MoEConfig
    from ..fused import run_fused
    from ..staged import run_staged
    from ..testing import make_routing, make_tokens
    from ..tuning import ONE_DOT_L1_STAGES, for_fused, gpu_defaults, in_decode_pieces

    compiled: dict[str, tuple] = {}
    label = [""]
    with _compile_only(capability, compiled, label):
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=16)
        tuning = gpu_defaults(cfg).with_(use_tma=True)   # as on H200
        gen = torch.Generator().manual_seed(0)
        for ranks in (1, 2):   # one local rank (the real form's fused path), two (virtual)
            buf = SymmBuffer(cfg, num_ranks=ranks, device="cpu")
            w13s, w2s = _tiny_weights(cfg, ranks)
            xs = [make_tokens(8, cfg.hidden, generator=gen) for _ in range(ranks)]
            rts = [make_routing(8, cfg.num_experts, cfg.top_k, generator=gen) for _ in range(ranks)]
            y = torch.empty(ranks, 8, cfg.hidden, dtype=torch.bfloat16)
            args = (buf, xs, [r[0] for r in rts], [r[1] for r in rts], w13s, w2s, y)
            run_staged(*args, tuning=tuning)
            run_fused(*args, tuning=tuning)
            trace = torch.empty(8, 8, dtype=torch.int64)
            run_fused(*args, tuning=tuning, trace=trace)
            label[0] = " gpu-default"   # the fused launch's GPU defaults (132 SMs)
            run_fused(*args, tuning=for_fused(tuning, cfg, sms=132))
            label[0] = " chunked"
            run_fused(*args, tuning=tuning, granularity=2 * cfg.block_m)
            for name, fields in (variants or {}).items():
                label[0] = f" {name}"
                run_fused(*args, tuning=tuning.with_dotted(fields))
            if ranks == 1:
                label[0] = " tail"   # tail pieces in both GEMMs (tuning.select's mid sizes)
                run_staged(*args, tuning=tuning.with_(l1=dict(tail_rows=32),
                                                      l2=dict(tail_rows=32)))
                label[0] = " grouped"   # L1 tickets in groups of m-blocks (mixtral-sized I)
                run_staged(*args, tuning=tuning.with_(l1=dict(group_m=8)))
                label[0] = " l2 128"   # hidden not a multiple of 256: the 128x128 L2 tile
                narrow = gpu_defaults(cfg.with_(hidden=128, intermediate=128))
                run_staged(*args, tuning=narrow.with_(use_tma=True))
                label[0] = " one dot"   # the L1's gate and up as one MMA (large calls)
                run_staged(*args, tuning=tuning.with_(l1=dict(one_dot=True)))
                label[0] = " one dot s3"   # ... in 3 stages, as select picks from hidden 4096
                run_staged(*args, tuning=tuning.with_(l1=dict(
                    one_dot=True, one_dot_stages=ONE_DOT_L1_STAGES)))
                # the staged GEMMs as a CUDA graph capture launches them: the descriptors
                # built on the host (Tuning.host_descriptors), whole tiles and decode pieces
                label[0] = " host"
                run_staged(*args, tuning=tuning.with_(host_descriptors=True))
                label[0] = " decode host"
                run_staged(*args, tuning=in_decode_pieces(tuning, 16, cfg).with_(
                    host_descriptors=True))
                label[0] = " claim"   # whole tiles with claimed tickets (decode: default)
                run_staged(*args, tuning=tuning.with_(gemm_claim=True,
                                                      host_descriptors=True))
                label[0] = " fused host"
                run_fused(*args, tuning=for_fused(tuning, cfg, sms=132).with_(
                    host_descriptors=True))
                label[0] = " fused decode host"
                run_fused(*args, tuning=for_fused(in_decode_pieces(tuning, 16, cfg), cfg,
                                                  sms=132).with_(host_descriptors=True))
            label[0] = " decode"   # decode pieces, as select picks them for 1 token
            run_staged(*args, tuning=in_decode_pieces(tuning, 16, cfg))
            label[0] = " fused decode"   # ... and the fused launch's
            run_fused(*args, tuning=for_fused(in_decode_pieces(tuning, 16, cfg), cfg, sms=132))
            label[0] = ""
        # the fp8 layer (staged path): publish with quantization, byte-row dispatch, fp8 GEMMs
        label[0] = " fp8"
        cfg8 = cfg.with_(dtype="fp8")
        buf = SymmBuffer(cfg8, num_ranks=1, device="cpu")
        w13s, w2s = _tiny_weights(cfg8, 1)
        y = torch.empty(1, 8, cfg.hidden, dtype=torch.bfloat16)
        args = (buf, xs[:1], [rts[0][0]], [rts[0][1]], w13s, w2s, y)
        tuning8 = gpu_defaults(cfg8).with_(use_tma=True)   # as on H200
        run_staged(*args, tuning=tuning8)
        run_fused(*args, tuning=for_fused(tuning8, cfg8, sms=132))
        label[0] = " fp8 short k"   # intermediate < FP8_L2_TILE_MIN_I (qwen3): L2 in pieces
        short = gpu_defaults(cfg8.with_(intermediate=128))
        run_staged(*args, tuning=short.with_(use_tma=True))
        dec8 = in_decode_pieces(tuning8, 16, cfg8)
        label[0] = " fp8 decode"
        run_staged(*args, tuning=dec8)
        label[0] = " fp8 decode split"   # the L1's split-K parts (L1.split_k)
        run_staged(*args, tuning=dec8.with_(l1=dict(split_k=4)))
        label[0] = " fp8 decode split ptr"   # ... by pointer loads (a form the interpreter
        # accepts can still fail in the GPU compiler)
        run_staged(*args, tuning=dec8.with_(l1=dict(split_k=4), use_tma=False))
        label[0] = " fp8 fused decode"
        run_fused(*args, tuning=for_fused(dec8, cfg8, sms=132))
        label[0] = " fp8 tail"
        run_staged(*args, tuning=tuning8.with_(l1=dict(tail_rows=32), l2=dict(tail_rows=32)))
        label[0] = " fp8 decode host"
        run_staged(*args, tuning=dec8.with_(host_descriptors=True))
        label[0] = " fp8 grouped"
        run_staged(*args, tuning=tuning8.with_(l1=dict(group_m=8)))
        # the fp4w layer: fp8 rows, MXFP4 weights in 64-row / 16-row pieces, or expanded to
        # fp8 blocks for the fp8 GEMMs
        cfg4 = cfg.with_(dtype="fp4w")
        buf = SymmBuffer(cfg4, num_ranks=1, device="cpu")
        w13s, w2s = _tiny_weights(cfg4, 1)
        args = (buf, xs[:1], [rts[0][0]], [rts[0][1]], w13s, w2s, y)
        tuning4 = gpu_defaults(cfg4)
        label[0] = " fp4w"
        run_staged(*args, tuning=tuning4)
        label[0] = " fp4w decode"
        run_staged(*args, tuning=in_decode_pieces(tuning4, 16, cfg4))
        label[0] = " fp4w expand"
        run_staged(*args, tuning=tuning4.with_(fp4w_expand=True))
        label[0] = ""
    return _facts(compiled)


def compile_fused_forms(*, shapes: tuple[str, ...] = ("qwen3", "mixtral", "dsv3", "v4flash"),
                        dtypes: tuple[str, ...] = ("bf16", "fp8"),
                        tokens: tuple[int, ...] = (1, 8, 64, 512, 2048, 8192),
                        ranks: tuple[int, ...] = (1, 2), capability: int = 90) -> list[dict]:
    """Compile the fused kernel in every form ``tuning.select`` picks on an H200 (132 SMs) for
    ``shapes`` x ``dtypes`` x ``tokens`` per rank x ``ranks`` virtual ranks on one GPU (dsv3
    and v4flash with 32 experts, one EP8 rank's share), in-kernel and host-built descriptors;
    one dict per distinct compiled form (as ``compile_layer``'s) with ``users``, the calls
    that launch it."""
    import torch

    from ..buffer import SymmBuffer
    from ..config import MoEConfig
    from ..fused import run_fused
    from ..testing import make_routing, make_tokens
    from ..tuning import Device, select

    compiled: dict[str, tuple] = {}
    label = [""]
    gen = torch.Generator().manual_seed(0)
    with _compile_only(capability, compiled, label):
        for shape in shapes:
            for dtype in dtypes:
                cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=16, dtype=dtype)
                if shape in ("dsv3", "v4flash"):
                    cfg = cfg.with_(num_experts=32)
                for R in ranks:
                    buf = SymmBuffer(cfg, num_ranks=R, device="cpu")
                    w13s, w2s = _tiny_weights(cfg, R)
                    xs = [make_tokens(8, cfg.hidden, generator=gen) for _ in range(R)]
                    rts = [make_routing(8, cfg.num_experts, cfg.top_k, generator=gen)
                           for _ in range(R)]
                    y = torch.empty(R, 8, cfg.hidden, dtype=torch.bfloat16)
                    args = (buf, xs, [r[0] for r in rts], [r[1] for r in rts], w13s, w2s, y)
                    for T in tokens:
                        t = select(cfg.with_(max_tokens_per_rank=T), T, ranks=R,
                                   device=Device(132, True), impl="fused").with_(use_tma=True)
                        for host in (False, True) if R == 1 else (False,):
                            label[0] = f" {shape} {dtype} T={T} R={R}" + (" host" * host)
                            run_fused(*args, tuning=t.with_(host_descriptors=host))
    users: dict[str, list[str]] = {}   # compiled kernel hash -> its calls
    first: dict[str, tuple] = {}
    for key, (name, kernel) in compiled.items():
        if name == "fused_kernel":
            users.setdefault(kernel.hash, []).append(key.split("] ", 1)[1])
            first.setdefault(kernel.hash, (key, (name, kernel)))
    rows = _facts(dict(first.values()))
    by_key = {key: h for h, (key, _) in first.items()}
    return [dict(row, users=users[by_key[row["kernel"]]]) for row in rows]


def _tiny_weights(cfg, ranks):
    """Weight tensors of the right shapes without drawing GBs of random numbers (the
    compiler only looks at their types and alignment)."""
    import torch
    e_loc = cfg.experts_per_rank(ranks)
    H, I = cfg.hidden, cfg.intermediate
    if cfg.dtype == "fp4w":   # zero E8M0 codes: the layer's code check reads them
        u8 = torch.uint8
        w13 = (torch.empty(e_loc, 2 * I, H // 2, dtype=u8), torch.zeros(e_loc, 2 * I, H // 32,
                                                                        dtype=u8))
        w2 = (torch.empty(e_loc, H, I // 2, dtype=u8), torch.zeros(e_loc, H, I // 32, dtype=u8))
        return [w13] * ranks, [w2] * ranks
    if cfg.dtype == "fp8":
        fp8 = torch.float8_e4m3fn
        w13 = (torch.empty(e_loc, 2 * I, H, dtype=fp8), torch.empty(e_loc, 2 * I // 128, H // 128))
        w2 = (torch.empty(e_loc, H, I, dtype=fp8), torch.empty(e_loc, H // 128, I // 128))
        return [w13] * ranks, [w2] * ranks
    w13 = torch.empty(e_loc, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.empty(e_loc, H, I, dtype=torch.bfloat16)
    return [w13] * ranks, [w2] * ranks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="dsv3")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--fp8", action="store_true",
                   help="the standalone fp8 GEMMs instead (dsv3 dims unless given below)")
    p.add_argument("--fp4w", action="store_true",
                   help="the standalone MXFP4-weight GEMMs instead (as --fp8)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--fused-forms", action="store_true",
                   help="the fused kernel in every form the tuning policy picks for "
                        "--shapes x --dtypes x --tokens x --ranks (slow: about 80 compiles "
                        "by default), with the calls that use each")
    p.add_argument("--shapes", default="qwen3,mixtral,dsv3,v4flash", help="--fused-forms")
    p.add_argument("--dtypes", default="bf16,fp8", help="--fused-forms")
    p.add_argument("--tokens", default="1,8,64,512,2048,8192",
                   help="--fused-forms: tokens per rank")
    p.add_argument("--ranks", default="1,2", help="--fused-forms: virtual ranks on one GPU")
    p.add_argument("--loops", action="store_true",
                   help="also list each kernel's innermost loops with MMAs (the K loops)")
    args = p.parse_args(argv)
    if args.fp8 or args.fp4w:
        rows = compile_quant_gemms(fmt="fp4w" if args.fp4w else "fp8", hidden=args.hidden,
                                   intermediate=args.intermediate, block_m=args.block_m,
                                   block_n=args.block_n, num_warps=args.warps,
                                   num_stages=args.stages)
    elif args.fused_forms:
        rows = compile_fused_forms(shapes=tuple(args.shapes.split(",")),
                                   dtypes=tuple(args.dtypes.split(",")),
                                   tokens=tuple(int(t) for t in args.tokens.split(",")),
                                   ranks=tuple(int(r) for r in args.ranks.split(",")))
    else:
        rows = compile_layer(shape=args.shape)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['kernel']:34s} smem {r['shared_bytes']:>7d}  regs {r['registers']}  "
                  f"stack {r['stack_bytes']}  HGMMA {r['hgmma']}  QGMMA {r['qgmma']}  "
                  f"HMMA {r['hmma']}  sass {r['sass_hash']}")
            if args.fused_forms:
                print(f"    used by: {', '.join(r['users'])}")
            if args.loops:
                for lp in r["loops"]:
                    if lp["mma"]:
                        print(f"    loop at {lp['start']:#07x}: {lp['instructions']} "
                              f"instructions, {lp['mma']} MMA, {lp['local_ops']} STL/LDL")
    too_big = [r["kernel"] for r in rows if r["shared_bytes"] > SM90_SHARED_LIMIT]
    if too_big:
        print(f"shared memory above the sm_90 limit: {too_big}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
