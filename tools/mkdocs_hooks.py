"""MkDocs hooks: the parts of the site that are generated from the code when it is built.

- ``reference/{config,cli,metrics,errors}.md`` from the schemas, the argparse parser, the
  metric catalogue and the exception classes (tools/docs_reference.py);
- ``changelog.md`` from the repository's CHANGELOG.md;
- the tables of docs/benchmarks.md from the result files ``bench/`` writes
  (``bench/results/*.json``), in place of its ``<!-- bench-results -->`` marker.

Nothing here is written into the source tree: the pages exist only in the built site.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import docs_reference  # noqa: E402

BENCH_MARKER = "<!-- bench-results -->"
WORKLOADS = {"tiny": "tiny-arith", "smollm2": "SmolLM2-135M"}


def on_files(files: Files, config) -> Files:
    for name, page in docs_reference.PAGES.items():
        files.append(File.generated(config, f"reference/{name}.md", content=page()))
    files.append(File.generated(config, "changelog.md", content=changelog_page()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "benchmarks.md":
        if BENCH_MARKER not in markdown:
            raise ValueError(f"docs/benchmarks.md lost its {BENCH_MARKER} marker")
        markdown = markdown.replace(BENCH_MARKER, bench_tables(ROOT / "bench" / "results"))
    return markdown


def changelog_page() -> str:
    """CHANGELOG.md, with its links into docs/ made relative to the site's root."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)


def _ratio(row: dict) -> str:
    spread = f" ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})" if row.get("ratio_min") else ""
    return f"**{row['ratio']:.2f}x**{spread}"


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"


def bench_tables(results: Path) -> str:
    """One table per result file, a row per workload, each with its date, machine and commit."""
    out = []
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text())
        peer = doc["rows"][0]["peer_name"] if doc["rows"] else "peer"
        out += [
            f"### {doc['title']}",
            "",
            f"`bench/bench_{path.stem}.py`; ratio = how many times faster tempering is, the "
            "median of the runs and their range.",
            "",
            f"| workload | metric | tempering | {peer} | ratio (range) | runs | date | machine | commit |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in doc["rows"]:
            out.append(
                f"| {WORKLOADS.get(row['workload'], row['workload'])} | {row['metric']} | {_figure(row['ours'])} | "
                f"{_figure(row['peer'])} | {_ratio(row)} | {row['runs']} | {row['date']} | "
                f"{row['machine']} | `{row['commit']}` |"
            )
        sources = sorted({row["source"] for row in doc["rows"]} - {"measured"})
        out += ["", *(f"Source: {s}." for s in sources), ""]
    return "\n".join(out)
