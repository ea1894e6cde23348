"""Ray virtual clusters, worker groups and per-worker Python environments.

Ray's own `uv run` integration would relaunch every worker through `uv run` and upload the repo;
we build worker venvs ourselves (actor_environments.py), so it is switched off here, before any
module imports Ray.
"""

import os

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
