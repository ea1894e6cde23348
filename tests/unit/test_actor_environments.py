"""Isolated worker environments: the executable table, the registry, venv build / reuse /
forced rebuild, a worker that imports a package the driver does not have, and frozen
launchers. Venvs are built under a session temp dir (``worker_venvs_dir``), never the repo's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tempering.distributed import actor_environments as ae
from tempering.distributed.actor_environments import (
    ACTOR_ENVIRONMENT_REGISTRY,
    PY_EXECUTABLES,
    create_local_venv,
    get_actor_executable,
    make_py_executables,
    register_actor_environment,
    resolve_python,
    uv_sync_args,
)

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
COWSAY = "tests.workers.CowsayWorker"


def test_executables_come_from_one_torch_group_switch(monkeypatch):
    cpu = make_py_executables("cpu")
    assert cpu.SYSTEM == sys.executable
    assert cpu.BASE == "uv run --locked"
    assert cpu.VLLM == "uv run --locked --extra vllm"
    assert cpu.ISOLATION_PROBE == "uv run --locked --no-compile-bytecode --extra isolation-probe"
    gpu = make_py_executables("gpu")
    assert gpu.VLLM == "uv run --locked --no-group cpu --group gpu --extra vllm-gpu"
    assert uv_sync_args(gpu.VLLM) == [
        "--locked",
        "--no-dev",
        "--no-group",
        "cpu",
        "--group",
        "gpu",
        "--extra",
        "vllm-gpu",
    ]
    monkeypatch.setenv("TEMPERING_TORCH_GROUP", "tpu")
    with pytest.raises(ValueError, match="TEMPERING_TORCH_GROUP='tpu'.*'cpu' or 'gpu'"):
        ae.torch_group()
    with pytest.raises(ValueError, match="option '--with' is not supported"):
        uv_sync_args("uv run --locked --with cowsay")


def test_registry_lookup_and_registration(monkeypatch):
    assert get_actor_executable(COWSAY) == PY_EXECUTABLES.ISOLATION_PROBE
    with pytest.raises(KeyError, match=r"register_actor_environment\('my.pkg.Worker'"):
        get_actor_executable("my.pkg.Worker")
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, "placeholder.Key", "x")  # restores registry
    register_actor_environment("my.pkg.Worker", PY_EXECUTABLES.BASE)
    try:
        assert get_actor_executable("my.pkg.Worker") == "uv run --locked"
    finally:
        del ACTOR_ENVIRONMENT_REGISTRY["my.pkg.Worker"]
    with pytest.raises(ValueError, match="fully qualified"):
        register_actor_environment("Worker", PY_EXECUTABLES.BASE)


def _marker(venv: Path) -> Path:
    return venv / ae.MARKER_FILE


def test_venv_build_reuse_and_forced_rebuild(worker_venvs_dir, monkeypatch):
    assert importlib.util.find_spec("cowsay") is None, "the driver's .venv must not have cowsay"
    venv = worker_venvs_dir / "probe-lifecycle"
    start = time.perf_counter()
    python = create_local_venv(PY_EXECUTABLES.ISOLATION_PROBE, "probe-lifecycle")
    cold = time.perf_counter() - start
    assert Path(python) == venv / "bin" / "python"
    marker = json.loads(_marker(venv).read_text())
    assert marker["sync_args"] == [
        "--locked",
        "--no-dev",
        "--no-compile-bytecode",
        "--extra",
        "isolation-probe",
    ]
    out = subprocess.run(
        [python, "-c", "import cowsay, ray, sys; print(ray.__version__, sys.prefix)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    import ray

    assert out.returncode == 0, out.stderr
    version, prefix = out.stdout.split()
    assert version == ray.__version__  # same lock -> same ray as the driver
    assert Path(prefix) == venv

    first_mtime = _marker(venv).stat().st_mtime_ns
    start = time.perf_counter()
    assert create_local_venv(PY_EXECUTABLES.ISOLATION_PROBE, "probe-lifecycle") == python
    warm = time.perf_counter() - start
    assert _marker(venv).stat().st_mtime_ns == first_mtime, "a matching venv was rebuilt"
    print(f"\nvenv build: cold {cold:.2f} s, warm (reuse) {warm:.3f} s")

    # A stale marker (lock changed) triggers a rebuild; so does NRL_FORCE_REBUILD_VENVS.
    _marker(venv).write_text(json.dumps({**marker, "uv_lock_md5": "stale"}))
    create_local_venv(PY_EXECUTABLES.ISOLATION_PROBE, "probe-lifecycle")
    assert json.loads(_marker(venv).read_text()) == marker
    second_mtime = _marker(venv).stat().st_mtime_ns
    monkeypatch.setenv("NRL_FORCE_REBUILD_VENVS", "true")
    create_local_venv(PY_EXECUTABLES.ISOLATION_PROBE, "probe-lifecycle")
    assert _marker(venv).stat().st_mtime_ns > second_mtime


def test_worker_imports_what_the_driver_cannot(ray_session, worker_venvs_dir):
    from tempering.distributed.virtual_cluster import RayVirtualCluster
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

    assert importlib.util.find_spec("cowsay") is None, "the driver's .venv must not have cowsay"
    cluster = RayVirtualCluster([1], num_cpus_per_bundle=1, name="iso-test")
    try:
        timings = []
        for _ in range(2):  # cold (venv built unless an earlier test did), then warm
            start = time.perf_counter()
            group = RayWorkerGroup(cluster, RayWorkerBuilder(COWSAY), "cowsay")
            timings.append(time.perf_counter() - start)
            try:
                (said,) = group.get_all_worker_results(
                    group.run_all_workers_single_data("say", "isolated"), timeout_s=60
                )
            finally:
                group.shutdown()
            venv = (worker_venvs_dir / COWSAY).resolve()
            assert "isolated" in said["said"]
            assert Path(said["python"]).is_relative_to(venv), said["python"]
            assert Path(said["cowsay_file"]).resolve().is_relative_to(venv)
        print(f"\ncowsay group start: first {timings[0]:.1f} s, second {timings[1]:.1f} s")
        assert "cowsay" not in sys.modules
    finally:
        cluster.shutdown()


def _freeze(out: Path, venvs: Path, *fqns: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "freeze_worker_venvs.py"), "--out", str(out), *fqns],
        env={**os.environ, "TEMPERING_VENVS_DIR": str(venvs)},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_frozen_launchers(worker_venvs_dir, tmp_path, monkeypatch):
    out = tmp_path / "bin"
    proc = _freeze(out, worker_venvs_dir, f"{COWSAY}={PY_EXECUTABLES.ISOLATION_PROBE}")
    assert proc.returncode == 0, proc.stderr
    launcher = out / f"python-{COWSAY}"
    run = subprocess.run(
        [str(launcher), "-c", "import cowsay, sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == (worker_venvs_dir / COWSAY).resolve()
    monkeypatch.setenv("TEMPERING_FROZEN_ENVS_DIR", str(out))
    assert resolve_python(COWSAY, PY_EXECUTABLES.ISOLATION_PROBE) == str(launcher)
    assert ae.venv_state(COWSAY, PY_EXECUTABLES.ISOLATION_PROBE) == "frozen"

    # `python-<fqn> -m pip ...` works (uv venvs have no pip: it goes through `uv pip`) and warns
    # that the change is local-only.
    pip = subprocess.run(
        [str(launcher), "-m", "pip", "show", "cowsay"], capture_output=True, text=True, timeout=60
    )
    assert pip.returncode == 0, pip.stderr
    assert "Name: cowsay" in pip.stdout
    assert "WARNING: changing a frozen worker venv is local-only" in pip.stderr

    # NRL_FORCE_REBUILD_VENVS bypasses the launcher and rebuilds the venv behind it.
    marker = worker_venvs_dir / COWSAY / ae.MARKER_FILE
    before = marker.stat().st_mtime_ns
    monkeypatch.setenv("NRL_FORCE_REBUILD_VENVS", "true")
    assert ae.venv_state(COWSAY, PY_EXECUTABLES.ISOLATION_PROBE) == "stale"
    python = resolve_python(COWSAY, PY_EXECUTABLES.ISOLATION_PROBE)
    assert python == str(worker_venvs_dir / COWSAY / "bin" / "python")
    assert marker.stat().st_mtime_ns > before


def test_launchers_of_same_named_classes_do_not_collide(worker_venvs_dir, tmp_path, monkeypatch):
    # Two worker classes called `Worker` in different modules, in different environments.
    a, b = "pkg_a.workers.Worker", "pkg_b.workers.Worker"
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, a, PY_EXECUTABLES.ISOLATION_PROBE)
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, b, sys.executable)
    out = tmp_path / "bin"
    spec = importlib.util.spec_from_file_location(
        "freeze", REPO / "tools" / "freeze_worker_venvs.py"
    )
    freeze = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(freeze)
    write_launcher = freeze.write_launcher
    la = write_launcher(out, a, str(worker_venvs_dir / "venv-a" / "bin" / "python"))
    lb = write_launcher(out, b, sys.executable)
    assert la != lb and la.exists() and lb.exists()
    monkeypatch.setenv("TEMPERING_FROZEN_ENVS_DIR", str(out))
    assert resolve_python(a, PY_EXECUTABLES.ISOLATION_PROBE) == str(la)
    assert resolve_python(b, sys.executable) == str(lb)
    assert str(worker_venvs_dir / "venv-a") in la.read_text()
    assert sys.executable in lb.read_text()


def test_freeze_tool_refuses_a_class_without_a_venv(worker_venvs_dir, tmp_path):
    proc = _freeze(
        tmp_path / "bin", worker_venvs_dir, f"tests.workers.EchoWorker={PY_EXECUTABLES.SYSTEM}"
    )
    assert proc.returncode == 2
    assert "not a registered worker class with a venv to build" in proc.stderr


def test_envs_command_lists_states(worker_venvs_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "tempering.cli", "envs",
         f"{COWSAY}={PY_EXECUTABLES.ISOLATION_PROBE}",
         f"tests.workers.EchoWorker={PY_EXECUTABLES.SYSTEM}"],
        env={**os.environ, "TEMPERING_VENVS_DIR": str(worker_venvs_dir)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        f"{COWSAY}\n    executable: uv run --locked --no-compile-bytecode --extra isolation-probe"
        in proc.stdout
    )
    assert "state: interpreter" in proc.stdout
    assert f"venvs root: {worker_venvs_dir}" in proc.stdout


def test_list_editable_packages_finds_the_checkout():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "list_editable_packages.py"), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    driver = json.loads(proc.stdout)["driver"]
    mine = [p for p in driver["packages"] if p["from_checkout"]]
    assert [p["name"] for p in mine if p["kind"] == "editable"] == ["tempering"]
    assert all(Path(p["path"]).resolve() == REPO for p in mine)
