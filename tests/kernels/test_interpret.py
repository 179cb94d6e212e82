"""The interpreter helpers (moestream.kernels.interpret): one patch of triton.language per
launch instead of one per nested @triton.jit call, the int32 overflow sanitizer off only
where its result was thrown away, and kernels that still compute right. CPU only: on a GPU
machine the kernels are compiled and the helpers are not installed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moestream.kernels.common import INTERPRET, tl, triton

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the wrapper serves Triton's interpreter")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _nested_kernel(x_ptr, y_ptr, CALLS: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    acc = tl.zeros([N], dtype=tl.float32)
    for _ in tl.static_range(CALLS):
        acc += _twice(x)                      # a nested call of another jit function
    # tl.sum is one of Triton's own jit functions, whose module sees tl.core, not tl: the
    # launch's patch of tl leaves tl.core to the first nested patch, which must still run
    tl.store(y_ptr + offs, acc + tl.sum(x, axis=0))


def _run(calls: int, gen: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    from triton.runtime import interpreter

    counted = []
    original = interpreter._patch_builtin
    interpreter._patch_builtin = lambda *a, **k: (counted.append(1), original(*a, **k))[1]
    try:
        x = torch.randn(16, generator=gen)
        y = torch.full((16,), float("nan"))
        _nested_kernel[(1,)](x, y, CALLS=calls, N=16)
    finally:
        interpreter._patch_builtin = original
    return len(counted), x, y


def test_nested_calls_do_not_patch_the_language_again(gen):
    _run(1, gen)   # tl.sum's first nested patch of tl.core stays (Triton never restores it)
    patches_1, x1, y1 = _run(1, gen)
    patches_8, x8, y8 = _run(8, gen)
    # without the wrapper each nested call walks the modules again (4 per call of _twice):
    # 8 calls would cost 28 more module walks than 1 call
    assert patches_8 == patches_1, (patches_1, patches_8)
    for calls, x, y in ((1, x1, y1), (8, x8, y8)):
        torch.testing.assert_close(y, 2 * calls * x + x.sum(), rtol=1e-6, atol=1e-5)
    # after the launch the language is Triton's own again
    assert tl.core.is_builtin(tl.load)


@triton.jit
def _add_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 7)


@pytest.mark.skipif(os.environ.get("MOESTREAM_INTERPRET_CHECKS") == "1",
                    reason="MOESTREAM_INTERPRET_CHECKS=1 turns the checks on")
def test_the_overflow_sanitizer_is_off_only_where_its_result_was_discarded(gen):
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    assert not builder.options.debug            # Triton's interpreter never turns it on
    assert not builder.options.sanitize_overflow
    # the claim that makes this safe: with the sanitizer on and debug off, an int32 add that
    # overflows runs without complaint (its check goes to a device_assert that does nothing)
    x = torch.randint(2**31 - 5, 2**31 - 1, (8,), dtype=torch.int32, generator=gen)
    wrapped = ((x.long() + 7 + 2**31) % 2**32 - 2**31).int()
    saved = builder.options
    for sanitize in (True, False):
        builder.options = dataclasses.replace(saved, sanitize_overflow=sanitize)
        try:
            y = torch.zeros_like(x)
            _add_kernel[(1,)](x, y, N=8)
        finally:
            builder.options = saved
        assert torch.equal(y, wrapped), sanitize
    # with debug on, the check runs and catches the same add; the wrapper leaves such
    # options alone
    from moestream.kernels.interpret import skip_discarded_overflow_checks

    builder.options = dataclasses.replace(saved, debug=True, sanitize_overflow=True)
    try:
        assert not skip_discarded_overflow_checks()
        assert builder.options.sanitize_overflow
        with pytest.raises(Exception, match="int32 overflow detected for operation add"):
            _add_kernel[(1,)](x, torch.zeros_like(x), N=8)
    finally:
        builder.options = saved


@pytest.mark.parametrize("checks", ["0", "1"])
def test_interpret_checks_env_turns_the_checks_on(checks):
    # MOESTREAM_INTERPRET_CHECKS is read when moestream is imported, hence a fresh process;
    # that the checks then raise on an overflowing add is the test above (debug on)
    script = ("import moestream.kernels.common\n"
              "from triton.runtime import interpreter\n"
              "o = interpreter.interpreter_builder.options\n"
              "print(o.debug, o.sanitize_overflow)")
    env = {**os.environ, "MOESTREAM_INTERPRET_CHECKS": checks, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    # on: debug and the sanitizer; off: neither (the sanitizer's result would be discarded)
    assert res.stdout.split() == (["True", "True"] if checks == "1" else ["False", "False"])
