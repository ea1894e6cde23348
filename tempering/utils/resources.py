"""What each worker role uses: CPU, memory and GPU per step, in metrics.jsonl.

With ``logger.monitor_gpus`` (NeMo RL's key; on by default here) every training step's record
gains, for each role -- ``controller``, ``policy``, ``generation`` (split generation),
``environment`` (environment actors) --

- ``resources/<role>/cpu_cores``: CPU time the role's processes used since the last sample,
  per second of wall time (1.0 = one core kept busy; children such as math-verify's workers
  count towards their parent);
- ``resources/<role>/peak_rss_gb``: the largest peak resident memory of one of its processes;
- ``resources/<role>/threads``: torch's CPU threads in its processes together, at the sample,
  and ``thread_changes``, how often they were changed so far (a worker lowers its threads while
  other programs hold its cores and raises them after, ``tempering.utils.threads``);
- ``resources/<role>/peak_gpu_mem_gb`` and ``gpu_util`` (0-1) where the process uses CUDA:
  torch's peak allocation, and the device's utilisation from NVML (``nvidia-ml-py``; without
  it the metric is absent and a warning says so once per process).

Every process answers :func:`process_usage` (worker groups through
``IsolatedWorkerInitializer.resource_usage``, environment actors through the method the
registry adds); :class:`ResourceMonitor` turns two successive answers into rates. A sample is
one small Ray call per worker, made between steps while the workers are idle.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping

from tempering.utils.threads import changes as thread_changes

log = logging.getLogger(__name__)

_warned_no_nvml = False


def current_rss_gb() -> float:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def reset_peak_rss() -> None:
    """Restart this process's resident-memory high-water mark (Linux: ``VmHWM`` in
    /proc/self/status, which `process_usage` reports as ``rss_hwm_gb``), so the peak of one
    phase (e.g. training steps, not loading) can be read on its own. Memory the allocator
    holds freed (glibc keeps a large load's freed heap resident) is returned first, so the
    mark starts from what is live."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the mark starts from the resident size
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_hwm_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    return 0.0


def process_usage() -> dict[str, float]:
    """This process's CPU seconds (children included), peak RSS and, when torch uses CUDA
    here, its peak GPU memory and the GPU's utilisation."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    usage = {
        "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
        "wall_s": time.monotonic(),
        "peak_rss_gb": max(me.ru_maxrss, kids.ru_maxrss) / 2**20,  # Linux reports KiB
        "rss_hwm_gb": _rss_hwm_gb(),  # the peak since the last reset_peak_rss (or start)
    }
    torch = sys.modules.get("torch")  # only where torch is already in use
    if torch is not None:
        usage["threads"] = torch.get_num_threads()  # utils/threads.py may lower it
    changed = thread_changes()
    if changed is not None:
        usage["thread_changes"] = changed
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        usage["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        usage.update(_gpu_util(torch))
    return usage


def _gpu_util(torch: object) -> dict[str, float]:  # GPU only: not yet run on hardware
    global _warned_no_nvml
    try:
        return {"gpu_util": torch.cuda.utilization() / 100.0}  # type: ignore[attr-defined]
    except Exception as exc:  # NVML missing (pip install nvidia-ml-py) or unsupported
        if not _warned_no_nvml:
            log.warning("resources: no GPU utilisation in metrics (NVML: %s)", exc)
            _warned_no_nvml = True
        return {}


class ResourceMonitor:
    """Per-role resource metrics from ``sources``: role -> a callable returning one
    `process_usage` dict per process of that role."""

    def __init__(self, sources: Mapping[str, Callable[[], list[dict[str, float]]]]) -> None:
        self.sources = dict(sources)
        self._last: dict[str, list[dict[str, float]]] = {}
        self.sample()  # the baseline the first step's rates are measured from

    def sample(self) -> dict[str, float]:
        """``resources/<role>/<metric>`` since the previous sample."""
        metrics: dict[str, float] = {}
        for role, fetch in self.sources.items():
            now = fetch()
            before = self._last.get(role)
            self._last[role] = now
            key = f"resources/{role}"
            if before is not None and len(before) == len(now):  # same processes: a rate
                metrics[f"{key}/cpu_cores"] = sum(
                    (u["cpu_s"] - b["cpu_s"]) / max(u["wall_s"] - b["wall_s"], 1e-9)
                    for u, b in zip(now, before, strict=True)
                )
            metrics[f"{key}/peak_rss_gb"] = max(u["peak_rss_gb"] for u in now)
            for name in ("threads", "thread_changes"):
                values = [u[name] for u in now if name in u]
                if values:
                    metrics[f"{key}/{name}"] = sum(values)
            gpu = [u for u in now if "peak_gpu_mem_gb" in u]
            if gpu:
                metrics[f"{key}/peak_gpu_mem_gb"] = max(u["peak_gpu_mem_gb"] for u in gpu)
            util = [u["gpu_util"] for u in now if "gpu_util" in u]
            if util:
                metrics[f"{key}/gpu_util"] = sum(util) / len(util)
        return metrics
