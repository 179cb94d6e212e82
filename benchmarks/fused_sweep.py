"""Sweep launch tunings of the fused kernel on the GPUs of this machine (EP = all of them).

Each variant is a set of ``moestream.tuning.Tuning`` overrides (dotted names) applied on top of
the fused launch's default for the call (``tuning.select``), written as ``NAME:field=value,...``
(the ``--tuning`` syntax of ``moestream bench``). Two names are built in: ``default`` (no
overrides) and ``staged`` (the staged path with its own default, for reference in the same
process). Every point is checked against the first variant's output (bf16 tolerance) before
it is timed as CUDA-graph replays (``moestream.tools.bench`` protocol: warm-up, median of >= 20
calls, inputs rotated over 4 sets, slowest rank). One process, one buffer per shape: many variants
cost one start-up.

    python benchmarks/fused_sweep.py --shapes qwen3,dsv3 --tokens 1,128 \
        --variants default staged wave264:fused.wave_blocks=264 --out fused_sweep.jsonl
"""
from __future__ import annotations

import argparse
import json
import torch

BUILT_IN = ("default", "staged")


def parse_variant(text: str) -> tuple[str, dict]:
    """``"wave264:fused.wave_blocks=264"`` -> ``("wave264", {"fused.wave_blocks": 264})``; the
    built-in names take no overrides. ValueError for a malformed variant or an unknown field."""
    from moestream.tools.bench_ep import parse_tuning
    name, colon, spec = text.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"variant {text!r} needs a name (NAME:field=value,...)")
    if name in BUILT_IN:
        if spec.strip():
            raise ValueError(f"the built-in variant {name!r} takes no overrides")
        return name, {}
    if not colon or not spec.strip():
        raise ValueError(f"variant {text!r}: write NAME:field=value,... (built-in: {BUILT_IN})")
    return name, parse_tuning(spec)


def _worker(rank, world, shapes, tokens, variants, reps, seed, out):
    import torch.distributed as dist

    from moestream import MoEConfig, SymmBuffer, mega_moe
    from moestream.launch import tuning_for
    from moestream.tools.bench import slowest, time_cuda
    from moestream.tools.bench_ep import _capture, _weights_and_inputs
    from moestream.testing import TOLERANCE, rel_error

    dev = torch.device("cuda", rank)
    rows = []
    for shape in shapes:
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens))
        buf = SymmBuffer(cfg, group=dist.group.WORLD)
        # the EP bench's weights and inputs (weights drawn on the device)
        for w13, w2, T, sets in _weights_and_inputs(cfg, world, rank, seed, tokens, dev, None):
            ref = None
            for name, over in variants:
                impl = "staged" if name == "staged" else "fused"
                tuning = (None if name == "staged" else
                          tuning_for(buf, T, impl="fused").with_dotted(over))
                graphs = _capture(sets, lambda a: mega_moe(a[0], a[1], a[2], w13, w2, buf,
                                                           impl=impl, tuning=tuning))
                # poisoned first: a variant that leaves rows unwritten cannot pass as the
                # first one's output left in memory the graphs share
                graphs[0][1].fill_(float("nan"))
                graphs[0][0].replay()
                torch.cuda.synchronize()
                buf.check()
                y = graphs[0][1].clone()
                err = 0.0 if ref is None else rel_error(y, ref)
                ref = y if ref is None else ref
                if not err <= TOLERANCE["bf16"]:
                    raise RuntimeError(f"{shape} T={T} variant {name}: output differs from the "
                                       f"first variant's by {err:.3g} (rel)")
                dist.barrier()
                st = slowest(time_cuda(lambda i: graphs[i][0].replay(), warmup=5, reps=reps,
                                       rotate=list(range(len(sets)))))
                buf.check()
                if rank == 0:
                    row = dict(shape=shape, ranks=world, tokens_per_rank=T, variant=name,
                               impl=impl, tuning=over, median_us=st["median_us"],
                               p20_us=st["p20_us"], p80_us=st["p80_us"],
                               rel_diff_vs_first=err)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with open(out, "a") as f:   # row by row: a run cut by a limit keeps them
                        f.write(json.dumps(row) + "\n")
                graphs = None
        buf.destroy()
        w13 = w2 = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from moestream.tools.cli import _ints, _names
    from moestream.tools.distributed import spawn
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_names, default=["qwen3", "dsv3"])
    p.add_argument("--tokens", type=_ints, default=[1, 128])
    p.add_argument("--variants", nargs="+", default=["default", "staged"],
                   help="NAME:field=value,... (Tuning overrides) or a built-in: default, staged")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/fused_sweep.jsonl")
    a = p.parse_args()
    try:
        variants = [parse_variant(v) for v in a.variants]
    except ValueError as e:
        raise SystemExit(f"--variants: {e}")
    if len({n for n, _ in variants}) != len(variants):
        raise SystemExit("--variants: names must differ")
    if not torch.cuda.is_available():
        raise SystemExit("the fused sweep needs CUDA GPUs")
    spawn(_worker, world_size=torch.cuda.device_count(), backend="nccl",
          args=(a.shapes, a.tokens, variants, a.reps, a.seed, a.out), timeout_s=3000)


if __name__ == "__main__":
    main()
