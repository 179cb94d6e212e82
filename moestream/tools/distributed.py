"""Helpers for multi-process runs: a local ``spawn`` that never hangs, and torchrun set-up.

``spawn`` is how tests and benchmarks run R ranks on one host (gloo on CPU, NCCL on GPUs)
without torchrun: every rank's return value comes back to the caller, and a failing or stuck
rank raises in the caller with that rank's traceback instead of leaving the others waiting
forever in a collective.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "init_from_env", "free_port", "BACKENDS"]

BACKENDS = ("gloo", "nccl")

# Seconds a rank that has stopped may take to flush its result through the queue before we
# call it lost; the queue's feeder thread flushes before the process exits, so this is slack.
_FLUSH_GRACE_S = 5.0
# Seconds to keep listening after a rank failed, to learn which rank failed first.
_ERROR_GRACE_S = 2.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(obj: Any) -> Any:
    # CUDA tensors would make the parent initialise CUDA (and pick a device) just to unpickle.
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if type(obj) in (list, tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _worker(rank: int, world_size: int, backend: str, port: int, timeout_s: float,
            fn: Callable[..., Any], args: tuple, results: Any) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # R ranks on one host share its cores; torch's default (all cores per process)
            # oversubscribes them and makes small CPU runs several times slower.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            # Pickled by value here (not through torch's shared-memory reductions), so the
            # result survives this process exiting before the parent reads it.
            payload = pickle.dumps(_to_cpu(fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            # Reported before the group is torn down: tearing it down makes the peers fail
            # too, and the parent uses the failure times to name the rank that failed first.
            results.put((rank, "error", traceback.format_exc().encode(), time.time()))
            return
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc().encode(), time.time()))
        return
    results.put((rank, "ok", payload, 0.0))


def _failure_message(errors: dict[int, tuple[bytes, float]], world_size: int) -> str:
    first = min(errors, key=lambda r: errors[r][1])
    tb = errors[first][0].decode(errors="replace")
    msg = f"spawn: rank {first} of {world_size} failed:\n{tb}"
    for r in sorted(set(errors) - {first}):
        last = errors[r][0].decode(errors="replace").strip().splitlines()[-1]
        msg += f"\nthen rank {r} failed too: {last}"
    return msg


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def spawn(fn: Callable[..., Any], *, world_size: int, backend: str, args: tuple = (),
          timeout_s: float = 300) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh local processes.

    Each process initialises the default process group (``backend`` "gloo" or "nccl", TCP
    rendezvous on a free localhost port; with "nccl" rank r uses ``cuda:r``), calls ``fn``
    and destroys the group. Under gloo, each process's torch thread count is set to
    cpu_count // world_size so R ranks do not oversubscribe the host's cores.

    Args:
        fn: a picklable (module-level) function ``fn(rank, world_size, *args)``.
        world_size: number of ranks, >= 1 (for nccl, at most the visible GPU count).
        backend: "gloo" or "nccl".
        args: extra picklable arguments passed to every rank.
        timeout_s: wall-clock limit of the whole run; also the process group's timeout.

    Returns:
        The ranks' return values, indexed by rank. They are pickled by value; tensors are
        moved to the CPU first (top level or inside plain lists, tuples and dicts).

    Raises:
        ValueError: bad ``world_size``/``backend``/``timeout_s``.
        RuntimeError: a rank raised (the message carries its traceback), died without
            reporting, or the run exceeded ``timeout_s``; the other ranks are killed.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, "
                             f"visible GPUs {n}")

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Not daemonic, so fn may start its own worker processes (daemons may not); the finally
    # below kills every rank however this function exits.
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(r, world_size, backend, port, timeout_s, fn, tuple(args), results))
             for r in range(world_size)]
    out: dict[int, Any] = {}
    errors: dict[int, tuple[bytes, float]] = {}
    deadline = time.monotonic() + timeout_s
    stopped_at: dict[int, float] = {}
    error_deadline = None
    try:
        for p in procs:
            p.start()
        while len(out) + len(errors) < world_size:
            now = time.monotonic()
            if error_deadline is not None and now > error_deadline:
                break
            if now > deadline:
                if errors:
                    break
                missing = sorted(set(range(world_size)) - set(out))
                raise RuntimeError(f"spawn: timed out after {timeout_s} s waiting for rank(s) "
                                   f"{missing} (killed)")
            try:
                rank, status, payload, t_fail = results.get(timeout=0.1)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r in out or r in errors or p.exitcode is None:
                        continue
                    if p.exitcode != 0:
                        errors[r] = (f"rank {r} died with exit code {p.exitcode} without "
                                     f"reporting a result".encode(), time.time())
                    elif now - stopped_at.setdefault(r, now) > _FLUSH_GRACE_S:
                        errors[r] = (b"exited without reporting a result", time.time())
                    if errors and error_deadline is None:
                        error_deadline = now + _ERROR_GRACE_S
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                errors[rank] = (payload, t_fail)
                # The other ranks usually fail soon after (their peer vanished); wait a
                # moment so the report can name the rank that failed first.
                if error_deadline is None:
                    error_deadline = time.monotonic() + _ERROR_GRACE_S
        if errors:
            raise RuntimeError(_failure_message(errors, world_size))
        # Every result is in; a rank stuck in its exit (e.g. a communicator teardown) is not
        # worth waiting the whole timeout for: the finally below kills it.
        exit_deadline = time.monotonic() + min(30.0, max(1.0, deadline - time.monotonic()))
        for p in procs:
            p.join(max(0.0, exit_deadline - time.monotonic()))
    finally:
        _stop(procs)
        results.close()
        results.join_thread()
    return [out[r] for r in range(world_size)]


def init_from_env(*, backend: str | None = None,
                  timeout_s: float = 600) -> tuple[int, int, torch.device]:
    """Initialise the default process group under torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT in the environment); a no-op if it is already initialised.

    Args:
        backend: "nccl" or "gloo"; default nccl when CUDA is available, else gloo.
        timeout_s: the process group's collective timeout.

    Returns:
        (rank, world_size, device): with nccl, device is ``cuda:LOCAL_RANK`` and is made current.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ValueError(f"init_from_env needs {var} in the environment (run under torchrun "
                             f"or use moestream.tools.distributed.spawn)")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device
