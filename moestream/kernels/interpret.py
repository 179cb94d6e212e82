"""Triton's interpreter without two costs that change nothing it computes, and with current
numpy (CPU runs only).

Installed by ``moestream.kernels.common`` where kernels run under TRITON_INTERPRET=1:

- ``index_scalars_with_item``: Triton 3.6 turns a scalar used as an index (``range(0, n)``
  with ``n`` a kernel value) into a Python int with ``int(array)`` on a one-element array,
  which numpy >= 2.3 refuses; ``.item()`` gives the same int on every numpy.

- ``skip_repeated_patches``: Triton 3.6 patches the language modules (``_patch_lang``: every
  builtin of ``tl``, ``tl.tensor`` and ``tl.math`` replaced by an interpreted one, found with
  ``inspect.getmembers``) when a kernel is launched, and again every time one ``@triton.jit``
  function calls another (``InterpretedFunction.__call__``). The launch's patch is still in
  place then, so the second one replaces nothing (a patched member is no longer a builtin)
  but still walks the modules, which was about half of a layer test's interpreter time.
  The wrapper skips a call made inside a launch whose language modules are all
  patched already; a module not yet patched (Triton's own ``tl.standard`` functions see
  ``tl.core``, which a kernel's patch of ``tl`` leaves alone) is patched as before.
- ``skip_discarded_overflow_checks``: the integer overflow sanitizer, whose result the
  interpreter throws away (see there). With MOESTREAM_INTERPRET_CHECKS=1 in the environment
  ``enable_overflow_checks`` makes those checks real instead (slower; for hunting int32
  overflows in index arithmetic, which the GPU wraps silently).

The kernels compute the same either way, and every interpreter test runs them.
"""
from __future__ import annotations

import dataclasses

import triton.language as tl

__all__ = ["index_scalars_with_item", "skip_repeated_patches", "skip_discarded_overflow_checks",
           "enable_overflow_checks"]


def index_scalars_with_item() -> bool:
    """Make the interpreter's ``tensor.__index__`` read its one-element array with ``.item()``
    (once). False where this Triton has no ``_patch_lang_tensor`` to wrap."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "_moestream_wrapped", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._moestream_wrapped = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def _patched(lang) -> bool:
    # the interpreter replaces each builtin by a plain function, which is not marked builtin
    return not tl.core.is_builtin(lang.load)


def skip_repeated_patches() -> bool:
    """Install the wrapper (once). False where this Triton has no ``_patch_lang`` to wrap."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:
        return False
    if getattr(original, "_moestream_wrapped", False):
        return True

    langs_of: dict = {}     # function -> the language modules its globals hold
    # a launch patches tl.tensor's __bool__ and restores it when the grid is done (a nested
    # patch of tl.core stays after it, so "tl.core is patched" alone does not mean "inside")
    own_bool = tl.core.tensor.__dict__.get("__bool__")

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = tuple(v for v in fn.__globals__.values()
                                         if v is tl or v is tl.core)
        inside_launch = tl.core.tensor.__dict__.get("__bool__") is not own_bool
        if inside_launch and langs and all(_patched(lang) for lang in langs):
            return scope_type()          # nothing changed, nothing to restore
        return original(fn)

    patch_lang._moestream_wrapped = True
    interpreter._patch_lang = patch_lang
    return True


def _builder_options():
    """(the interpreter's builder, its options), None where this Triton has neither."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    return builder, getattr(builder, "options", None)


def skip_discarded_overflow_checks() -> bool:
    """Turn off the interpreter's integer overflow sanitizer where its result is thrown away.

    Each int32 add, sub and mul of a kernel run by the interpreter also computes the result
    in int64 and compares it with the int32 range (``binary_op_sanitize_overflow_impl``: four
    more interpreted operations), then hands the comparison to ``device_assert``, which does
    nothing unless the builder's ``options.debug`` is set; Triton 3.6's interpreter builds
    its options with ``debug=False`` and never changes them: in both eight-virtual-rank
    layer tests 11 of 37 s for nothing. Where ``debug`` is on the checks stay. True where
    they were turned off."""
    builder, options = _builder_options()
    if options is None or getattr(options, "debug", True) \
            or not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def enable_overflow_checks() -> bool:
    """Make the interpreter's int32 overflow checks real (MOESTREAM_INTERPRET_CHECKS=1): the
    sanitizer on and ``debug`` on, so an int32 add, sub or mul of a kernel whose exact result
    leaves the int32 range raises instead of wrapping as it would on the GPU. About 1.5x the
    interpreter time of a layer test. False where this Triton has no interpreter options to set."""
    builder, options = _builder_options()
    if options is None or not hasattr(options, "debug"):
        return False
    builder.options = dataclasses.replace(options, debug=True, sanitize_overflow=True)
    return True
