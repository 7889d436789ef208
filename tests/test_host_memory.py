"""lambjax.host_memory: freed memory is kept and reused, not faulted in again.

Each case runs in a fresh interpreter (malloc settings are process-wide and must precede
the threads that allocate). A thread allocates, touches and frees 96 MiB three times, as
XLA:CPU's threads do with a step's temporaries, and reports the page faults of each round.
"""

import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SIZE = 96 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")

PROGRAM = f"""
import ctypes, resource, sys, threading
from lambjax import host_memory
if sys.argv[1] == "retain":
    assert host_memory.retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []

def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc({SIZE})
    ctypes.memset(buffer, 1, {SIZE})
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

for _ in range(3):
    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
print(*faults)
"""


def page_faults(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [int(n) for n in out.stdout.split()]


def test_default_malloc_faults_every_large_buffer_in_again():
    pages = SIZE // PAGE
    assert all(faults >= 0.9 * pages for faults in page_faults("default"))


def test_retained_memory_is_reused_without_page_faults():
    first, *later = page_faults("retain")
    assert first >= 0.9 * SIZE // PAGE  # the heap grows once
    assert all(faults < 100 for faults in later), later
