"""The policy workers' memory allocator: mimalloc, preloaded, instead of glibc's malloc.

A training step allocates and frees gigabytes of activations in blocks of 1-20 MB. glibc keeps
freed blocks inside its heap and cannot reuse a hole for a larger block, so within one step its
heap grew to about twice the live tensors: SmolLM2-135M LoRA SFT (one rank, micro-batch 4 x
384) held 2.2-2.4 GiB live (``mallinfo2``) at a resident peak of 5.3-5.7 GiB. mimalloc
(Microsoft's allocator, from the ``cmeel-mimalloc`` wheel) sorts blocks by size class:
3.5-3.7 GiB for the same steps, and no slower, once it keeps what it frees
(``MIMALLOC_PURGE_DELAY=-1``; with its default purging, returning pages to the kernel and
faulting them back in cost ~25% of a step). CHANGELOG.md ("LoRA", in the measurement history) has the figures.

The library has to be loaded before the process starts, so `allocator_env` gives the variables
a worker group starts its workers with (``LD_PRELOAD``), and `check_allocator` (in the worker)
logs when the allocator asked for is not the one loaded.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

ALLOCATOR_ENV = "TEMPERING_ALLOCATOR"
ALLOCATORS = ("mimalloc", "system")
# Keep freed memory: returning it to the kernel and faulting it back in cost ~25% of a step.
MIMALLOC_OPTIONS = {"MIMALLOC_PURGE_DELAY": "-1"}


def mimalloc_library() -> Path | None:
    """The shared library of the installed ``cmeel-mimalloc`` wheel, or None."""
    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmimalloc.so.") and f.name.count(".") == 2:  # libmimalloc.so.3
            return Path(str(f.locate())).resolve()
    return None


def allocator_env(name: str) -> dict[str, str]:
    """Environment variables that start a worker with allocator ``name``."""
    if name not in ALLOCATORS:
        raise ValueError(f"allocator {name!r} is unknown; use one of {ALLOCATORS}")
    if name == "system":
        return {ALLOCATOR_ENV: "system"}
    if os.environ.get("LD_PRELOAD"):
        logger.warning(
            "policy.allocator=mimalloc: not preloaded, because LD_PRELOAD=%s is already set "
            "(yours is kept); unset it or set policy.allocator=system to silence this",
            os.environ["LD_PRELOAD"],
        )
        return {ALLOCATOR_ENV: "system"}
    library = mimalloc_library()
    if library is None:
        raise FileNotFoundError(
            "policy.allocator=mimalloc needs the cmeel-mimalloc package (a dependency of "
            "tempering on Linux: `uv sync` installs it); or set policy.allocator=system"
        )
    return {"LD_PRELOAD": str(library), ALLOCATOR_ENV: "mimalloc", **MIMALLOC_OPTIONS}


def loaded_allocator() -> str:
    """ "mimalloc" when its library is mapped into this process, else "system"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def check_allocator() -> str:
    """The allocator this process runs on; a warning when it is not the one its worker group
    asked for (``TEMPERING_ALLOCATOR``), e.g. a preload path missing on another node."""
    wanted, loaded = os.environ.get(ALLOCATOR_ENV), loaded_allocator()
    if wanted is not None and wanted != loaded:
        logger.warning(
            "this worker runs on the %s allocator, but its group asked for %s (LD_PRELOAD=%s): "
            "is the cmeel-mimalloc wheel installed at that path on this node?",
            loaded, wanted, os.environ.get("LD_PRELOAD"),
        )  # fmt: skip
    return loaded
