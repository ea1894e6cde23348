"""Which Python environment each worker class runs in, and building those environments.

Workers are named by fully qualified class name (FQN). Each FQN maps to an *executable*:

- ``PY_EXECUTABLES.SYSTEM``: the driver's own interpreter (``sys.executable``), no venv.
- ``PY_EXECUTABLES.BASE``: ``uv run --locked`` -- the project's locked dependencies.
- one entry per extra, e.g. ``PY_EXECUTABLES.VLLM`` = ``uv run --locked --extra vllm``.
- ``PY_EXECUTABLES.NEMO_GYM`` = ``pip-venv nemo-gym``: a venv of its own filled from
  `PIP_VENV_SPECS` (NeMo Gym pins openai 2.x and declares Python >= 3.13, so it cannot share
  our uv lock, and uv cannot ignore a Python bound: pip installs Gym's own wheel alone with
  ``--ignore-requires-python``, then ``uv pip`` installs its dependencies, resolved for this
  Python and linked from uv's cache), with this checkout on its path (a ``.pth`` file) so
  worker classes import from it;
- any other string is a path (or a name on ``PATH``) of a ready interpreter or launcher,
  e.g. a frozen ``python-<fqn>`` launcher written by ``tools/freeze_worker_venvs.py``.

For a ``uv ...`` executable, :func:`create_local_venv` builds a venv under
``<venvs root>/<fqn>`` with ``uv sync --locked --no-dev`` plus the executable's extras and
groups (uv hard-links packages from its cache, so this takes seconds), and writes a marker
file recording the lock hash and the sync arguments. The next start reuses the venv when the
marker matches; ``NRL_FORCE_REBUILD_VENVS=true`` rebuilds it. A file lock keeps two builders
(two Ray nodes on a shared filesystem, two test processes) from colliding;
:func:`create_venv_on_nodes` runs the build once on every node of a multi-node cluster.

One place chooses CPU or GPU torch: ``TEMPERING_TORCH_GROUP=cpu|gpu`` (default ``cpu``).
With ``gpu`` the torch group becomes ``gpu`` and the vLLM extra ``vllm-gpu``.

Environment variables: ``TEMPERING_VENVS_DIR`` (venvs root, default ``<repo>/venvs``),
``TEMPERING_TORCH_GROUP``, ``NRL_FORCE_REBUILD_VENVS``, ``TEMPERING_FROZEN_ENVS_DIR`` (a folder
of ``python-<fqn>`` launchers to use instead of building venvs; ``NRL_FORCE_REBUILD_VENVS``
rebuilds the venvs behind them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from tempering.distributed.fingerprint import FORCE_REBUILD_ENV, REPO_ROOT, truthy_env

logger = logging.getLogger(__name__)

TORCH_GROUP_ENV = "TEMPERING_TORCH_GROUP"
VENVS_DIR_ENV = "TEMPERING_VENVS_DIR"
FROZEN_ENVS_DIR_ENV = "TEMPERING_FROZEN_ENVS_DIR"
MARKER_FILE = ".tempering-venv.json"


def torch_group() -> str:
    """The uv dependency group that provides torch: ``cpu`` (default) or ``gpu``."""
    group = os.environ.get(TORCH_GROUP_ENV, "cpu").strip().lower()
    if group not in ("cpu", "gpu"):
        raise ValueError(f"{TORCH_GROUP_ENV}={group!r} is not valid; set it to 'cpu' or 'gpu'.")
    return group


@dataclass(frozen=True)
class PyExecutables:
    """The executables worker classes can run under (see the module docstring)."""

    SYSTEM: str
    BASE: str
    VLLM: str
    ISOLATION_PROBE: str
    NEMO_GYM: str


def make_py_executables(group: str) -> PyExecutables:
    """Build the executable table for torch group ``group`` (``cpu`` or ``gpu``)."""
    base = "uv run --locked" if group == "cpu" else "uv run --locked --no-group cpu --group gpu"
    vllm_extra = "vllm" if group == "cpu" else "vllm-gpu"
    return PyExecutables(
        SYSTEM=sys.executable,
        BASE=base,
        VLLM=f"{base} --extra {vllm_extra}",
        ISOLATION_PROBE=f"{base} --no-compile-bytecode --extra isolation-probe",  # a test probe
        NEMO_GYM="pip-venv nemo-gym",
    )


@dataclass(frozen=True)
class PipVenvSpec:
    """A venv for packages that cannot join the uv lock.

    ``unbounded`` are installed by pip alone (no dependencies) with their ``Requires-Python``
    ignored; their dependencies (extras left out) and ``requirements`` are then installed by
    ``uv pip``, resolved for this Python and linked from uv's cache (pip alone took 191 s for
    NeMo Gym's 160 packages on our 2-core machine; this ~50 s, bytecode compiled included)."""

    unbounded: tuple[str, ...]
    requirements: tuple[str, ...] = ()


# name -> spec, for `pip-venv <name>` executables. NeMo Gym: the version we test against, and
# math-verify for its math_with_judge server (Gym's servers share this one venv).
PIP_VENV_SPECS: dict[str, PipVenvSpec] = {
    "nemo-gym": PipVenvSpec(unbounded=("nemo-gym==0.7.0",), requirements=("math-verify==0.8.0",)),
}


PY_EXECUTABLES = make_py_executables(torch_group())

# The one registry: worker class FQN -> executable. Plugins call register_actor_environment().
ACTOR_ENVIRONMENT_REGISTRY: dict[str, str] = {
    "tempering.models.policy.fsdp2_worker.FSDP2PolicyWorker": PY_EXECUTABLES.SYSTEM,
    "tempering.models.generation.torch_worker.TorchGenerationWorker": PY_EXECUTABLES.SYSTEM,
    "tempering.models.generation.vllm_worker.VllmGenerationWorker": PY_EXECUTABLES.VLLM,
    "tempering.environments.nemo_gym_launcher.NemoGymLauncher": PY_EXECUTABLES.NEMO_GYM,
}


def register_actor_environment(fqn: str, executable: str) -> None:
    """Say which executable worker class ``fqn`` runs under (overrides an existing entry)."""
    if "." not in fqn:
        raise ValueError(f"worker class {fqn!r} must be a fully qualified name, e.g. 'pkg.mod.Cls'")
    ACTOR_ENVIRONMENT_REGISTRY[fqn] = executable


def worker_spec(spec: str) -> tuple[str, str]:
    """``(fqn, executable)`` of a command-line worker spec: ``FQN`` (a registered class) or
    ``FQN=EXECUTABLE`` (a class this process has not registered, e.g. a plugin's or a test's,
    with the executable it runs under)."""
    fqn, sep, executable = spec.partition("=")
    return (fqn, executable) if sep else (fqn, get_actor_executable(fqn))


def get_actor_executable(fqn: str) -> str:
    """The registered executable for ``fqn``; an actionable error when it has none."""
    try:
        return ACTOR_ENVIRONMENT_REGISTRY[fqn]
    except KeyError:
        raise KeyError(
            f"worker class {fqn!r} has no entry in ACTOR_ENVIRONMENT_REGISTRY; call "
            f"tempering.distributed.actor_environments.register_actor_environment({fqn!r}, "
            "PY_EXECUTABLES.SYSTEM) (or BASE / an extra), or pass py_executable= to "
            "RayWorkerBuilder."
        ) from None


def is_uv_executable(executable: str) -> bool:
    """True for ``uv run ...`` executables, which need a venv built for them."""
    return shlex.split(executable)[:2] == ["uv", "run"]


def pip_venv_name(executable: str) -> str | None:
    """The spec name of a ``pip-venv <name>`` executable, else None."""
    words = shlex.split(executable)
    if words[:1] != ["pip-venv"]:
        return None
    if len(words) != 2 or words[1] not in PIP_VENV_SPECS:
        raise ValueError(
            f"executable {executable!r}: use 'pip-venv <name>' with a name from PIP_VENV_SPECS "
            f"({sorted(PIP_VENV_SPECS)})"
        )
    return words[1]


def uv_sync_args(executable: str) -> list[str]:
    """Translate ``uv run --locked [--extra X] [--group G] [--no-group H]
    [--no-compile-bytecode]`` to sync flags. pyproject.toml has uv compile every venv to
    bytecode; ``--no-compile-bytecode`` skips that for a venv whose start-up does not matter
    (the tests' throwaway isolation probes: ~40 s of compiling per build on 2 cores)."""
    words = shlex.split(executable)
    if words[:2] != ["uv", "run"]:
        raise ValueError(f"executable {executable!r} is not a 'uv run ...' command")
    args, i = ["--locked", "--no-dev"], 2
    while i < len(words):
        word = words[i]
        if word in ("--locked", "--frozen"):
            i += 1
        elif word == "--no-compile-bytecode":
            args.append(word)
            i += 1
        elif word in ("--extra", "--group", "--no-group") and i + 1 < len(words):
            args += [word, words[i + 1]]
            i += 2
        else:
            raise ValueError(
                f"executable {executable!r}: option {word!r} is not supported; use only "
                "--locked, --extra X, --group G, --no-group H and --no-compile-bytecode."
            )
    return args


def venvs_root() -> Path:
    """Where worker venvs live: ``$TEMPERING_VENVS_DIR`` or ``<repo>/venvs``."""
    return Path(os.environ.get(VENVS_DIR_ENV) or REPO_ROOT / "venvs").resolve()


def force_rebuild_requested() -> bool:
    """``NRL_FORCE_REBUILD_VENVS`` set to true/1/yes."""
    return truthy_env(os.environ, FORCE_REBUILD_ENV)


def launcher_name(fqn: str) -> str:
    """The frozen launcher's file name for worker class ``fqn``: ``python-<fqn>``.

    The whole fully qualified name, so two classes named alike in different modules
    (``a.mod.Worker``, ``b.mod.Worker``) never share a launcher."""
    return f"python-{fqn}"


def frozen_launcher(fqn: str) -> Path | None:
    """The ``python-<fqn>`` launcher in ``$TEMPERING_FROZEN_ENVS_DIR``, if present and not
    overridden by ``NRL_FORCE_REBUILD_VENVS`` (which rebuilds the venv behind it instead)."""
    folder = os.environ.get(FROZEN_ENVS_DIR_ENV)
    if not folder:
        return None
    launcher = Path(folder) / launcher_name(fqn)
    if not os.access(launcher, os.X_OK):
        return None
    if force_rebuild_requested():
        logger.warning(
            "%s=true: rebuilding the venv of %s from the code's lock instead of using the "
            "frozen launcher %s",
            FORCE_REBUILD_ENV, fqn, launcher,
        )  # fmt: skip
        return None
    return launcher


def _file_md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def _expected_marker(sync_args: list[str]) -> dict[str, object]:
    return {
        "uv_lock_md5": _file_md5(REPO_ROOT / "uv.lock"),
        "pyproject_md5": _file_md5(REPO_ROOT / "pyproject.toml"),
        "sync_args": sync_args,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _marker_matches(venv: Path, expected: dict[str, object]) -> bool:
    try:
        found = json.loads((venv / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return found == expected and (venv / "bin" / "python").exists()


def create_local_venv(
    executable: str,
    venv_name: str,
    *,
    force_rebuild: bool | None = None,
    lock_timeout_s: float = 600.0,
) -> str:
    """Build (or reuse) the venv for ``executable`` on this machine; return its python path.

    ``venv_name`` is usually the worker FQN. Reused when its marker (lock hash, pyproject hash,
    sync arguments, Python minor) matches; rebuilt when ``force_rebuild`` (default: the
    ``NRL_FORCE_REBUILD_VENVS`` variable) is true.
    """
    _need_uv(venv_name)
    sync_args = uv_sync_args(executable)

    def build(venv: Path) -> None:
        env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
        env.pop("VIRTUAL_ENV", None)
        cmd = ["uv", "sync", *sync_args, "--python", sys.executable, "--quiet"]
        _run_build_step(venv, cmd, lock_timeout_s, cwd=REPO_ROOT, env=env)

    return _build_venv(venv_name, _expected_marker(sync_args), build, force_rebuild, lock_timeout_s)


def _need_uv(venv_name: str) -> None:
    if shutil.which("uv") is None:
        raise RuntimeError(
            f"building the worker venv for {venv_name!r} needs `uv` on PATH; install it "
            "(pip install uv) or register a ready interpreter for this worker class."
        )


def create_pip_venv(
    spec_name: str, venv_name: str, *, force_rebuild: bool | None = None, timeout_s: float = 1800.0
) -> str:
    """Build (or reuse) the venv for ``PIP_VENV_SPECS[spec_name]`` under the venvs root with
    this interpreter's Python (Ray needs the same minor version); return its python path.

    The checkout is put on the venv's path with a ``.pth`` file (no copy, no build step).
    Reuse, rebuild (``NRL_FORCE_REBUILD_VENVS``) and locking work as for uv venvs."""
    _need_uv(venv_name)
    spec = PIP_VENV_SPECS[spec_name]
    expected = _pip_expected_marker(spec_name)

    def build(venv: Path) -> None:
        python = str(venv / "bin" / "python")
        _run_build_step(venv, ["uv", "venv", "--quiet", "--seed", "--python", sys.executable,
                               str(venv)], timeout_s)  # fmt: skip
        _run_build_step(venv, [python, "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", "--no-deps",
                               "--ignore-requires-python", "--prefer-binary",
                               *spec.unbounded], timeout_s)  # fmt: skip
        dependencies = _declared_dependencies(python, spec.unbounded)
        # from the checkout, as `uv sync` runs for the uv venvs: our [tool.uv] settings, not
        # those of whatever folder the job was started from
        _run_build_step(venv, ["uv", "pip", "install", "--quiet", "--compile-bytecode",
                               "--python", python, *dependencies, *spec.requirements],
                        timeout_s, cwd=REPO_ROOT)  # fmt: skip
        (site_packages(python) / "tempering-checkout.pth").write_text(f"{REPO_ROOT}\n")

    return _build_venv(venv_name, expected, build, force_rebuild, timeout_s)


def site_packages(python: str) -> Path:
    """The site-packages folder (``purelib``) of the interpreter ``python``."""
    return Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip())  # fmt: skip


def _declared_dependencies(python: str, installed: tuple[str, ...]) -> list[str]:
    """The requirements the packages ``installed`` (requirement strings) declare in `python`'s
    environment, without those that only an extra asks for."""
    from packaging.requirements import Requirement

    names = [Requirement(r).name for r in installed]
    script = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps([r for n in sys.argv[1:] for r in (m.requires(n) or [])]))"
    )
    out = subprocess.run([python, "-c", script, *names], capture_output=True, text=True, check=True)
    wanted = []
    for line in json.loads(out.stdout):
        marker = Requirement(line).marker
        if marker is None or marker.evaluate({"extra": ""}):
            wanted.append(line)
    return wanted


def _pip_expected_marker(spec_name: str) -> dict[str, object]:
    spec = PIP_VENV_SPECS[spec_name]
    return {
        "pip_venv": spec_name,
        "unbounded": list(spec.unbounded),
        "requirements": list(spec.requirements),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "checkout": str(REPO_ROOT),
    }


def _run_build_step(venv: Path, cmd: list[str], timeout_s: float, **kwargs: Any) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(
            f"building worker venv {venv} failed (exit {proc.returncode}): {shlex.join(cmd)}\n"
            f"{proc.stderr.strip()[-3000:]}\nFix the error above, or set "
            f"{FORCE_REBUILD_ENV}=true to start from a clean venv."
        )


def _build_venv(
    venv_name: str,
    expected: dict[str, object],
    build: Callable[[Path], None],
    force_rebuild: bool | None,
    timeout_s: float,
) -> str:
    """Under a file lock: reuse ``<venvs root>/<venv_name>`` when its marker equals `expected`
    (and no rebuild is forced), else rebuild it with `build(venv)` and write the marker."""
    force = force_rebuild_requested() if force_rebuild is None else force_rebuild
    root = venvs_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / venv_name
    lock = filelock.FileLock(str(root / f".{venv_name}.lock"), timeout=timeout_s)
    try:
        with lock:
            if not force and _marker_matches(venv, expected):
                return str(venv / "bin" / "python")
            if venv.exists():
                shutil.rmtree(venv)
            start = time.perf_counter()
            build(venv)
            (venv / MARKER_FILE).write_text(json.dumps(expected, indent=1))
            logger.info("built worker venv %s in %.1f s", venv, time.perf_counter() - start)
    except filelock.Timeout:
        raise TimeoutError(
            f"waited {timeout_s:.0f} s for the lock {lock.lock_file} guarding worker venv {venv}; "
            "another process is building it or left the lock behind -- check for a running "
            "build, then delete the lock file."
        ) from None
    return str(venv / "bin" / "python")


def _build_on_this_node(
    executable: str, venv_name: str, force_rebuild: bool, env: dict[str, str]
) -> str:
    os.environ.update(env)
    return create_local_venv(executable, venv_name, force_rebuild=force_rebuild)


def create_venv_on_nodes(
    executable: str,
    venv_name: str,
    node_ids: list[str],
    *,
    timeout_s: float = 900.0,
) -> str:
    """Build the venv on every node in ``node_ids`` (Ray node ids); return the python path.

    The driver's node builds in-process; every other node runs a Ray task pinned to it with
    ``NodeAffinitySchedulingStrategy``. The path is the same on every node (same venvs root).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    force = force_rebuild_requested()
    here = ray.get_runtime_context().get_node_id()
    remote_nodes = sorted(set(node_ids) - {here})
    env = {
        k: os.environ[k]
        for k in (VENVS_DIR_ENV, TORCH_GROUP_ENV, "UV_CACHE_DIR")
        if k in os.environ
    }
    build = ray.remote(num_cpus=0, max_retries=0)(_build_on_this_node)
    refs = [
        build.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        ).remote(executable, venv_name, force, env)
        for node in remote_nodes
    ]
    python = create_local_venv(executable, venv_name, force_rebuild=force)
    if refs:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            raise TimeoutError(
                f"building worker venv {venv_name!r} on nodes {remote_nodes} did not finish "
                f"within {timeout_s:.0f} s"
            )
        paths = ray.get(ready)
        if any(p != python for p in paths):
            raise RuntimeError(
                f"worker venv {venv_name!r} has different paths on different nodes: {paths} vs "
                f"{python}; set {VENVS_DIR_ENV} to the same absolute path on every node."
            )
    return python


def builds_venv(executable: str) -> bool:
    """True when ``executable`` is one tempering builds a venv for (``uv run ...`` or
    ``pip-venv <name>``), False for a ready interpreter or launcher."""
    return is_uv_executable(executable) or pip_venv_name(executable) is not None


def build_worker_venv(fqn: str, executable: str) -> str:
    """Build (or reuse) on this machine the venv of worker class ``fqn``; return its python.

    ``executable`` must be one :func:`builds_venv` accepts."""
    spec = pip_venv_name(executable)
    if spec is not None:
        return create_pip_venv(spec, fqn)
    return create_local_venv(executable, fqn)


def venv_state(fqn: str, executable: str) -> str:
    """How a worker of class ``fqn`` would start now, without building anything:
    ``frozen`` (a launcher), ``ready`` (its venv matches the code), ``stale`` (its venv must be
    rebuilt), ``missing`` (not built yet) or ``interpreter`` (a ready interpreter)."""
    folder = os.environ.get(FROZEN_ENVS_DIR_ENV)
    if folder and os.access(Path(folder) / launcher_name(fqn), os.X_OK):
        if not force_rebuild_requested():
            return "frozen"
    if not builds_venv(executable):
        return "interpreter"
    spec = pip_venv_name(executable)
    expected = _pip_expected_marker(spec) if spec else _expected_marker(uv_sync_args(executable))
    venv = venvs_root() / fqn
    if not venv.exists():
        return "missing"
    if force_rebuild_requested() or not _marker_matches(venv, expected):
        return "stale"
    return "ready"


def resolve_python(fqn: str, executable: str, node_ids: list[str] | None = None) -> str:
    """The interpreter path a worker of class ``fqn`` should run under.

    A frozen launcher wins (unless ``NRL_FORCE_REBUILD_VENVS``); a ``uv run`` executable gets
    its venv built (on every node in ``node_ids`` when given, else locally), a ``pip-venv``
    one locally; anything else is a path or a name on PATH.
    """
    frozen = frozen_launcher(fqn)
    if frozen is not None:
        logger.info("worker class %s runs under the frozen launcher %s", fqn, frozen)
        return str(frozen)
    if is_uv_executable(executable) and node_ids:
        return create_venv_on_nodes(executable, fqn, node_ids)
    if builds_venv(executable):
        return build_worker_venv(fqn, executable)
    found = shutil.which(executable)
    if found is None:
        raise FileNotFoundError(
            f"executable {executable!r} for worker class {fqn!r} is neither a file nor on "
            "PATH; register an existing interpreter or a 'uv run --locked ...' executable."
        )
    return found
