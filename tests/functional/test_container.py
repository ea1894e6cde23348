"""The release container, built and run on this machine (slow tier).

Builds ``docker/Dockerfile``'s release target with ``docker/build.sh`` from this checkout (CI
runs it in a fresh clone; ``.dockerignore`` keeps venvs, results and caches out) -- in the
background from the start of the session, this module running last (tests/conftest.py) --
then inside the image:

1. the main job runs with no network (a namespace with only loopback) and builds no venv at start-up (no "built worker
   venv" log line; every venv-backed worker class is ``frozen``), and a frozen vLLM venv
   imports vllm offline; the time to first step is printed;
2. the fingerprint check is clean;
3. after a change to pyproject.toml: the check and the main job print the per-key banner and
   exit non-zero; ``NRL_FORCE_REBUILD_VENVS=true`` rebuilds a worker venv from the code's lock
   (offline, from the image's uv cache) and the main job runs; ``NRL_IGNORE_VERSION_MISMATCH=1``
   runs with a warning.

``podman run`` is refused on these machines (see ../shared/FACTS.md), so commands run with
``buildah run --isolation chroot`` in a working container made from the image.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
REPO = Path(__file__).resolve().parents[2]
TAG = "localhost/tempering:release-cpu-test"
STEP_LINE = re.compile(r"^step 1/\d+ \|")
MAIN_JOB = (
    "uv run examples/run_grpo_math.py grpo.max_num_steps={steps} "
    "logger.log_dir={out}/logs checkpointing.checkpoint_dir={out}/ckpt"
)
VLLM = "tempering.models.generation.vllm_worker.VllmGenerationWorker"
NEMO_GYM = "tempering.environments.nemo_gym_launcher.NemoGymLauncher"
COWSAY = "tests.workers.CowsayWorker"
# A test-only worker: the image's `tempering envs` knows it only when told its executable.
COWSAY_SPEC = shlex.quote(f"{COWSAY}=uv run --locked --no-compile-bytecode --extra isolation-probe")


def _timed(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 900):
    """Run ``cmd``; return (exit code, output, seconds to the first 'step 1/N |' line or None)."""
    start = time.monotonic()
    first_step = None
    lines = []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if first_step is None and STEP_LINE.match(line):
            first_step = time.monotonic() - start
        if time.monotonic() - start > timeout:
            proc.kill()
            break
    proc.wait()
    return proc.returncode, "".join(lines), first_step


BUILD = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def start_image_build(config: pytest.Config) -> None:
    """Start ``docker/build.sh`` in the background, its output in a log file. tests/conftest.py
    calls this when the session begins and runs this module last: the build's downloads and
    disk writes (43% of its 514 s left the 2 cores idle, 2026-11-27) overlap the other slow
    tests instead of adding to them. Root only (buildah)."""
    if os.geteuid() != 0 or BUILD in config.stash:
        return
    log = Path(tempfile.mkdtemp(prefix="tempering_image_build_")) / "build.log"
    # The last session's test image goes first, here in the background: removing its layers
    # took 60-90 s when the module's teardown did it, at the very end of the tier.
    build = (f"podman rmi -f {TAG} >/dev/null 2>&1; podman image prune -f >/dev/null 2>&1; "
             f"exec bash docker/build.sh --tag {TAG}")  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", build], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    config.stash[BUILD] = (proc, log)


def stop_image_build(config: pytest.Config) -> None:
    """End a background build nobody waited for (the session stopped before this module)."""
    proc, _ = config.stash.get(BUILD, (None, None))
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def container(request):
    if os.geteuid() != 0:
        pytest.skip("building and running the image here needs root (buildah, unshare -n)")
    start_image_build(request.config)  # already running unless this module runs alone
    proc, log = request.config.stash[BUILD]
    proc.wait(timeout=3000)
    output = log.read_text()
    assert proc.returncode == 0, output[-6000:]
    built = re.search(r"built \S+ in (\d+) s; size (\d+) MB", output)
    assert built, output[-3000:]
    figures = {"build_s": int(built.group(1)), "size_mb": int(built.group(2))}
    print(f"\nimage build: {figures['build_s']} s, size {figures['size_mb']} MB")
    name = subprocess.run(
        ["buildah", "from", "--pull-never", TAG], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        yield name, figures
    finally:
        # The working container goes; the image stays until the next session's build removes
        # it (start_image_build), and the Debian base stays.
        subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


def _in(container: str, command: str, timeout: float = 900, offline: bool = False, **env: str):
    """Run a shell command in the working container (cwd: the image's checkout).

    ``offline``: in a network namespace of its own with only loopback up (``unshare -n``;
    ``buildah run --isolation chroot`` cannot take ``--network none``), and ``UV_OFFLINE=1``."""
    if offline:
        env = {**env, "UV_OFFLINE": "1"}
    flags = [x for k, v in env.items() for x in ("--env", f"{k}={v}")]
    cmd = ["buildah", "run", "--isolation", "chroot", *flags, container, "--", "sh", "-c", command]
    if offline:
        cmd = ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {shlex.join(cmd)}"]
    return _timed(cmd, timeout=timeout)


def test_release_image(container, tmp_path):
    container, figures = container
    # 1. Start-up syncs nothing, offline; the frozen venvs are used.
    rc, out, in_image = _in(container, MAIN_JOB.format(steps=5, out="/tmp/run1"), offline=True)
    assert rc == 0, out[-4000:]
    assert in_image is not None, out[-2000:]
    assert "built worker venv" not in out
    rc, out, _ = _in(
        container, f"uv run tempering envs {VLLM} {NEMO_GYM} {COWSAY_SPEC}", offline=True
    )
    assert rc == 0, out
    for fqn in (VLLM, COWSAY, NEMO_GYM):
        assert f"{fqn}\n    executable: " in out
        block = out.split(f"{fqn}\n", 1)[1].split("\n", 2)[1]
        assert block.strip() == "state: frozen", out
    rc, out, _ = _in(
        container, f"python-{VLLM} -c 'import vllm, sys; print(vllm.__version__, sys.prefix)'",
        offline=True,
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    assert f"/opt/tempering/venvs/{VLLM}" in out

    print(f"time to first step in the image: {in_image:.1f} s")
    figures.update(first_step_image_s=round(in_image, 1))
    # The figures, for the README: pytest shows no prints of a passing test.
    (tmp_path / "container_figures.json").write_text(json.dumps(figures))

    # 2. The fingerprint check is clean.
    rc, out, _ = _in(container, "uv run tempering check-container")
    assert rc == 0 and "matches" in out, out

    # 3. After a change to pyproject.toml: banner and exit, unless force-rebuild or ignore.
    rc, _, _ = _in(container, "echo '# changed inside the container' >> pyproject.toml")
    assert rc == 0
    rc, out, _ = _in(container, "uv run tempering check-container")
    assert rc == 1, out
    assert "pyproject.toml:\n    Container: " in out and "uv.lock:" not in out
    assert "(2) set NRL_FORCE_REBUILD_VENVS=true" in out
    rc, out, first = _in(container, MAIN_JOB.format(steps=1, out="/tmp/run2"))
    assert rc == 1 and first is None and "pyproject.toml:\n    Container: " in out, out[-3000:]

    rc, out, _ = _in(
        container, f"uv run tempering envs --build {COWSAY_SPEC}",
        offline=True, NRL_FORCE_REBUILD_VENVS="true",
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    assert re.search(r"state: stale -> built /opt/tempering/venvs/\S+ in [\d.]+ s", out), out
    rc, out, _ = _in(
        container, f"python-{COWSAY} -c 'import cowsay, json, pathlib, sys; "
        "print(json.loads((pathlib.Path(sys.prefix) / \".tempering-venv.json\").read_text())"
        "[\"pyproject_md5\"])'",
    )  # fmt: skip
    assert rc == 0, out
    rc, current, _ = _in(container, "md5sum pyproject.toml")
    assert out.strip() == current.split()[0], "the rebuilt venv does not record the new pyproject"
    rc, out, first = _in(
        container,
        MAIN_JOB.format(steps=2, out="/tmp/run3"),
        offline=True,
        NRL_FORCE_REBUILD_VENVS="true",
    )
    assert rc == 0 and first is not None, out[-3000:]
    assert "NRL_FORCE_REBUILD_VENVS=true: continuing" in out

    rc, out, first = _in(
        container,
        MAIN_JOB.format(steps=2, out="/tmp/run4"),
        offline=True,
        NRL_IGNORE_VERSION_MISMATCH="1",
    )
    assert rc == 0 and first is not None, out[-3000:]
    assert "NRL_IGNORE_VERSION_MISMATCH=1: continuing despite the mismatch" in out
    print(f"python {sys.version.split()[0]}; container checks passed")
