"""Compile a Triton kernel once per device and signature; launch it with plain integers.

Triton's JIT launcher (``kernel[grid](...)``) binds and specialises its arguments on every
call and takes the stream from a framework's notion of "current stream". Here a kernel is
compiled once through ``JITFunction.warmup`` with pointer descriptions instead of arrays, and
every launch calls the compiled kernel's launcher directly: grid, an explicit stream handle,
then raw pointers and sizes. On the H200 that is 7.4 us vs 78.6 us of host time per call
(FACTS.md, B = 256).

A *bound* launch (:meth:`CompiledKernel.bind`, all arguments fixed) goes one step further: its
parameter block is packed once, from the parameter list of the kernel's own PTX entry (which
also names the scratch pointers Triton appends), and every call is a single ``cuLaunchKernel``
through cuda-bindings on the loaded ``CUfunction`` (``cuLaunchKernelEx`` for a programmatic
dependent launch, ``bind(..., pdl=True)``: the kernel may start while the one before it on the
stream finishes, and must wait for it with ``griddepcontrol.wait`` before reading its results;
and for a launch in thread-block clusters, ``bind(..., cluster=dims)``).
Kernels compiled to need what only Triton's launcher does (several CTAs per cluster, cooperative
launches, Triton's own ``launch_pdl`` option) keep Triton's launcher.

Kernels here mark every pointer ``do_not_specialize_on_alignment`` and every size
``do_not_specialize``, so one binary serves any pointer alignment and any size: the cache key
is only (kernel, device, dtypes, constexprs). A pointer a variant of a kernel does without is
compiled as a constexpr ``None`` (dtype ``None``; the kernel must not touch it then): it is no
parameter of the binary, and its launches pass ``None`` in its place.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

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

    __slots__ = (
        "name",
        "_run",
        "_function",
        "_metadata",
        "_constexprs",
        "_params",
        "_n_args",
        "_complete",
        "_threads",
        "_shared",
        "driver_launch",
        "n_regs",
        "n_spills",
        "_clusters",
    )

    def __init__(
        self, jit_fn, args: Sequence[Any], constexprs: dict[str, Any], num_warps: int, maxnreg: int | None = None
    ):
        options = {} if maxnreg is None else {"maxnreg": maxnreg}
        kernel = jit_fn.warmup(*args, grid=(1,), num_warps=num_warps, **options, **constexprs)
        self.name = kernel.name
        self._run = kernel.run  # loads the binary on first access
        self._function = kernel.function
        #: registers per thread and bytes spilled per thread, as the loaded binary reports them
        self.n_regs = int(getattr(kernel, "n_regs", 0) or 0)
        self.n_spills = int(getattr(kernel, "n_spills", 0) or 0)
        self._metadata = kernel.packed_metadata
        self._constexprs = tuple(constexprs.values())
        md = kernel.metadata
        self._threads = int(md.num_warps) * int(getattr(md, "warp_size", 32))
        self._shared = int(md.shared)
        self._params = _ptx_params(kernel.asm.get("ptx", ""), kernel.name)
        self._n_args = sum(a is not None for a in args)  # the binary's own parameters
        self._clusters: dict[tuple, int] = {}
        self._complete = self._n_args == len(args)  # no pointer compiled as None
        simple = (
            int(getattr(md, "num_ctas", 1)) == 1
            and not getattr(md, "launch_cooperative_grid", False)
            and not getattr(md, "launch_pdl", False)
        )
        #: whether :meth:`bind` launches through cuLaunchKernel (else through Triton's launcher)
        self.driver_launch = simple and self._params is not None and len(self._params) >= self._n_args

    def launch(self, grid: tuple[int, int, int], stream: int, *args: int | None) -> None:
        """Queue one launch on ``stream``; ``args`` are the runtime arguments in order (``None``
        for a pointer compiled as a constexpr ``None``)."""
        self._run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            self._function,
            self._metadata,
            None,
            None,
            None,
            *args,
            *self._constexprs,
        )

    def bind(
        self,
        grid: tuple[int, int, int],
        *args: int | None,
        driver: bool | None = None,
        pdl: bool = False,
        cluster: tuple[int, int, int] | None = None,
    ):
        """Return ``launch(stream)`` that queues this kernel with ``grid`` and ``args`` fixed.

        Binding once and launching many times saves the argument handling of every call.
        ``driver`` picks the launch path (default: :attr:`driver_launch`); ``False`` forces
        Triton's launcher. ``pdl``: a programmatic dependent launch (driver path only, sm_90+;
        the kernel must begin with ``griddepcontrol.wait``); Triton's launcher ignores it.
        ``cluster``: launch the grid in thread-block clusters of these dimensions (driver path
        only, sm_90+; each must divide the grid's; more than 8 CTAs per cluster is allowed for
        this kernel here, where the device supports it).
        """
        if driver is None:
            driver = self.driver_launch
        if cluster is not None and not driver:
            raise ValueError(f"cluster={cluster!r} needs the driver launch path ({self.name})")
        if driver:
            return self._bind_driver(grid, args, pdl, cluster)
        run, function, metadata = self._run, self._function, self._metadata
        g0, g1, g2 = grid
        full = tuple(args) + self._constexprs

        def launch(stream: int) -> None:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *full)

        return launch

    def launcher(self):
        """Return ``launch(grid, stream, *args)``, like :meth:`launch`, with a parameter block of
        its own that every call rewrites in place (one ``struct.pack_into``) before one
        ``cuLaunchKernel``: for launches whose arguments change every time (a commit's scatter,
        about 1 us of host time less per commit than through :meth:`launch`).
        Not thread-safe: one launcher per caller that serialises its launches. Falls back to
        :meth:`launch` where :attr:`driver_launch` is false or a pointer was compiled as ``None``.
        """
        if not self.driver_launch or not self._complete:
            return self.launch
        block = _ParamBlock(self)
        view, pack, params, function = block.view, block.pack, block.params, block.function
        threads, shared, launch_kernel, ok = block.threads, block.shared, block.launch_kernel, block.ok

        def launch(grid: tuple[int, int, int], stream: int, *args: int) -> None:
            pack(view, 0, *args)
            err = launch_kernel(function, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, params, 0)[0]
            if err != ok:
                block.fail(err)

        launch.params = block  # the parameter block lives as long as the launcher
        return launch

    def max_active_clusters(self, grid: tuple[int, int, int], cluster: tuple[int, int, int]) -> int:
        """How many clusters of ``cluster`` CTAs of this kernel the device can hold at once (0: such
        a cluster cannot be launched; ``cuOccupancyMaxActiveClusters``). Host-only."""
        key = tuple(cluster)
        n = self._clusters.get(key)
        if n is None:
            from cuda.bindings import driver as cu

            block = _ParamBlock(self)
            config = _bind_ex(block, (int(grid[0]), int(grid[1]), int(grid[2])), False, cluster).config[0]
            err, n = cu.cuOccupancyMaxActiveClusters(block.function, config)
            n = self._clusters[key] = int(n) if err == cu.CUresult.CUDA_SUCCESS else 0
        return n

    def _bind_driver(
        self,
        grid: tuple[int, int, int],
        args: Sequence[int | None],
        pdl: bool = False,
        cluster: tuple[int, int, int] | None = None,
    ):
        block = _ParamBlock(self)
        block.pack(block.view, 0, *(a for a in args if a is not None))
        params, function = block.params, block.function
        threads, shared, launch_kernel, ok = block.threads, block.shared, block.launch_kernel, block.ok
        g0, g1, g2 = (int(g) for g in grid)
        if pdl or cluster is not None:
            return _bind_ex(block, (g0, g1, g2), pdl, cluster)

        def launch(stream: int) -> None:
            err = launch_kernel(function, g0, g1, g2, threads, 1, 1, shared, stream, params, 0)[0]
            if err != ok:
                block.fail(err)

        launch.params = block  # type: ignore[attr-defined]  # the parameter block lives as long as the launch
        return launch


def _bind_ex(block: _ParamBlock, grid: tuple[int, int, int], pdl: bool, cluster: tuple[int, int, int] | None):
    """``launch(stream)`` through ``cuLaunchKernelEx``, with programmatic stream serialization
    allowed (``pdl``) and/or clusters of ``cluster`` CTAs; the launch configuration is built
    once, only its stream is set per call."""
    from cuda.bindings import driver as cu

    attrs = []
    if pdl:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cluster is not None:
        dims = tuple(int(c) for c in cluster)
        if any(c < 1 or g % c for g, c in zip(grid, dims)):
            raise ValueError(f"cluster={cluster!r} must divide grid={grid!r} ({block.name})")
        if dims[0] * dims[1] * dims[2] > 8:
            from .._cuda import _check

            non_portable = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            _check(
                cu.cuFuncSetAttribute(block.function, non_portable, 1),
                f"cuFuncSetAttribute({block.name}, non-portable cluster size)",
            )
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = dims
        attrs.append(attr)
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block.threads, 1, 1
    config.sharedMemBytes = block.shared
    config.attrs = attrs
    config.numAttrs = len(attrs)
    params, function, ok, launch_ex = block.params, block.function, block.ok, cu.cuLaunchKernelEx

    def launch(stream: int) -> None:
        config.hStream = stream
        err = launch_ex(config, function, params, 0)[0]
        if err != ok:
            block.fail(err)

    launch.params = block  # type: ignore[attr-defined]  # the parameter block lives as long as the launch
    launch.config = (config, attrs)  # type: ignore[attr-defined]
    return launch


class _ParamBlock:
    """The kernel parameters for ``cuLaunchKernel``: one 8-byte slot per parameter of the PTX
    entry (the caller's arguments, little-endian in the low bytes of their slots, then zeros for
    the scratch pointers Triton appends) and the array of slot addresses the driver reads at
    launch time. ``pack(view, 0, *args)`` writes the arguments."""

    _CODES = {8: "q", 4: "i4x", 2: "h6x", 1: "b7x"}

    def __init__(self, kernel: CompiledKernel):
        import struct

        from cuda.bindings import driver as cu

        sizes = kernel._params
        if sizes is None:
            raise ValueError(f"the PTX parameter list of {kernel.name} could not be read: no driver launch")
        self.values = np.zeros(len(sizes), dtype=np.uint64)
        self.addresses = np.array([self.values.ctypes.data + 8 * i for i in range(len(sizes))], dtype=np.uint64)
        self.params = self.addresses.ctypes.data
        self.view = self.values.data.cast("B")
        self.pack = struct.Struct("<" + "".join(self._CODES[n] for n in sizes[: kernel._n_args])).pack_into
        self.function = cu.CUfunction(kernel._function)
        self.threads, self.shared = kernel._threads, kernel._shared
        self.launch_kernel, self.ok = cu.cuLaunchKernel, cu.CUresult.CUDA_SUCCESS
        self.name = kernel.name

    def fail(self, err) -> None:
        from .._cuda import _check

        _check((err,), f"cuLaunchKernel({self.name})")


def _ptx_params(ptx: str, name: str) -> list[int] | None:
    """Byte sizes of the parameters of PTX entry ``name``, or ``None`` if they cannot be read."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if not m:
        return None
    sizes = []
    for decl in m.group(1).split(","):
        t = re.search(r"\.param\s+\.[usbf](8|16|32|64)\b", decl)
        if t is None:
            return None
        sizes.append(int(t.group(1)) // 8)
    return sizes


_cache: dict[tuple, CompiledKernel] = {}
_lock = threading.Lock()


def compiled(
    jit_fn,
    device_id: int,
    pointer_dtypes: Sequence[str | None],
    n_ints: int,
    constexprs: dict[str, Any],
    num_warps: int,
    maxnreg: int | None = None,
) -> CompiledKernel:
    """Return the compiled kernel for this device and signature, compiling it on first use.

    Kernels take their pointer arguments first (dtype ``None``: a constexpr ``None``), then
    ``n_ints`` integer arguments, then the constexprs (in the order given). ``maxnreg`` caps the
    registers per thread (ptxas ``.maxnreg``; None: the compiler's choice). Compilation happens on the calling thread,
    host-blocking; it must not happen during CUDA graph capture (warm up first).
    """
    key = (jit_fn, device_id, tuple(pointer_dtypes), n_ints, tuple(constexprs.items()), num_warps, maxnreg)
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
                    args = [None if d is None else Pointer(d) for d in pointer_dtypes] + [1] * n_ints
                    kernel = CompiledKernel(jit_fn, args, constexprs, num_warps, maxnreg)
                finally:
                    if previous != device_id:  # leave the caller's current device as it was
                        driver.active.set_current_device(previous)
                _cache[key] = kernel
    return kernel
