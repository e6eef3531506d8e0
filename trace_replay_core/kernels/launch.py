"""Compile a Triton kernel once per device and signature; launch it with plain integers.

Triton's JIT launcher (``kernel[grid](...)``) binds and specialises its arguments on every
call and takes the stream from a framework's notion of "current stream". Here a kernel is
compiled once through ``JITFunction.warmup`` with pointer descriptions instead of arrays, and
every launch calls the compiled kernel's launcher directly: grid, an explicit stream handle,
then raw pointers and sizes. On the H200 that is 7.4 us vs 78.6 us of host time per call
(FACTS.md, B = 256).

Kernels here mark every pointer ``do_not_specialize_on_alignment`` and every size
``do_not_specialize``, so one binary serves any pointer alignment and any size: the cache key
is only (kernel, device, dtypes, constexprs).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Sequence, Tuple

__all__ = ["Pointer", "CompiledKernel", "compiled"]


class Pointer:
    """A pointer argument described by its element dtype (``"int32"`` ...), for compilation."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str):
        self.dtype = dtype

    @staticmethod
    def data_ptr() -> int:
        return 0

    def __repr__(self) -> str:
        return f"Pointer({self.dtype})"


class CompiledKernel:
    """A loaded Triton binary and its launcher. :meth:`launch` is stream-ordered, never blocks."""

    __slots__ = ("name", "_run", "_function", "_metadata", "_constexprs")

    def __init__(self, jit_fn, args: Sequence[Any], constexprs: Dict[str, Any], num_warps: int):
        kernel = jit_fn.warmup(*args, grid=(1,), num_warps=num_warps, **constexprs)
        self.name = kernel.name
        self._run = kernel.run               # loads the binary on first access
        self._function = kernel.function
        self._metadata = kernel.packed_metadata
        self._constexprs = tuple(constexprs.values())

    def launch(self, grid: Tuple[int, int, int], stream: int, *args: int) -> None:
        """Queue one launch on ``stream``; ``args`` are the runtime arguments in order."""
        self._run(grid[0], grid[1], grid[2], stream, self._function, self._metadata, None, None, None,
                  *args, *self._constexprs)

    def bind(self, grid: Tuple[int, int, int], *args: int):
        """Return ``launch(stream)`` that queues this kernel with ``grid`` and ``args`` fixed.

        Binding once and launching many times saves the argument handling of every call.
        """
        run, function, metadata = self._run, self._function, self._metadata
        g0, g1, g2 = grid
        full = tuple(args) + self._constexprs

        def launch(stream: int) -> None:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *full)

        return launch


_cache: Dict[tuple, CompiledKernel] = {}
_lock = threading.Lock()


def compiled(jit_fn, device_id: int, pointer_dtypes: Sequence[str], n_ints: int,
             constexprs: Dict[str, Any], num_warps: int) -> CompiledKernel:
    """Return the compiled kernel for this device and signature, compiling it on first use.

    Kernels take their pointer arguments first, then ``n_ints`` integer arguments, then the
    constexprs (in the order given). Compilation happens on the calling thread, host-blocking;
    it must not happen during CUDA graph capture (warm up first).
    """
    key = (jit_fn, device_id, tuple(pointer_dtypes), n_ints, tuple(constexprs.items()), num_warps)
    kernel = _cache.get(key)
    if kernel is None:
        with _lock:
            kernel = _cache.get(key)
            if kernel is None:
                from triton.runtime import driver
                previous = driver.active.get_current_device()
                if previous != device_id:
                    driver.active.set_current_device(device_id)
                try:
                    args = [Pointer(d) for d in pointer_dtypes] + [1] * n_ints
                    kernel = CompiledKernel(jit_fn, args, constexprs, num_warps)
                finally:
                    if previous != device_id:  # leave the caller's current device as it was
                        driver.active.set_current_device(previous)
                _cache[key] = kernel
    return kernel
