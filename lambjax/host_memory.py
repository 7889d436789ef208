"""Host memory for XLA:CPU runs: malloc keeps freed memory for the next step.

XLA:CPU allocates the temporary buffers of an executable (activations, gradients, a fresh
optimizer update) with malloc at every execution and frees them when it ends. glibc serves
large blocks with mmap (above 32 MiB, and above 64 MiB in the per-thread arenas that XLA's
threads allocate from, whatever the settings) and returns them with munmap, so every step
faults all of its temporaries in again, one 4 KiB page at a time, and the kernel zeroes
each page. The tiny BERT train step of benchmarks/train_step.py took 117,000 page faults
(457 MB) and 0.3 s of kernel time per 0.5 s step that way; BERT-base 486,000 (1.9 GB).

`retain_freed_memory` makes every thread allocate from glibc's main heap, without mmap,
and never trims it: freed temporaries stay mapped and the next step reuses them (no page
faults; the tiny step takes 0.34 s). The process keeps its peak heap size for its life,
which is what a training process needs anyway. It only affects threads that have not
allocated yet, so it must run before JAX starts its CPU client (the first computation);
`lambjax.main` calls it first thing when the run is on CPU.
"""

import ctypes
import ctypes.util

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def retain_freed_memory() -> bool:
    """Sets glibc malloc to one arena, no mmap, no trimming. False where libc is not glibc."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    # A trim threshold of -1 disables trimming completely (mallopt(3)).
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
