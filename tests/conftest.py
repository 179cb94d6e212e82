"""Shared fixtures: a fresh seeded generator per test, the kernel device, GPU markers.

Every test draws fresh random inputs: the session seed changes from run to run (set
MOESTREAM_SEED to replay one; it is printed in the header) and each test mixes in its own name.
"""
from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

SESSION_SEED = int(os.environ.get("MOESTREAM_SEED", random.SystemRandom().randrange(2**31)))
# pytest-xdist's workers are started after this module is imported in the controller and
# inherit its environment, so they all use the seed the header prints.
os.environ["MOESTREAM_SEED"] = str(SESSION_SEED)
HAS_CUDA = torch.cuda.is_available()
NUM_GPUS = torch.cuda.device_count() if HAS_CUDA else 0

# Kernels run on the GPU where there is one, else in Triton's interpreter on the CPU (the
# package switches the interpreter on at import when CUDA is absent).
KERNEL_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="GPU machine: kernels run on cuda")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]


def pytest_configure(config):
    # make test's --dist loadgroup keeps the sm_90 compile file on one worker; with pytest 9
    # (xdist 3.8) the groups silently fall apart and two workers each compile every kernel
    pytest_major = int(pytest.__version__.split(".")[0])
    if getattr(config.option, "dist", "no") == "loadgroup" and pytest_major >= 9:
        raise pytest.UsageError("--dist loadgroup needs pytest < 9 with pytest-xdist 3.8 (its "
                                "groups are ignored by pytest 9); run make install, which pins it")


def pytest_report_header(config):
    return (f"moestream: MOESTREAM_SEED={SESSION_SEED} cuda={HAS_CUDA} gpus={NUM_GPUS} "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '(set by moestream if no CUDA)')}")


def pytest_terminal_summary(terminalreporter):
    # also under -q (which hides the header) and with xdist (the workers share this seed)
    terminalreporter.write_line(f"moestream: inputs drawn with MOESTREAM_SEED={SESSION_SEED} "
                                f"(set it to replay this run's inputs)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if item.get_closest_marker("multigpu") and NUM_GPUS < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 or more GPUs"))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the session seed and the test's id."""
    seed = (SESSION_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**63
    return torch.Generator().manual_seed(seed)


def hopper(block_m: int, dtype: str = "bf16", *, hidden: int, intermediate: int):
    """``tuning.gpu_defaults`` for a config of these dims (the GPU defaults a test runs on the
    interpreter)."""
    from moestream import MoEConfig
    from moestream.tuning import gpu_defaults
    return gpu_defaults(MoEConfig(hidden=hidden, intermediate=intermediate, num_experts=8,
                                  top_k=2, max_tokens_per_rank=8, block_m=block_m, dtype=dtype))


def _h200():
    from moestream.tuning import Device
    return Device(sms=132, hopper=True)


H200 = _h200()   # an H200's SM count and generation, for the tuning policy's tests
