"""The built docs site renders in a real browser: headless Chromium (Debian's `chromium`
package, installed here with apt-get when it is missing and we are root) opens the home page
and one guide from the built files. The DOM dump must hold the primary navigation with the
guide marked active and the page's own text; the screenshot must show the theme's styled
header bar and the navigation's text (counted pixels), which an unstyled or blank page has not.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _apt_install_chromium() -> None:
    """Debian's chromium, waiting for the dpkg lock (a fresh machine may still be running its own
    apt at start-up: apt exits 100 at once on a held lock) and refreshing stale package lists
    once. A failure shows apt's own words, which name the cause."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", "DPkg::Lock::Timeout=600"]
    cmd = ["apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", "chromium"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        subprocess.run(
            ["apt-get", *wait, "update", "-q"], capture_output=True, env=env, check=False
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, f"`{' '.join(cmd)}` failed:\n{(proc.stdout + proc.stderr)[-3000:]}"


@functools.cache
def _chromium() -> str:
    found = shutil.which("chromium")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        _apt_install_chromium()
        found = shutil.which("chromium")
    assert found, "no chromium: `apt-get install chromium` (Debian's package), then rerun"
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)]
    proc = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _browse(page: Path, *flags: str) -> str:
    # no background networking: this machine's closed network refuses Chromium's own calls home
    quiet = ["--disable-quic", "--no-first-run", "--disable-background-networking"]
    quiet += ["--disable-component-update", "--disable-sync"]
    with tempfile.TemporaryDirectory() as profile:
        cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", *quiet]
        cmd += [f"--user-data-dir={profile}", *flags, page.as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_a_guide_renders_with_its_navigation(site):
    dom = _browse(site / "guides" / "preference" / "index.html", "--dump-dom")
    assert 'class="md-nav md-nav--primary"' in dom  # the site's navigation, built by the theme
    nav = dom.split('class="md-nav md-nav--primary"', 1)[1]
    for entry in ("Get started", "Guides", "Scaling", "Concepts", "Reference", "LoRA"):
        assert entry in nav, f"{entry!r} missing from the navigation"
    active = dom.split("md-nav__link--active", 1)[1][:400]
    assert "DPO" in active, "the guide is not the active entry of the navigation"
    assert "data.train_data_path" in dom  # the guide's own text reached the page


def test_the_home_page_renders_styled(site, tmp_path):
    from PIL import Image

    shot = tmp_path / "home.png"
    _browse(site / "index.html", "--window-size=1280,900", f"--screenshot={shot}")
    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 900)
    header = [img.getpixel((x, 20)) for x in range(0, 1280, 4)]
    coloured = sum(1 for r, g, b in header if b > 150 and r < 120)  # the theme's indigo bar
    assert coloured > 0.8 * len(header), f"no styled header: {header[:5]}"
    nav = img.crop((0, 100, 260, 900)).convert("L")
    ink = sum(
        1 for v in nav.get_flattened_data() if v < 160
    )  # the navigation's text, dark on white
    assert ink > 2000, f"the navigation shows no text ({ink} dark pixels)"
