"""The docs site builds without warnings, and its generated references cover the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import docs_reference  # noqa: E402

from tempering.config import MASTER_CONFIGS  # noqa: E402


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict` fails on any warning: a broken link or anchor, a nav entry missing."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_config_reference_covers_every_key_and_names_no_other():
    page = docs_reference.config_page()
    keys = {
        k
        for master in MASTER_CONFIGS
        for k, _ in docs_reference.config_keys(MASTER_CONFIGS[master])
    }
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    missing = {k for k in keys if k.split(".", 1)[-1] not in rows and k not in rows}
    assert not missing, f"keys absent from the config reference: {sorted(missing)[:20]}"
    unknown = {r for r in rows if not any(k == r or k.endswith("." + r) for k in keys)}
    assert not unknown, f"the reference names keys no schema has: {sorted(unknown)[:20]}"
