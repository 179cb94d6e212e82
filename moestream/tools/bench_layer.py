"""Decoder-layer benchmark: one transformers MoE decoder layer, its own experts vs moestream's.

    moestream bench-layer                                  # Qwen3-MoE layer, every GPU, EP = GPUs
    moestream bench-layer --family mixtral,deepseek_v3 --decode 1,64 --prefill 2048 \\
        --out benchmarks/results/h200x2/hf_layer.jsonl

What is timed: the forward of ONE decoder layer of a transformers model (input RMSNorm,
transformers' attention with rotary embeddings, residual, post-attention RMSNorm, the sparse MoE
block with its router and, for DeepSeek-V3, its shared expert, residual), built from the
family's transformers config at the real model's sizes, random bf16 weights on the GPU:

- ``transformers``: the layer as transformers runs it, every expert on this GPU (the experts
  implementation transformers picks by default: ``grouped_mm`` on Hopper with torch >= 2.9).
  What each GPU does today when it holds the whole model.
- ``transformers-eager``: the same with transformers' per-expert Python loop.
- ``moestream``: the same layer after ``replace_moe_blocks(model, group=WORLD)``: only its
  routed experts change; they are split over the GPUs (EP = number of GPUs, rank r holds
  experts [r*E/R, (r+1)*E/R)) and every call is a collective one.
- ``transformers-graph``, ``moestream-graph`` (opt-in, not yet run on a GPU): the same calls
  captured once per input set in a CUDA graph and replayed, as inference engines run decode
  steps (a capture that fails on any rank skips that provider at that point, on every rank).

Token shapes, per rank (every rank passes its own random hidden states of the same shape):

- decode: ``[B, 1, H]`` for B in ``--decode`` (default 1, 8, 32, 64): one new token for each of
  B sequences, **without a KV cache**: the attention sees only the new token, so its cost is
  the projections, norms and rotary embedding, not the read of a long context. That read is
  identical in both variants (it adds the same time to both) and would need a cache that
  grows with every timed call; it is left out on purpose.
- prefill: ``[1, S, H]`` for S in ``--prefill`` (default 2048), causal attention (SDPA with
  ``is_causal``, no mask tensor).

Sizes (hidden H, expert width I, experts E, top-k K; attention): Qwen3-30B-A3B (2048, 768, 128,
8; 32 query / 4 KV heads of 128), Mixtral-8x7B (4096, 14336, 8, 2; 32 / 8 heads of 128),
DeepSeek-V3 (7168, 2048, 256, 8, one shared expert, group-limited routing 8 groups / top 4;
MLA attention with 128 heads, q_lora_rank 1536, kv_lora_rank 512, rope/nope/v dims 64/128/128).
Every GPU holds the whole original layer and its EP copy's share: DeepSeek-V3 with 256 experts
needs about 34 GB per GPU in bf16 (46 GB while the copy is made, before its experts are split)
plus the buffers (about 2 GB at 2048 tokens); ``--experts``
lowers E (Qwen3: 1.2 GB of experts, Mixtral: 2.8 GB). The plain rotary embedding is used (no
YaRN scaling; it costs the same either way). The vocabulary is cut to 256 (the embedding and
head are not part of the layer).

Protocol: the weights are the same on every rank (broadcast from rank 0), every
point first checks that the two variants agree (relative error of the MoE block's output and of
the layer's output on the same inputs <= 2e-2, the tolerance of the integration's tests, on
every rank; a point that fails is reported and not timed), then each provider is timed with
CUDA events (``moestream.tools.bench.time_cuda``: warm-up, median and p20/p80 of ``--reps`` calls,
inputs rotated over 4 sets), every rank timing every call; the slowest rank is reported. The
first call of each provider (which compiles the kernels) is timed separately and printed.
Rows are appended as JSON lines to ``--out``; ``--plot`` saves a PNG of time vs tokens per rank.
"""
from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Sequence

__all__ = ["FAMILIES", "PROVIDERS", "DEFAULT_PROVIDERS", "TOL", "layer_config",
           "bench_layer_worker", "run_layer_bench", "add_arguments", "run_cli", "main"]

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
_BASE_PROVIDERS = ("transformers", "transformers-eager", "moestream")
# transformers' eager experts loop synchronises with the host (nonzero): it has no graph form
PROVIDERS = _BASE_PROVIDERS + ("transformers-graph", "moestream-graph")
DEFAULT_PROVIDERS = ("transformers", "moestream")
TOL = 2e-2        # the integration tests' bf16 tolerance (tests/layer/test_integrations_transformers.py)
INPUT_SETS = 4
_VOCAB = 256
_MODEL_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM"}


# ---- configs ------------------------------------------------------------------------------

def _check_experts(family: str, experts: int, top_k: int) -> None:
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < top_k:
        raise ValueError(f"{family}: experts must be an int >= top_k ({top_k}), got {experts!r}")
    if family == "deepseek_v3" and (experts % 8 or experts < 16):
        raise ValueError(f"deepseek_v3: experts must be a multiple of its 8 routing groups with "
                         f"at least 2 per group (>= 16), got {experts}")


def layer_config(family: str, *, experts: int | None = None, tiny: bool = False):
    """The transformers config of a 1-layer model of ``family`` whose layer 0 is an MoE layer.

    Real sizes (see the module docstring) unless ``tiny`` (hidden 256, the integration tests'
    tiny models: a CPU check of this benchmark's code). ``experts`` overrides E.
    """
    import transformers as tf
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if tiny:
        from ..integrations.tiny import tiny_config
        over = dict(num_hidden_layers=1)
        if family == "qwen3_moe":
            over["mlp_only_layers"] = []
        if family == "deepseek_v3":
            over["first_k_dense_replace"] = 0
        if experts is not None:
            _check_experts(family, experts, 2)
            over["n_routed_experts" if family == "deepseek_v3" else
                 "num_local_experts" if family == "mixtral" else "num_experts"] = experts
        return tiny_config(family, single_moe_layer=False, **over)
    common = dict(num_hidden_layers=1, vocab_size=_VOCAB, max_position_embeddings=32768,
                  rms_norm_eps=1e-6)
    if family == "qwen3_moe":
        e = 128 if experts is None else experts
        _check_experts(family, e, 8)
        cfg = tf.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                num_experts=e, num_experts_per_tok=8, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[], **common)
    elif family == "mixtral":
        e = 8 if experts is None else experts
        _check_experts(family, e, 2)
        cfg = tf.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, num_local_experts=e,
                               num_experts_per_tok=2, **common)
    else:
        e = 256 if experts is None else experts
        _check_experts(family, e, 8)
        cfg = tf.DeepseekV3Config(hidden_size=7168, intermediate_size=18432,
                                  moe_intermediate_size=2048, num_attention_heads=128,
                                  num_key_value_heads=128, n_routed_experts=e, n_shared_experts=1,
                                  num_experts_per_tok=8, n_group=8, topk_group=4,
                                  routed_scaling_factor=2.5, norm_topk_prob=True,
                                  first_k_dense_replace=0, q_lora_rank=1536, kv_lora_rank=512,
                                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                  **common)
    # O(1) activations (as the tests' tiny models): the experts' output is a large part of the
    # layer's output, so the agreement check sees the experts rather than the residual.
    cfg.initializer_range = cfg.hidden_size ** -0.5
    return cfg


def _moe_sizes(cfg) -> dict[str, int]:
    e = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_local_experts", None) \
        or cfg.num_experts
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return dict(hidden=cfg.hidden_size, intermediate=inter, experts=e,
                top_k=cfg.num_experts_per_tok)


# ---- the worker ---------------------------------------------------------------------------

def _points(decode: Sequence[int], prefill: Sequence[int]) -> list[tuple[str, int, int]]:
    return [("decode", b, 1) for b in decode] + [("prefill", 1, s) for s in prefill]


def _build(family: str, spec: dict, dev, group, world: int):
    """The original 1-layer model (bf16, on ``dev``, the same weights on every rank) and a copy
    whose MoE block runs on moestream."""
    import torch
    import torch.distributed as dist
    import transformers as tf

    from ..integrations.transformers import replace_moe_blocks

    cfg = layer_config(family, experts=spec.get("experts"), tiny=spec.get("tiny", False))
    torch.manual_seed(spec["seed"])
    with torch.device(dev):
        model = getattr(tf, _MODEL_CLASSES[family])._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # zeros after init: exercise it
                buf.normal_(0.0, 0.1)
        if world > 1:   # one set of weights for every rank (EP's experts are their union)
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0, group=group)
    ours = copy.deepcopy(model)
    tokens = max(b * s for _, b, s in _points(spec["decode"], spec["prefill"]))
    replace_moe_blocks(ours, group=group, buffer_tokens=max(tokens, 16),
                       block_m=spec.get("block_m"))
    return cfg, model, ours


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _gather(obj: Any, world: int) -> list:
    import torch.distributed as dist
    if world == 1 or not dist.is_initialized():
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _barrier(world: int) -> None:
    import torch.distributed as dist
    if world > 1 and dist.is_initialized():
        dist.barrier()


def bench_layer_worker(rank: int, world: int, spec: dict) -> dict:
    """One rank (spawned, one per GPU; or called directly with world 1 and device "cpu").

    spec: families, decode, prefill, providers, reps, warmup, seed, experts (None: the real
    count), device ("cuda": this rank's GPU; "cpu": the CPU check, kernels in Triton's
    interpreter, timed with perf_counter), tiny (tiny configs), block_m (None: the default),
    progress (a rich progress bar on rank 0).

    Returns {"rows": [...], "failures": [...]}: rank 0's rows (others: empty), and the points
    whose variants disagreed (not timed).
    """
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
    group = dist.group.WORLD if dist.is_initialized() else None
    points = _points(spec["decode"], spec["prefill"])
    out: dict[str, list] = dict(rows=[], failures=[])
    progress = None
    say = print if rank == 0 else (lambda *a, **k: None)
    advance = lambda: None  # noqa: E731
    if rank == 0 and spec.get("progress", True):
        from .terminal import progress as make_progress
        progress = make_progress()
        progress.start()
        task = progress.add_task("layer bench", total=len(spec["families"]) * len(points))
        say = progress.console.print
        advance = lambda: progress.advance(task)  # noqa: E731
    try:
        for family in spec["families"]:
            # one function call per family: its models, buffers and graphs are freed on return
            _bench_family(family, spec, rank, world, dev, group, points, out, say, advance)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if progress is not None:
            progress.stop()
    return out


def _bench_family(family, spec, rank, world, dev, group, points, out, say, advance) -> None:
    import torch

    from ..integrations.transformers import MegaMoEExperts
    from ..testing import rel_error

    tol = spec.get("tol", TOL)
    cfg, model, ours = _build(family, spec, dev, group, world)
    sizes = _moe_sizes(cfg)
    impl = getattr(model.config, "_experts_implementation", None) or "eager"
    attn = getattr(model.config, "_attn_implementation", None)
    say(f"{family}: H={sizes['hidden']} I={sizes['intermediate']} E={sizes['experts']} "
        f"K={sizes['top_k']}, EP={world}, attention {attn}, transformers experts {impl}")
    layers = {"transformers": model.model.layers[0], "moestream": ours.model.layers[0]}
    gen = torch.Generator(device=dev).manual_seed(spec["seed"] * 1000 + 17 + rank)
    for phase, B, S in points:
        where = f"{family} {phase} {B}x{S}"
        sets = [torch.randn(B, S, sizes["hidden"], generator=gen, device=dev,
                            dtype=torch.bfloat16) for _ in range(INPUT_SETS)]
        pos = torch.arange(S, device=dev).expand(B, S)
        with torch.inference_mode():
            pe = model.model.rotary_emb(sets[0], pos)

        def run(layer, x, pos=pos, pe=pe):
            y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
            return y[0] if isinstance(y, tuple) else y

        # Agreement first: the same inputs through both variants (the MoE block's output seen
        # through a hook); the worst rank decides for every rank, as the calls are collective.
        moe_out, outs, first_s = {}, {}, {}
        with torch.inference_mode():
            for name, layer in layers.items():
                h = layer.mlp.register_forward_hook(
                    lambda m, a, o, name=name: moe_out.__setitem__(name, o))
                t0 = time.perf_counter()
                outs[name] = run(layer, sets[0])
                _sync(dev)
                first_s[name] = time.perf_counter() - t0
                h.remove()
        every = _gather((rel_error(moe_out["moestream"], moe_out["transformers"]),
                         rel_error(outs["moestream"], outs["transformers"])), world)
        moe_out = outs = None
        err_moe, err_layer = max(e[0] for e in every), max(e[1] for e in every)
        say(f"{where}: first calls " + ", ".join(f"{n} {s:.2f}s" for n, s in first_s.items())
            + f"; moestream vs transformers: MoE block {err_moe:.1e}, layer {err_layer:.1e} "
              f"(worst rank)")
        if not (err_moe <= tol and err_layer <= tol):
            msg = (f"{where}: moestream and transformers disagree (MoE block {err_moe:.2e}, "
                   f"layer {err_layer:.2e} > {tol}); not timed")
            out["failures"].append(msg)
            say(msg)
            advance()
            continue
        medians: dict[str, float] = {}
        point_rows: list[dict] = []
        for p in spec["providers"]:
            base = p.removesuffix("-graph")
            layer = layers["moestream" if base == "moestream" else "transformers"]
            stats, note = _time_provider(p, model, layer, run, sets, dev, world, spec, impl)
            if stats is None:
                say(f"{where} {p}: skipped ({note})")
                continue
            medians[p] = stats["median_us"]
            say(f"{where} {p}: {stats['median_us']:.1f} us")
            if rank == 0:
                point_rows.append(_row(
                    family, world, phase, B, S, p, stats, sizes, attn,
                    experts_impl={"transformers-eager": "eager", "moestream": "moestream"}.get(
                        base, impl),
                    rel_error_moe=err_moe, rel_error_layer=err_layer,
                    first_call_s=first_s.get(base)))
        for r in point_rows:
            if "transformers" in medians:
                r["speedup_vs_transformers"] = medians["transformers"] / r["median_us"]
        out["rows"] += point_rows
        advance()
    for m in ours.modules():          # collective: every rank frees its buffers together
        if isinstance(m, MegaMoEExperts):
            m.moe.destroy()


def _row(family, world, phase, B, S, provider, stats, sizes, attn, **extra) -> dict:
    from .bench import result_row
    return result_row(shape=f"{family}-layer", ranks=world, tokens_per_rank=B * S, dtype="bf16",
                      provider=provider, median_us=stats["median_us"], p20_us=stats["p20_us"],
                      p80_us=stats["p80_us"], tflops_per_gpu=None, link_gbps=None,
                      floor_us=None, slowest_rank=stats.get("slowest_rank", 0),
                      clock=stats["clock"], phase=phase, batch=B, seq=S, **sizes,
                      attn_impl=attn, **extra)


def _time_provider(provider, model, layer, run, sets, dev, world, spec, impl):
    """(stats of the slowest rank, "") or (None, why it was skipped). Every rank calls it."""
    import torch

    from .bench import slowest, time_cuda
    eager = provider.removesuffix("-graph") == "transformers-eager"
    if eager:
        model.set_experts_implementation("eager")
    try:
        with torch.inference_mode():
            fn, rotate, note = _timed_fn(provider, layer, run, sets, dev, world)
            if fn is None:
                return None, note
            _barrier(world)
            return slowest(time_cuda(fn, warmup=spec["warmup"], reps=spec["reps"],
                                     rotate=rotate)), ""
    finally:
        if eager:
            model.set_experts_implementation(impl)


def _timed_fn(provider: str, layer, run, sets, dev, world: int):
    """(fn, rotate, note) for time_cuda: eager calls rotate over the input sets; graph
    providers capture one CUDA graph per set (after a warm-up call) and replay it. A capture
    that fails on any rank skips the provider on every rank (fn None, note says why)."""
    import torch
    if not provider.endswith("-graph"):
        return (lambda x: run(layer, x)), sets, ""
    if dev.type != "cuda":
        return None, None, "CUDA graphs need a GPU"
    graphs, error = [], ""
    try:
        for x in sets:
            run(layer, x)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run(layer, x)
            graphs.append(g)
    except Exception as exc:  # noqa: BLE001 - reported, and every rank skips alike
        error = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    errors = [e for e in _gather(error, world) if e]
    if errors:
        return None, None, errors[0]
    return (lambda i: graphs[i].replay()), list(range(len(graphs))), ""


# ---- running it ---------------------------------------------------------------------------

def _positive_ints(name: str, values: Sequence[int], *, allow_empty: bool = True) -> list[int]:
    vals = list(values)
    if not allow_empty and not vals:
        raise ValueError(f"{name} must not be empty")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be positive ints, got {v!r}")
    return vals


def _validate(*, families, decode, prefill, providers, reps, warmup, experts) -> dict:
    families = list(families)
    if not families:
        raise ValueError("families must not be empty")
    for f in families:
        if f not in FAMILIES:
            raise ValueError(f"unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    decode = _positive_ints("decode batch sizes", decode)
    prefill = _positive_ints("prefill lengths", prefill)
    if not decode and not prefill:
        raise ValueError("give at least one decode batch size or prefill length")
    providers = list(dict.fromkeys(providers))
    for p in providers:
        if p not in PROVIDERS:
            raise ValueError(f"unknown provider {p!r}; choose from {', '.join(PROVIDERS)}")
    if not providers:
        raise ValueError("providers must not be empty")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int)
                                or experts <= 0):
        raise ValueError(f"experts must be a positive int, got {experts!r}")
    return dict(families=families, decode=decode, prefill=prefill, providers=providers,
                reps=reps, warmup=warmup, experts=experts)


def run_layer_bench(*, families: Sequence[str] = ("qwen3_moe",),
                    decode: Sequence[int] = (1, 8, 32, 64), prefill: Sequence[int] = (2048,),
                    providers: Sequence[str] = DEFAULT_PROVIDERS, reps: int = 20,
                    warmup: int = 5, experts: int | None = None, world: int | None = None,
                    seed: int = 0, device: str = "cuda", tiny: bool = False,
                    block_m: int | None = None, progress: bool = True,
                    timeout_s: float = 1800) -> dict:
    """Run the benchmark: one process per GPU (EP = ``world``, default every GPU), or, with
    ``device="cpu"`` (tests), one rank in this process. Returns {"rows", "failures"}.

    Raises ValueError for bad arguments (including experts that do not split over the ranks).
    """
    import torch
    spec = _validate(families=families, decode=decode, prefill=prefill, providers=providers,
                     reps=reps, warmup=warmup, experts=experts)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cpu":
        if world not in (None, 1):
            raise ValueError("device='cpu' runs one rank in this process (world=1)")
        world = 1
    else:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError("the layer benchmark needs CUDA GPUs (none visible)")
        world = gpus if world is None else world
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= gpus:
            raise ValueError(f"world must be an int in [1, {gpus}] (visible GPUs), got {world!r}")
    for f in spec["families"]:
        e = _moe_sizes(layer_config(f, experts=spec["experts"], tiny=tiny))["experts"]
        if e % world:
            raise ValueError(f"{f}: {e} experts do not split over {world} ranks; pass --experts "
                             f"with a multiple of {world}")
    spec.update(seed=seed, device=device, tiny=tiny, block_m=block_m, progress=progress)
    if device == "cpu":
        return bench_layer_worker(0, 1, spec)
    from .distributed import spawn
    res = spawn(bench_layer_worker, world_size=world, backend="nccl", args=(spec,),
                timeout_s=timeout_s)
    return res[0]


def report(rows: list[dict], *, out: str | None, plot: str | None, console=None,
           title: str = "") -> None:
    """Write the rows into ``out`` (JSON lines, ``bench.update_rows``), plot them to ``plot``
    (PNG), print the table."""
    from .bench import plot_rows, print_table, update_rows
    show = console.print if console is not None else print
    if out and rows:
        update_rows(out, rows)
        show(f"{len(rows)} rows written to {out}")
    if plot and rows:
        plot_rows(rows, plot, title=title)
        show(f"plot saved to {plot}")
    print_table(rows, title=title or "moestream bench-layer", console=console,
                columns=["shape", "phase", "tokens_per_rank", "provider", "median_us", "p20_us",
                         "p80_us", "speedup_vs_transformers", "rel_error_moe"])


# ---- command line -------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``moestream bench-layer``."""
    from .terminal import names_from, nonnegative_int, positive_int, positive_ints
    p.add_argument("--family", type=names_from(FAMILIES), default=["qwen3_moe"],
                   help=f"model families, comma-separated, from {', '.join(FAMILIES)} "
                        f"(default qwen3_moe)")
    p.add_argument("--decode", type=positive_ints, default=[1, 8, 32, 64],
                   help="decode batch sizes: [B, 1, H] per rank (default 1,8,32,64)")
    p.add_argument("--prefill", type=positive_ints, default=[2048],
                   help="prefill lengths: [1, S, H] per rank (default 2048)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode points")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill points")
    p.add_argument("--providers", type=names_from(PROVIDERS), default=list(DEFAULT_PROVIDERS),
                   help=f"from {', '.join(PROVIDERS)} (default "
                        f"{','.join(DEFAULT_PROVIDERS)})")
    p.add_argument("--experts", type=positive_int, default=None,
                   help="routed experts E (default: the real model's; lower it to fit memory)")
    p.add_argument("--ranks", type=positive_int, default=None,
                   help="GPUs / EP ranks (default: all)")
    p.add_argument("--reps", type=positive_int, default=20,
                   help="timed calls per point (default 20)")
    p.add_argument("--warmup", type=nonnegative_int, default=5,
                   help="untimed calls first (default 5)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", default=None, help="JSON-lines file the rows are appended to "
                                               "(default benchmarks/results/<machine>/"
                                               "hf_layer.jsonl)")
    p.add_argument("--plot", default=None, help="PNG of time vs tokens per rank")


def run_cli(args: argparse.Namespace, console=None) -> int:
    """``moestream bench-layer``: 0 when every point agreed and was timed, 1 when a point's
    variants disagreed, 2 for a usage error or a machine without CUDA."""
    import torch
    from .terminal import console as make_console
    con = console or make_console()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        con.print("[red]moestream bench-layer needs CUDA GPUs[/] (none visible); the CPU tests "
                  "(tests/layer/test_integrations_transformers.py) cover its code on tiny models")
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        con.print("[red]moestream bench-layer needs Hugging Face transformers[/] "
                  "(pip install 'moestream[hf]')")
        return 2
    try:
        res = run_layer_bench(families=args.family, decode=[] if args.no_decode else args.decode,
                              prefill=[] if args.no_prefill else args.prefill,
                              providers=args.providers, reps=args.reps, warmup=args.warmup,
                              experts=args.experts, world=args.ranks, seed=args.seed)
    except ValueError as exc:
        con.print(f"[red]moestream bench-layer: {exc}[/]")
        return 2
    n = torch.cuda.device_count() if args.ranks is None else args.ranks
    from .bench import results_path
    out = args.out or results_path("hf_layer", num_gpus=n)
    report(res["rows"], out=out, plot=args.plot, console=con,
           title=f"one decoder layer, EP{n}, {torch.cuda.get_device_name(0)}")
    for msg in res["failures"]:
        con.print(f"[red]{msg}[/]")
    return 1 if res["failures"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moestream.tools.bench_layer",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
