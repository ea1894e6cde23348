"""The shipped launch files agree with the image and keep listeners off the network."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _workdir() -> str:
    text = (REPO / "docker" / "Dockerfile").read_text()
    return re.findall(r"^WORKDIR (\S+)$", text, flags=re.M)[-1]


def test_kuberay_manifest_binds_the_dashboard_to_loopback_and_uses_the_image_checkout():
    docs = list(yaml.safe_load_all((REPO / "cluster" / "raycluster.yaml").read_text()))
    cluster = next(d for d in docs if d and d.get("kind") == "RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    pods = [head["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            assert container["workingDir"] == _workdir()
    assert cluster["spec"]["authOptions"]["mode"] == "token"  # Ray's ports need the token
    sub = (REPO / "cluster" / "ray.sub").read_text()
    assert "0.0.0.0" not in sub and "export RAY_AUTH_MODE=token" in sub and "umask 077" in sub


def test_scripts_parse():
    for script in ("cluster/ray.sub", "docker/build.sh"):
        proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
