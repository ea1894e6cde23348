"""Shared pytest fixtures: ONE Ray session for the whole test run, and a temporary venvs root.

``ray.init`` costs 11-14 s on our 2-core machine, so every test that needs Ray asks for the
session-scoped ``ray_session`` fixture instead of starting its own: it calls
``init_ray(num_cpus=8)`` (8 logical CPUs oversubscribe the 2 real ones so placement groups do
not starve other actors), with a private temp dir, and shuts Ray down at the end of the
session. Tests that need a *different* Ray (e.g. the simulated two-node cluster in
``tests/unit/test_virtual_cluster.py``) run it in a subprocess, which gets its own Ray next to
this one without touching it. Tests must give back what they reserve (call
``cluster.shutdown()`` / ``group.shutdown()``, or use fixtures that do).

``make_worker`` builds single-rank `FSDP2PolicyWorker`s in the test process from the
requesting module's ``tiny_llama_dir`` fixture (one process group at a time).

The test-only worker classes (tests/workers.py) are entered in the actor registry here.

``worker_venvs_dir`` points ``TEMPERING_VENVS_DIR`` at a session temp folder so isolated
worker venvs are built there (once per session), never in the repo's ``venvs/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Before Ray is imported anywhere (see tempering/distributed/virtual_cluster.py).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402

from tempering.distributed.actor_environments import (  # noqa: E402
    PY_EXECUTABLES,
    register_actor_environment,
)

# The test-only worker classes (tests/workers.py), by name: the driver must not import them.
for _name in ("EchoWorker", "WeightSinkWorker", "AllReduceWorker", "RaisingWorker",
              "DyingWorker", "HangInInitWorker", "PlacementProbeWorker"):  # fmt: skip
    register_actor_environment(f"tests.workers.{_name}", PY_EXECUTABLES.SYSTEM)
register_actor_environment("tests.workers.CowsayWorker", PY_EXECUTABLES.ISOLATION_PROBE)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[dict[str, float]]:
    """A Ray shared by the whole session; yields ``ray.cluster_resources()``."""
    import ray

    from tempering.distributed.virtual_cluster import init_ray

    if ray.is_initialized():  # started by someone else in this process: share it
        yield ray.cluster_resources()
        return
    temp_dir = tempfile.mkdtemp(prefix="ray_t_", dir="/tmp")
    resources = init_ray(num_cpus=8, temp_dir=temp_dir)
    try:
        yield resources
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def worker_venvs_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A session-wide venvs root, exported as ``TEMPERING_VENVS_DIR`` while the session runs."""
    root = tmp_path_factory.mktemp("venvs")
    previous = os.environ.get("TEMPERING_VENVS_DIR")
    os.environ["TEMPERING_VENVS_DIR"] = str(root)
    try:
        yield root
    finally:
        if previous is None:
            os.environ.pop("TEMPERING_VENVS_DIR", None)
        else:
            os.environ["TEMPERING_VENVS_DIR"] = previous


@pytest.fixture
def make_worker(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch):
    """Build single-rank workers on the module's ``tiny_llama_dir`` (1 thread unless given),
    leaving the process group on teardown."""
    from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    built: list[FSDP2PolicyWorker] = []

    def build(**kwargs) -> FSDP2PolicyWorker:
        if built:  # one process group per process: reuse it by tearing the old one down
            built[-1].shutdown()
        kwargs.setdefault("num_threads", 1)
        built.append(FSDP2PolicyWorker(tiny_llama_dir, **kwargs))
        return built[-1]

    yield build
    if built:
        built[-1].shutdown()


# ---- the order of the slow tier: tests that need the machine to themselves first, then the rest
# with the release image building in the background (tests/functional/test_container.py), the
# container test last


def _container_items(items: list[pytest.Item]) -> list[pytest.Item]:
    return [item for item in items if item.path.name == "test_container.py"]


def _alone_items(items: list[pytest.Item]) -> list[pytest.Item]:
    return [item for item in items if item.get_closest_marker("alone") is not None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``alone`` tests run first, while no Ray and no image build share the cores (a Ray
    worker that starts in place of one a test ended imports for seconds: measured, it took a
    core from the busy-loop thread test); the container test runs last, so the image it
    checks builds in the background meanwhile."""
    first, last = _alone_items(items), _container_items(items)
    rest = [item for item in items if item not in first and item not in last]
    items[:] = first + rest + last


def pytest_collection_finish(session: pytest.Session) -> None:
    """A session that will run the container test starts its image build now, or as soon as
    its ``alone`` tests are done."""
    if not _alone_items(session.items):
        _start_image_build(session)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if item.get_closest_marker("alone") is not None and (
        nextitem is None or nextitem.get_closest_marker("alone") is None
    ):
        _start_image_build(item.session)


def _start_image_build(session: pytest.Session) -> None:
    selected = _container_items(session.items)
    if selected and not session.config.option.collectonly:
        selected[0].module.start_image_build(session.config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    selected = _container_items(session.items)
    if selected:
        selected[0].module.stop_image_build(session.config)
