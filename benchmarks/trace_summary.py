"""Where a profiled step's time goes, from the `.xplane.pb` that `jax.profiler.trace` writes.

Read through JAX's public `jax.profiler.ProfileData` (no TensorBoard or xprof needed). On a
GPU or TPU the device's planes hold the kernels (GPU: one line per CUDA stream) and the XLA
ops they belong to ("XLA Ops"); on CPU the XLA ops (the events that name their HLO op) run
on the host's threads, and those stand in for both. The summary: kernels per step, device time per
step by kernel class, the top kernels and ops, and the device's idle share of the profiled
window (the time no kernel ran: launches, host work, waits).
"""

import collections
import glob
import os
import re

import jax

# The first pattern that matches a kernel's (lower-cased) name gives its class.
KERNEL_CLASSES = (
    ("attention (fused)", r"fmha|sdpa|flash|cudnn|splash|mha"),
    ("matmul", r"gemm|xmma|nvjet|cutlass|cublas|hgmma|matmul|dot|convolution"),
    ("memcpy/memset", r"memcpy|memset"),
    ("dynamic-update-slice", r"dynamic.update.slice"),
    ("copy/transpose", r"copy|transpose"),
    ("random bits", r"rng|threefry|philox"),
    ("collective", r"all.reduce|all.gather|reduce.scatter|all.to.all|nccl|collective"),
    ("reduction", r"reduce|input_"),
    ("elementwise fusion", r"fusion|^loop_|^wrapped_"),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, low):
            return label
    return "other"


def latest_xplane(trace_dir: str) -> str | None:
    """The newest `.xplane.pb` under a `jax.profiler.trace` directory, or None."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    return max(paths, key=os.path.getmtime) if paths else None


def _events(line, *, xla_ops_only: bool = False) -> list:
    """The line's (name, start, duration) events, without the runtime's own scopes
    (`ThunkExecutor::Execute` and the like wrap the ops they run); with `xla_ops_only`,
    only the events that name the HLO op they ran (a host thread's other events are not)."""
    return [
        (e.name, e.start_ns, e.duration_ns)
        for e in line.events
        if e.duration_ns > 0
        and "::" not in e.name
        and (not xla_ops_only or any(key == "hlo_op" for key, _ in e.stats))
    ]


def _device_lines(data):
    """(kernel events, op events) as (name, start_ns, duration_ns) lists."""
    kernels, ops = [], []
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                name = line.name.lower()
                if name == "xla ops":
                    ops += _events(line, xla_ops_only=True)
                elif "stream" in name:  # a GPU's CUDA streams
                    kernels += _events(line)
    if kernels or ops:  # a TPU names no streams: its ops are its kernels
        return kernels or ops, ops or kernels
    for plane in data.planes:  # CPU: the host's threads run the XLA ops
        if plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                ops += _events(line, xla_ops_only=True)
    return ops, ops


def busy_ns(events) -> float:
    """The union of the events' intervals (overlapping streams count once)."""
    busy, end = 0.0, None
    for start, stop in sorted((s, s + d) for _, s, d in events):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy


def summarize(xplane_path: str, steps: int, top: int = 10) -> dict:
    """The profile of `steps` steps, per step: see the module docstring."""
    kernels, ops = _device_lines(jax.profiler.ProfileData.from_file(xplane_path))
    if not kernels:
        return {"profile": "no device or XLA events in the trace"}

    def ms(ns: float) -> float:
        return round(ns / 1e6 / steps, 3)

    by_class, by_kernel, by_op = (collections.Counter() for _ in range(3))
    for name, _, duration in kernels:
        by_class[kernel_class(name)] += duration
        by_kernel[name[:80]] += duration
    for name, _, duration in ops:
        by_op[re.sub(r"[._]\d+$", "", name.split(" ")[0])] += duration
    window = max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)
    busy = busy_ns(kernels)
    return {
        "kernels_per_step": len(kernels) // steps,
        "device_busy_ms_per_step": ms(busy),
        "window_ms_per_step": ms(window),
        "idle_share": round(1 - busy / window, 3) if window else None,
        "ms_per_step_by_class": {k: ms(v) for k, v in by_class.most_common()},
        "top_kernels": [[k, ms(v)] for k, v in by_kernel.most_common(top)],
        "top_ops": [[k, ms(v)] for k, v in by_op.most_common(top)],
    }
