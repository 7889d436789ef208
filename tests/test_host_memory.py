"""lambjax.host_memory: freed memory is kept and reused, not faulted in again.

Each case runs in a fresh interpreter (malloc settings are process-wide and must precede
the threads that allocate). A thread allocates, touches and frees a buffer three times, as
XLA:CPU's threads do with a step's temporaries, and reports the page faults of each round.
The large case is above what glibc's trim threshold can be set to (2 GiB) other than
"never": a BERT-large LANS step frees 2.7 GB of temporaries.
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PAGE = os.sysconf("SC_PAGE_SIZE")

PROGRAM = """
import ctypes, resource, sys, threading
from lambjax import host_memory
size = int(sys.argv[2])
if sys.argv[1] == "retain":
    assert host_memory.retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []

def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

for _ in range(3):
    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
print(*faults)
"""


def page_faults(mode: str, size: int) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode, str(size)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [int(n) for n in out.stdout.split()]


def test_default_malloc_faults_every_large_buffer_in_again():
    size = 96 << 20
    assert all(faults >= 0.9 * size // PAGE for faults in page_faults("default", size))


@pytest.mark.parametrize("size", [96 << 20, 9 << 28], ids=["96MiB", "2.25GiB"])
def test_retained_memory_is_reused_without_page_faults(size):
    first, *later = page_faults("retain", size)
    assert first >= 0.9 * size // PAGE  # the heap grows once
    assert all(faults < 100 for faults in later), later
