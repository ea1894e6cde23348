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
from tempering.config.loader import schema_leaves  # noqa: E402
from tempering.utils.metric_docs import METRICS  # noqa: E402


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict` fails on any warning: a broken link or anchor, a nav entry missing."""
    proc = subprocess.run(
        # no -q: it hides the warnings --strict counts (a page outside the nav built green)
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_benchmark_tables_come_from_result_files_git_tracks():
    """The Benchmarks page renders bench/results/*.json: on a clean clone they must be there
    (a `results/` ignore rule once kept them out of git, and the page's tables were empty)."""
    from mkdocs_hooks import bench_tables

    tracked = subprocess.run(
        ["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    names = {Path(t).name for t in tracked}
    assert {"sft_vs_trl.json", "dpo_vs_trl.json", "kto_vs_trl.json", "grpo_vs_trl.json"} <= names
    rows = [line for line in bench_tables(ROOT / "bench" / "results").splitlines()
            if re.match(r"^\| (tiny-arith|SmolLM2-135M|smollm2)", line)]  # fmt: skip
    assert len(rows) >= 8 and all(re.search(r"\| 20\d\d-\d\d-\d\d \|", r) for r in rows)


def test_the_config_reference_covers_every_key_and_names_no_other():
    page = docs_reference.config_page()
    keys = {key for schema in MASTER_CONFIGS.values() for key, _ in schema_leaves(schema)}
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    assert not keys - rows, f"keys absent from the config reference: {sorted(keys - rows)[:20]}"
    assert not rows - keys, f"the reference names keys no schema has: {sorted(rows - keys)[:20]}"


def test_every_config_key_says_what_it_does():
    """The reference's doc column comes from each field's description: none may be empty."""
    bare = sorted({key for schema in MASTER_CONFIGS.values()
                   for key, field in schema_leaves(schema) if not (field.description or "").strip()})  # fmt: skip
    assert not bare, f"config keys without a description= in tempering/config/: {bare[:20]}"


# A metric key as the loops write it: a quoted literal or an f-string with a known prefix.
_METRIC = re.compile(
    r"""f?"((?:train|val|env|gym|timing|critic|data|resources|dynamic_sampling|server|throughput|rollouts)"""
    r"""/[A-Za-z0-9_@{}/.<>]*)\""""
)


def metric_literals() -> set[str]:
    """Every metric key written in tempering/'s sources, `{...}` parts as `<x>`."""
    found = set()
    for path in (ROOT / "tempering").rglob("*.py"):
        if path.name == "metric_docs.py":
            continue
        for key in _METRIC.findall(path.read_text()):
            if not re.search(r"\.(jsonl?|yaml|parquet|csv)$", key):  # a data path, not a metric
                found.add(re.sub(r"\{[^}]*\}", "<x>", key))
    return found


def _family(pattern: str, placeholder: str) -> re.Pattern[str]:
    return re.compile("[^/]+".join(re.escape(p) for p in re.split(placeholder, pattern)))


def test_every_metric_key_the_code_writes_is_in_the_metrics_reference():
    """A key must match an entry of `tempering.utils.metric_docs.METRICS` other than a
    catch-all (`train/<name>`: any other term a loss reports); a family of keys (`<x>` from an
    f-string) must match an entry, or have its members listed there; a prefix (ending in `/`
    or `/<x>`) must begin some entry."""
    entries = [key for group in METRICS.values() for key in group]
    specific = [
        _family(e, r"<[a-z]+>") for e in entries if not re.fullmatch(r"[a-z_]+/<[a-z]+>", e)
    ]
    literals = metric_literals()
    assert len(literals) > 60  # the scan reads the loops (77 distinct keys when written)
    undocumented = []
    for key in sorted(literals):
        family = _family(key, "<x>")
        prefix = key.removesuffix("<x>") if key.endswith("/<x>") else key
        if not (
            any(p.fullmatch(key.replace("<x>", "x1")) for p in specific)
            or ("<x>" in key and any(family.fullmatch(entry) for entry in entries))
            or (prefix.endswith("/") and any(entry.startswith(prefix) for entry in entries))
        ):
            undocumented.append(key)
    assert not undocumented, f"metric keys missing from metric_docs.METRICS: {undocumented}"
