"""The peers' environment for benchmarks: TRL and its needs live in `venvs/bench` (the `bench`
dependency group, synced from the lock on first use), never in tempering's own `.venv`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_VENV = REPO / "venvs" / "bench"


def peer_env(**extra: str) -> dict[str, str]:
    """The environment a peer runs in: this one's, less the OpenMP settings that importing
    tempering gave this process (``tempering.OPENMP_DEFAULTS``; a value the user set is kept),
    so the peer waits at its barriers as its own users' processes do (libgomp's spin)."""
    from tempering import OPENMP_DEFAULTS, OPENMP_USER_SET

    ours = set(OPENMP_DEFAULTS) - OPENMP_USER_SET
    return {**{k: v for k, v in os.environ.items() if k not in ours}, **extra}


def ensure_bench_venv() -> Path:
    """The bench venv's python, building the venv from `uv.lock` if it is missing."""
    python = BENCH_VENV / "bin" / "python"
    if not python.exists():
        env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(BENCH_VENV)}
        subprocess.run(
            ["uv", "sync", "--locked", "--group", "bench", "--no-dev"],
            cwd=REPO,
            env=env,
            check=True,
        )
    return python


# The start of every TRL trainer script: the spec (argv[1]), threads, seed, the rows (JSON
# file), the model and tokenizer in fp32, and ``timer``, a callback timing each optimizer step
# end to end.
TRL_PRELUDE = """
import json, sys, time, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
torch.manual_seed(0)
rows = json.load(open(args["data"]))
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(args["model"])

class Timer(TrainerCallback):
    # a step's wall time from the previous step's end (the first step's from its begin):
    # fetching and collating its batch counts, as it does in tempering's timed steps
    # (``fetch``: each gap between a step's end and the next one's begin, the part that
    # on_step_begin-to-on_step_end timing leaves out; ``ends``: each step's end on the
    # machine-wide monotonic clock, so a caller can tell when the steps ran)
    def __init__(self):
        self.times, self.fetch, self.ends, self.t0 = [], [], [], None
    def on_step_begin(self, a, s, c, **kw):
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        else:
            self.fetch.append(now - self.t0)
    def on_step_end(self, a, s, c, **kw):
        now = time.perf_counter()
        self.times.append(now - self.t0)
        self.ends.append(time.monotonic())
        self.t0 = now

timer = Timer()
"""


def run_trl(script: str, spec: dict) -> dict:
    """Run ``TRL_PRELUDE + script`` in the bench venv with ``spec`` as its argv[1] (CPU,
    offline); return the dict it printed on its last ``RESULT <json>`` line."""
    trl_python = ensure_bench_venv()
    env = peer_env(CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [str(trl_python), "-c", TRL_PRELUDE + script, json.dumps(spec)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"TRL run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def scaled_parser(
    doc: str, scales: dict, per_step: str, per_step_help: str
) -> argparse.ArgumentParser:
    """The options the peer benchmarks share: ``--scale`` (one of ``scales``), the model, the
    examples per step (``per_step``: --rows, --pairs), max length, lr, steps, warm-up, threads
    and interleaved runs; `scaled_args` fills what is not given from the scale."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--scale", choices=list(scales), default="tiny")
    parser.add_argument("--model", help="model name or folder (default: the scale's)")
    parser.add_argument(per_step, type=int, help=per_step_help)
    parser.add_argument("--max-len", type=int, help="tokens per row at most")
    parser.add_argument("--lr", type=float, help="learning rate")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, help="first steps left out")
    parser.add_argument("--threads", type=int, help="torch threads, both sides")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, interleaved")
    return parser


def scaled_args(parser: argparse.ArgumentParser, scales: dict) -> argparse.Namespace:
    """The parsed options, each one not given taken from its scale's value."""
    args = parser.parse_args()
    for key, value in scales[args.scale].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args
