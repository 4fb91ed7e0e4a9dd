"""Peak extra memory of a call, measured from torch's own allocator events.

tracemalloc cannot see torch allocations, so this runs the call under
``torch.profiler.profile(profile_memory=True)`` and replays every event's *self* memory
(+bytes allocated by an op, -bytes for frees, which appear as ``[memory]`` events) in
start-time order: the running sum's maximum is the peak of bytes allocated during the
call and not yet freed. An op that allocates and frees a scratch buffer internally
counts net, so this is a slight under-estimate of transient peaks inside one kernel.
Used by the tests and the benchmark to check "peak extra memory ≤ one bucket + the
largest tensor".

Device memory: the event attribute was ``self_cuda_memory_usage`` and is
``self_device_memory_usage`` in newer torch (the old name deprecated, then gone). The
field is chosen by what the events have; if they have neither, this raises rather than
reading every event as 0 bytes (a "peak" of 0 would pass any bound).

Across processes (gloo collectives), :func:`peak_rss_delta` reads the kernel's resident-set
high-water mark instead: gloo frees its buffers on its own threads, which the profiler does
not attribute, so the replayed sum would never come back down.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

DEVICE_FIELDS = ("self_device_memory_usage", "self_cuda_memory_usage")  # newest first
CPU_FIELD = "self_cpu_memory_usage"


def memory_field(event: object, device: str | torch.device) -> str:
    """The profiler-event attribute holding an op's own allocations on ``device``."""
    names = (CPU_FIELD,) if torch.device(device).type == "cpu" else DEVICE_FIELDS
    for name in names:
        if hasattr(event, name):
            return name
    raise RuntimeError(f"profiler events of this torch ({torch.__version__}) have none of {names}; "
                       "hybridrl.refit.memory cannot measure device memory here")


def replay_peak(events: Iterable[object], field: str) -> int:
    """Maximum running sum of ``event.<field>`` in start-time order."""
    events = sorted((e for e in events if getattr(e, field)), key=lambda e: e.time_range.start)
    running = peak = 0
    for e in events:
        running += getattr(e, field)
        peak = max(peak, running)
    return peak


def peak_extra_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> tuple[int, object]:
    """Run ``fn()``; return ``(peak bytes allocated during it above the start, its result)``."""
    from torch.profiler import ProfilerActivity, profile

    on_device = torch.device(device).type != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    events = list(prof.events())
    if not events:
        return 0, result
    return replay_peak(events, memory_field(events[0], device)), result


def peak_rss_delta(fn: Callable[[], object]) -> int:
    """Peak resident memory of this process during ``fn()`` above its start (Linux: the
    kernel's high-water mark ``VmHWM``, reset to the current RSS through /proc/self/clear_refs)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = status("VmRSS:")
    fn()
    return status("VmHWM:") - start
