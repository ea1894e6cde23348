"""Record the code's fingerprint into the container image (run once, at image build).

    uv run --frozen python tools/record_fingerprint.py [--output PATH] [--repo DIR]

Writes md5(pyproject.toml), md5(uv.lock) and git submodule commits as JSON to PATH (default:
``$TEMPERING_FINGERPRINT_PATH`` or /opt/tempering/fingerprint.json). At start-up with
``NRL_CONTAINER=1``, ``tempering.distributed.fingerprint.check_container_fingerprint``
compares the code against it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tempering.distributed.fingerprint import REPO_ROOT, fingerprint_path, write_fingerprint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="repository root")
    args = parser.parse_args(argv)
    output = args.output or fingerprint_path()
    fingerprint = write_fingerprint(output, args.repo)
    print(f"wrote {output}:")
    for key, value in fingerprint.items():
        print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
