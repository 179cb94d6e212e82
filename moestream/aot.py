"""Compile every kernel of the layer for Hopper (sm_90a) on a machine without a GPU.

Triton's wheel carries ptxas and cuobjdump, so a CPU machine can compile the kernels exactly as
the layer launches them (the same Python path, arguments and constexprs, with launches turned
into compile-only calls) and read the machine code: shared memory, registers, stack (spills)
and whether the GEMMs use Hopper's warpgroup MMA (HGMMA in SASS). This catches errors that only
the GPU compiler sees (the interpreter accepts more), before any GPU time is spent.

    TRITON_INTERPRET=0 python -m moestream.aot [--shape dsv3] [--json]

Must run in a fresh process: it needs Triton in compiler mode (see moestream/kernels/_common.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["compile_layer", "main"]

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
    """Registers, stack and HGMMA count from the bundled cuobjdump."""
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
    return dict(registers=int(regs.group(1)) if regs else None,
                stack_bytes=int(stack.group(1)) if stack else None,
                hgmma=len(re.findall(r"\bHGMMA\b", sass)),
                hmma=len(re.findall(r"\bHMMA\b", sass)))


def compile_layer(*, shape: str = "dsv3", capability: int = 90,
                  variants: dict[str, dict] | None = None) -> list[dict]:
    """Run the staged and the fused path (token and chunked mode) of a small call of
    ``shape`` with launches replaced by compile-only calls; one dict per distinct compiled
    kernel. ``variants``: name -> ``stages.Tuning`` fields, each also compiled (fused path)."""
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise RuntimeError("set TRITON_INTERPRET=0 before importing triton/moestream")
    import torch
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from . import stages
    from .buffer import SymmBuffer
    from .config import MoEConfig
    from .testing import make_routing, make_tokens

    driver.set_active(_CompileOnlyDriver(capability))
    compiled: dict[str, tuple] = {}
    original_run = JITFunction.run
    label = [""]

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        key = f"{self.fn.__name__}[{kwargs.get('num_warps', 4)}w{kwargs.get('num_stages', 3)}s]"
        compiled.setdefault(key + label[0], (self.fn.__name__, kernel))

    JITFunction.run = compile_only
    try:
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=16)
        tuning = stages.Tuning.hopper(cfg.block_m)
        tuning = stages.Tuning(**{**tuning.__dict__, "use_tma": True})
        gen = torch.Generator().manual_seed(0)
        for ranks in (1, 2):   # one local rank (the real form's fused path), two (virtual)
            buf = SymmBuffer(cfg, num_ranks=ranks, device="cpu")
            w13s, w2s = _tiny_weights(cfg, ranks)
            xs = [make_tokens(8, cfg.hidden, generator=gen) for _ in range(ranks)]
            rts = [make_routing(8, cfg.num_experts, cfg.top_k, generator=gen) for _ in range(ranks)]
            y = torch.empty(ranks, 8, cfg.hidden, dtype=torch.bfloat16)
            args = (buf, xs, [r[0] for r in rts], [r[1] for r in rts], w13s, w2s, y)
            stages.run_staged(*args, tuning=tuning)
            stages.run_fused(*args, tuning=tuning)
            trace = torch.empty(8, 8, dtype=torch.int64)
            stages.run_fused(*args, tuning=tuning, trace=trace)
            label[0] = " gpu-default"   # the fused launch's GPU defaults (132 SMs)
            stages.run_fused(*args, tuning=tuning.for_fused(buf, sms=132))
            label[0] = " chunked"
            stages.run_fused(*args, tuning=tuning, granularity=2 * cfg.block_m)
            for name, fields in (variants or {}).items():
                label[0] = f" {name}"
                stages.run_fused(*args, tuning=stages.Tuning(**{**tuning.__dict__, **fields}))
            label[0] = ""
    finally:
        JITFunction.run = original_run
        driver._active = None   # back to "whatever the machine has" (reset_active needs one)
    out = []
    for key, (name, kernel) in sorted(compiled.items()):
        md = kernel.metadata
        out.append(dict(kernel=key, name=name, num_warps=md.num_warps, num_stages=md.num_stages,
                        shared_bytes=md.shared, **_sass_facts(kernel.asm["cubin"])))
    return out


def _tiny_weights(cfg, ranks):
    """Weight tensors of the right shapes without drawing GBs of random numbers (the
    compiler only looks at their types and alignment)."""
    import torch
    e_loc = cfg.experts_per_rank(ranks)
    w13 = torch.empty(e_loc, 2 * cfg.intermediate, cfg.hidden, dtype=torch.bfloat16)
    w2 = torch.empty(e_loc, cfg.hidden, cfg.intermediate, dtype=torch.bfloat16)
    return [w13] * ranks, [w2] * ranks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="dsv3")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    rows = compile_layer(shape=args.shape)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['kernel']:34s} smem {r['shared_bytes']:>7d}  regs {r['registers']}  "
                  f"stack {r['stack_bytes']}  HGMMA {r['hgmma']}  HMMA {r['hmma']}")
    too_big = [r["kernel"] for r in rows if r["shared_bytes"] > SM90_SHARED_LIMIT]
    if too_big:
        print(f"shared memory above the sm_90 limit: {too_big}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
