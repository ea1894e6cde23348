"""List the packages each environment installs editable from this checkout.

    uv run --no-sync python tools/list_editable_packages.py [--json]

For the driver's environment and every worker venv (under ``TEMPERING_VENVS_DIR``, and the ones
behind the frozen launchers in ``TEMPERING_FROZEN_ENVS_DIR``) it prints each distribution whose
``direct_url.json`` says ``editable`` and each ``.pth`` file that puts a folder of this checkout
on the path. These are the packages that follow a folder mounted over the image's checkout
(``-v $PWD/3rdparty/X:/opt/tempering/src/3rdparty/X``) without rebuilding anything; anything
not listed is a copy inside the venv and needs a rebuild (``NRL_FORCE_REBUILD_VENVS=true``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tempering.distributed.actor_environments import FROZEN_ENVS_DIR_ENV, REPO_ROOT, venvs_root

# Runs inside each interpreter: editable distributions and .pth folders, as JSON.
_PROBE = r"""
import importlib.metadata as md, json, pathlib, site, sys, urllib.parse
found = []
for dist in md.distributions():
    raw = dist.read_text("direct_url.json")
    if not raw:
        continue
    info = json.loads(raw)
    if info.get("dir_info", {}).get("editable"):
        path = urllib.parse.unquote(urllib.parse.urlparse(info["url"]).path)
        found.append({"kind": "editable", "name": dist.metadata["Name"],
                      "version": dist.version, "path": path})
for folder in {*site.getsitepackages()}:
    for pth in sorted(pathlib.Path(folder).glob("*.pth")):
        for line in pth.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import")) and pathlib.Path(line).is_dir() \
                    and line not in {f["path"] for f in found}:
                found.append({"kind": "pth", "name": pth.name, "version": "", "path": line})
print(json.dumps({"prefix": sys.prefix, "packages": found}))
"""


def interpreters() -> dict[str, str]:
    """``{label: python}`` for the driver and every worker venv or frozen launcher found."""
    found = {"driver": sys.executable}
    root = venvs_root()
    if root.is_dir():
        for venv in sorted(root.iterdir()):
            python = venv / "bin" / "python"
            if python.exists():
                found[venv.name] = str(python)
    frozen = os.environ.get(FROZEN_ENVS_DIR_ENV)
    if frozen and Path(frozen).is_dir():
        for launcher in sorted(Path(frozen).glob("python-*")):
            found.setdefault(launcher.name.removeprefix("python-"), str(launcher))
    return found


def probe(python: str) -> dict:
    proc = subprocess.run(
        [python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    checkout = str(REPO_ROOT)
    report = {}
    for label, python in interpreters().items():
        result = probe(python)
        for pkg in result.get("packages", []):
            pkg["from_checkout"] = pkg["path"] == checkout or pkg["path"].startswith(
                checkout + os.sep
            )
        report[label] = {"python": python, **result}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"checkout: {checkout}")
    for label, entry in report.items():
        print(f"{label} ({entry['python']})")
        if "error" in entry:
            print(f"  could not inspect: {entry['error']}")
            continue
        editable = [p for p in entry["packages"] if p["from_checkout"]]
        for pkg in editable:
            what = f"{pkg['name']} {pkg['version']}".strip()
            print(f"  {pkg['kind']:<8} {what:<32} {pkg['path']}")
        if not editable:
            print("  (nothing editable from the checkout)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
