"""Peak heap bytes of a block of torch CPU code: glibc's in-use count read after every aten op.

torch's CPU allocator takes its memory from malloc, so glibc's mallinfo2() (bytes in use in the
arenas plus mmapped chunks) is what tensors occupy, plus the interpreter's own small objects. A
TorchDispatchMode reads it after each op (forward and backward ops alike: the CPU autograd engine
runs the backward on the calling thread), so the peak is exact to one op's internal scratch.
Use torch.set_num_threads(1) around it: other threads' arenas would count too.
"""

from __future__ import annotations

import ctypes

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakHeap(TorchDispatchMode):
    """with PeakHeap() as meter: ...; meter.peak = the most bytes in use above the level at entry."""

    def __enter__(self):
        self.base, self.peak = heap_in_use(), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_in_use() - self.base)
        return out
