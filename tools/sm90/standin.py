"""A Triton driver that compiles for an H100/H200 (sm_90) and launches nothing, on a machine with no GPU.

The sm_90 compile tier runs rlengine's own launchers on FakeTensor "cuda" tensors (no storage, no
device): each launch goes through Triton's normal path (binder, specialisation, the NVIDIA backend's
ttir -> ttgir -> llir -> ptx -> cubin with the bundled ptxas), then stops where a real driver would
load the cubin. What a launch would have cost is recorded instead, one `Variant` per compiled
kernel: registers, spill bytes, shared memory and the kind of matrix instruction the PTX uses.
Triton's own resource check (shared memory over the device limit) runs unchanged, with the
properties of an H200 below. torch.cuda's device queries that the launchers make (SM count,
current device) are answered with the same properties, so they pick their GPU configs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import subprocess
import warnings

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import GPUDriver
from triton.runtime import driver as triton_driver

# An H200 (sm_90): 132 SMs, 227 KiB of opt-in shared memory per block, 64K registers per SM.
SM90 = {"max_shared_mem": 232448, "max_num_regs": 65536, "multiprocessor_count": 132, "warpSize": 32,
        "sm_clock_rate": 1980000, "mem_clock_rate": 3201000, "mem_bus_width": 6144}
SM90_TARGET = GPUTarget("cuda", 90, 32)


@dataclasses.dataclass(slots=True, kw_only=True)
class Variant:
    """One compiled kernel specialisation, as ptxas reported it."""

    kernel: str        # Triton kernel name, e.g. _split_kernel
    hash: str          # Triton's cache key of this specialisation
    registers: int     # per thread
    spill_bytes: int   # spill stores + spill loads, bytes per thread
    spill_stores: int  # bytes per thread
    stack_bytes: int   # stack frame per thread (spills and local arrays)
    shared_bytes: int  # dynamic shared memory per block (Triton's metadata)
    num_warps: int
    num_stages: int
    mma: str           # "wgmma" (Hopper warpgroup MMA), "mma" (mma.sync) or "none" (FMA only)
    constants: dict    # the constexpr arguments, by name
    case: str          # the launch that compiled it first, e.g. "qwen3-0.6b/paged_decode/bfloat16/S=4"


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_ptxas_log(log: str) -> dict[str, int]:
    """registers / stack / spill_stores / spill_loads from `ptxas -v` output (one kernel per module)."""
    out = {}
    for key, pattern in _PTXAS_RE.items():
        values = [int(v) for v in pattern.findall(log)]
        if key == "registers" and not values:
            raise ValueError(f"no register count in the ptxas log:\n{log[:2000]}")
        out[key] = max(values, default=0)
    return out


def mma_kind(ptx: str) -> str:
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma"
    return "none"


def _ptxas_log(ptx_path: str) -> str:
    """Rerun the bundled ptxas with -v on a cached kernel's PTX (its cubin came from Triton's cache)."""
    from triton.backends.nvidia.compiler import get_ptxas
    cubin = ptx_path + ".standin.cubin"
    cmd = [get_ptxas(90).path, "-lineinfo", "-v", "--gpu-name=sm_90a", ptx_path, "-o", cubin]
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(cubin)


class _PtxasLogs:
    """Stands in for the `subprocess` module inside Triton's NVIDIA compiler: keeps each ptxas -v log,
    keyed by the sha256 of the cubin it wrote, so a fresh compile costs no second ptxas run."""

    def __init__(self, real):
        self._real = real
        self.by_cubin: dict[str, str] = {}

    def __getattr__(self, name):
        return getattr(self._real, name)

    def run(self, cmd, *args, **kwargs):
        result = self._real.run(cmd, *args, **kwargs)
        log_file = kwargs.get("stderr")
        if isinstance(cmd, list) and "ptxas" in os.path.basename(str(cmd[0])) and "-o" in cmd \
                and hasattr(log_file, "name"):
            with open(cmd[cmd.index("-o") + 1], "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            with open(log_file.name) as f:
                self.by_cubin[digest] = f.read()
        return result


class _Utils:
    """driver.utils: device properties, and a load_binary that records the kernel instead of loading it."""

    def __init__(self, standin: "StandInDriver"):
        self._standin = standin

    def get_device_properties(self, device):
        return dict(SM90)

    def load_binary(self, name, cubin, shared, device):
        self._standin.record(name, cubin, shared)
        return 0, 0, 0, 0, 1024  # module, function, n_regs, n_spills, max threads per block


class _NoLaunch:
    """The launcher: every launch is a no-op."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        return None


class StandInDriver(GPUDriver):
    """Triton's active driver during the compile tier: target sm_90, device 0, stream 0."""

    def __init__(self):  # no torch.cuda calls: there is no CUDA here
        self.utils = _Utils(self)
        self.launcher_cls = _NoLaunch
        self.variants: list[Variant] = []
        self._pending: dict | None = None
        self._constants: dict | None = None
        self.ptxas_logs: _PtxasLogs | None = None
        self.case = ""

    @staticmethod
    def is_active():
        return False

    def get_current_target(self):
        return SM90_TARGET

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return (9, 0)

    def get_active_torch_device(self):
        return torch.device("cuda", 0)

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)

    def get_benchmarker(self):
        raise RuntimeError("the sm_90 stand-in driver launches nothing: autotuning by timing is not possible; "
                           "pin the configs to compile each one")

    def _compiling(self, *, fn, compile, **_):
        """jit_cache_hook: remember the constexprs of the kernel about to compile (False: do compile)."""
        names = fn.jit_function.arg_names
        self._constants = {names[path[0]]: value for path, value in compile["constants"].items()
                           if len(path) == 1 and isinstance(value, (int, float, str, bool))}
        return False

    def _load_start(self, module, function, name, metadata_group, kernel_hash):
        self._pending = {"group": metadata_group, "hash": kernel_hash}

    def record(self, name: str, cubin: bytes, shared: int) -> None:
        pending, self._pending = self._pending or {}, None
        group = pending.get("group", {})
        ptx_path = next((p for f, p in group.items() if f.endswith(".ptx")), None)
        json_path = next((p for f, p in group.items() if f.endswith(".json") and not f.startswith("__")), None)
        ptx = open(ptx_path).read() if ptx_path else ""
        log = self.ptxas_logs.by_cubin.get(hashlib.sha256(cubin).hexdigest()) if self.ptxas_logs else None
        if ptx_path is None:
            raise RuntimeError(f"{name}: no PTX in Triton's cache group to measure")
        saved_log = ptx_path + ".ptxas-v.log"  # beside the cached kernel: a cache hit needs no ptxas rerun
        if log is None and os.path.exists(saved_log):
            log = open(saved_log).read()
        if log is None:
            log = _ptxas_log(ptx_path)
        if not os.path.exists(saved_log):
            with open(saved_log, "w") as f:
                f.write(log)
        usage = parse_ptxas_log(log)
        meta = {}
        if json_path:
            import json
            meta = json.load(open(json_path))
        self.variants.append(Variant(
            kernel=name, hash=pending.get("hash", ""), registers=usage["registers"],
            spill_bytes=usage["spill_stores"] + usage["spill_loads"], spill_stores=usage["spill_stores"],
            stack_bytes=usage["stack"],
            shared_bytes=int(shared), num_warps=int(meta.get("num_warps", 0)),
            num_stages=int(meta.get("num_stages", 0)), mma=mma_kind(ptx),
            constants=self._constants or {}, case=self.case))
        self._constants = None


class _CudaProperties:
    """What torch.cuda.get_device_properties would say on the H200."""

    name = "NVIDIA H200 (sm_90 stand-in)"
    major, minor = 9, 0
    multi_processor_count = SM90["multiprocessor_count"]
    total_memory = 141 * 2**30
    shared_memory_per_block_optin = SM90["max_shared_mem"]
    warp_size = 32


@contextlib.contextmanager
def sm90_standin():
    """Make Triton compile for sm_90 without launching, and torch.cuda answer like an H200.

    Yields the StandInDriver, whose .variants fill up as kernels compile. Tensors for the launchers
    come from fake_cuda() below. Not thread-safe; restores everything on exit."""
    import triton.backends.nvidia.compiler as nv_compiler
    from triton import knobs

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the sm_90 compile tier needs TRITON_INTERPRET unset (the kernels must be JIT functions)")
    standin = StandInDriver()
    standin.ptxas_logs = _PtxasLogs(nv_compiler.subprocess)
    saved = {name: getattr(torch.cuda, name) for name in
             ("get_device_properties", "current_device", "is_available", "get_device_capability", "device_count")}
    saved_subprocess = nv_compiler.subprocess
    saved_hooks = knobs.runtime.kernel_load_start_hook, knobs.runtime.jit_cache_hook
    try:
        nv_compiler.subprocess = standin.ptxas_logs
        knobs.runtime.kernel_load_start_hook = standin._load_start
        knobs.runtime.jit_cache_hook = standin._compiling
        torch.cuda.get_device_properties = lambda device=None: _CudaProperties()
        torch.cuda.current_device = lambda: 0
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        torch.cuda.device_count = lambda: 1
        triton_driver.set_active(standin)
        yield standin
    finally:
        triton_driver._active = None  # back to the default driver, created on next use
        knobs.runtime.kernel_load_start_hook, knobs.runtime.jit_cache_hook = saved_hooks
        nv_compiler.subprocess = saved_subprocess
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def _basic_index(t: torch.Tensor, index) -> torch.Tensor:
    """t[index] for ints, slices, None and Ellipsis through aten.select / aten.slice.

    A CPU build of torch fails Python-level indexing of fake CUDA tensors ("not linked with support
    for cuda devices": the indexing code takes a CUDA device guard); the dispatcher ops work."""
    if isinstance(index, torch.Tensor):  # t[idx]: a gather along dim 0 (moe_align_ref's lookups)
        return torch.ops.aten.index.Tensor(t, [index])
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = t.dim() - sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:at] + (slice(None),) * fill + index[at + 1:]
    dim = 0
    for i in index:
        if i is None:
            t = t.unsqueeze(dim)
            dim += 1
        elif isinstance(i, int):
            t = torch.ops.aten.select.int(t, dim, i)
        elif isinstance(i, slice):
            start, stop, step = i.indices(t.shape[dim])
            t = torch.ops.aten.slice.Tensor(t, dim, start, max(start, stop), step)
            dim += 1
        else:
            raise TypeError(f"the sm_90 stand-in supports basic indexing only, got {type(i).__name__}")
    return t


@contextlib.contextmanager
def fake_cuda():
    """A FakeTensorMode in which torch.empty(..., device="cuda") makes storage-less CUDA tensors.

    Triton reads their data_ptr() as 0 (16-byte aligned, so pointer arguments specialise as they do
    for real allocations); torch warns about that once per call, silenced here. Basic indexing
    (t[a:b], t[i] = x) goes through the dispatcher (see _basic_index)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def fake_getitem(self, index):
        return _basic_index(self, index) if isinstance(self, FakeTensor) else getitem(self, index)

    def fake_setitem(self, index, value):
        if not isinstance(self, FakeTensor):
            return setitem(self, index, value)
        if isinstance(index, torch.Tensor):
            torch.ops.aten.index_put_(self, [index], value if isinstance(value, torch.Tensor) else
                                      torch.full((), value, dtype=self.dtype, device=self.device))
        else:
            _basic_index(self, index).copy_(value)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = fake_getitem, fake_setitem
        try:
            with FakeTensorMode(allow_non_fake_inputs=False):
                yield
        finally:
            torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem


__all__ = ["SM90", "SM90_TARGET", "Variant", "StandInDriver", "sm90_standin", "fake_cuda", "parse_ptxas_log",
           "mma_kind", "triton"]
