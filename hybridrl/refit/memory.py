"""Peak extra memory of a call, measured from torch's own allocator events.

tracemalloc cannot see torch allocations, so this runs the call under
``torch.profiler.profile(profile_memory=True)`` and replays every event's *self* memory
(+bytes allocated by an op, -bytes for frees, which appear as ``[memory]`` events) in
start-time order: the running sum's maximum is the peak of bytes allocated during the
call and not yet freed. An op that allocates and frees a scratch buffer internally
counts net, so this is a slight under-estimate of transient peaks inside one kernel.
Used by the tests and the benchmark to check "peak extra memory ≤ one bucket + the
largest tensor".
"""
from __future__ import annotations

from typing import Callable



def peak_extra_bytes(fn: Callable[[], object], device: str = "cpu") -> tuple[int, object]:
    """Run ``fn()``; return ``(peak bytes allocated during it above the start, its result)``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    field = "self_cuda_memory_usage" if device == "cuda" else "self_cpu_memory_usage"
    events = [e for e in prof.events() if getattr(e, field, 0)]
    events.sort(key=lambda e: e.time_range.start)
    running = peak = 0
    for e in events:
        running += getattr(e, field)
        peak = max(peak, running)
    return peak, result
