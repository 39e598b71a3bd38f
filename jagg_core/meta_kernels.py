"""torch's C++ meta kernels for the memory plan's tracing: the same shapes, dtypes and bytes, in half the time.

    with cpp_meta_kernels():     # or @cpp_meta_kernels() on a function
        ...                      # meta tensors computed by the C++ meta kernels where an op has one

A memory plan runs the model on ``meta`` tensors (:mod:`jagg_core.memory_plan`), and its time is the meta device's.
As it imports, torch registers a Python meta kernel (``torch._meta_registrations``: its ``_refs`` and
decompositions, written for ``torch.compile``'s fake tensors) for about 1,340 aten ops, about 640 of them over a C++
meta kernel of their own (``mul``, ``add``, ``cat``, ...). Each Python one checks and promotes in Python what the C++
one does natively, ~0.2 ms a call; a real-size plan makes tens of thousands. Inside this context those 640 Python
registrations are lifted, so the dispatcher falls back to the C++ kernels beneath them; the ops without a C++ meta
kernel keep their Python one, but for a lean one in :data:`LEAN_KERNELS` (``native_group_norm``, whose reference
computes its decomposition). On every shipped preset, quantized and not, the plans are the same to the byte and
take about half the time (``tests/test_memory.py`` checks it).

On leaving, torch's registrations are put back as they were. Lifting and restoring them takes ~40 ms, so a plan
enters once; the context is re-entrant (a nested entry changes nothing) and one thread at a time holds it (others
wait). A torch whose private registry is not as expected (another version) gets no swap: plans are as before,
slower.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.library import Library

_LOCK = threading.RLock()
_depth = 0


def _operator(key: str) -> torch._ops.OpOverload:
    """The op of a library key ``"aten/mul.Tensor/Meta"``."""
    namespace, name, _ = key.split("/")
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _python_meta_kernels() -> dict[torch._ops.OpOverload, object] | None:
    """Each op torch's Python meta library registers, with its kernel (kept by torch as the op's Python dispatcher
    kernel for the Meta key); None when this torch keeps them otherwise."""
    library = getattr(torch._meta_registrations, "_meta_lib_dont_use_me_use_register_meta", None)
    try:
        ops = [_operator(key) for key in sorted(library._op_impls)]
        return {op: op.py_kernels[torch._C.DispatchKey.Meta] for op in ops}
    except (AttributeError, KeyError, ValueError):
        return None


def _destroy(library: Library) -> None:
    """Lift every registration of ``library``. Its registry entries are forgotten too, so that its finalizer,
    when the object is collected, does not remove the keys of a library registered since for the same ops."""
    library._destroy()
    library._op_impls.clear()


def _native_group_norm(input, weight, bias, batch, channels, inner, groups, eps):
    """``native_group_norm``'s outputs as torch's Python reference makes them on ``meta`` (``out`` contiguous in the
    input's shape, ``mean`` and ``rstd`` [batch, groups], all in the input's dtype), without computing its ~10 ops:
    the op has no C++ meta kernel, and a VAE calls it twice in every ResNet block (a tiled decode, thousands of times,
    ~0.7 ms each)."""
    return input.new_empty(input.shape), input.new_empty((batch, groups)), input.new_empty((batch, groups))


#: ops without a C++ meta kernel whose Python one computes more than their outputs' shapes, given a lean one
LEAN_KERNELS = {torch.ops.aten.native_group_norm.default: _native_group_norm}


def _registered(kernels: dict) -> Library:
    """A Meta library of ``aten`` holding ``kernels`` (op: Python kernel)."""
    library = Library("aten", "IMPL", "Meta")
    for op, kernel in kernels.items():
        library.impl(op, kernel)
    return library


@contextmanager
def cpp_meta_kernels():
    """Meta ops computed by their C++ kernel where they have one (see the module docstring)."""
    global _depth
    with _LOCK:
        kernels = _python_meta_kernels() if _depth == 0 else None
        if kernels is not None:
            _destroy(torch._meta_registrations._meta_lib_dont_use_me_use_register_meta)
            try:
                python_only = _registered({op: LEAN_KERNELS.get(op, kernel) for op, kernel in kernels.items()
                                           if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")})
            except BaseException:
                torch._meta_registrations._meta_lib_dont_use_me_use_register_meta = _registered(kernels)
                raise
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if kernels is not None:
                _destroy(python_only)
                torch._meta_registrations._meta_lib_dont_use_me_use_register_meta = _registered(kernels)
