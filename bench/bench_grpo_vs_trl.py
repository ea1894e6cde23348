"""GRPO seconds/step and tokens/s: tempering vs TRL's GRPOTrainer on the same tiny workload.

    uv run bench/bench_grpo_vs_trl.py [--steps 16] [--prompts 16] [--generations 8]

Workload (identical on both sides): the committed tiny-arith model, fp32, CPU, 2 threads;
`--prompts` prompts x `--generations` completions per step, up to 6 new tokens, temperature 1,
exact-answer reward, no KL (beta 0, so neither side keeps a reference model), one optimizer
step per generation batch, lr 1e-3. The first step of each side is warm-up and not counted.

TRL runs in its own environment (`venvs/bench`, the `bench` dependency group, built on first
use) as a subprocess, so it never enters tempering's lock-in environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from peers import ensure_bench_venv  # bench/peers.py (this folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]

TRL_SCRIPT = r"""
import json, sys, time, torch
torch.set_num_threads(2)
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
args = json.loads(sys.argv[1])
tok = AutoTokenizer.from_pretrained(args["model"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
ds = Dataset.from_list([{"prompt": p, "answer": a} for p, a in args["problems"]])

def exact(completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        s = c.strip().split()
        out.append(1.0 if s and s[0].isdigit() and s[0] == a else 0.0)
    return out

class Clock(TrainerCallback):
    def __init__(self): self.t = [time.perf_counter()]
    def on_step_end(self, *a, **k): self.t.append(time.perf_counter())

n = args["prompts"] * args["generations"]
cfg = GRPOConfig(
    output_dir=args["out"], per_device_train_batch_size=n, num_generations=args["generations"],
    max_completion_length=args["max_new_tokens"], temperature=1.0, learning_rate=1e-3,
    beta=0.0, max_steps=args["steps"], logging_steps=1, report_to=[], use_cpu=True, bf16=False,
    gradient_checkpointing=False, use_vllm=False, save_strategy="no", seed=0,
    steps_per_generation=1, num_iterations=1, dataloader_num_workers=0,
)
clock = Clock()
trainer = GRPOTrainer(model=model, reward_funcs=exact, args=cfg, train_dataset=ds,
                      processing_class=tok, callbacks=[clock])
trainer.train()
steps = [b - a for a, b in zip(clock.t, clock.t[1:])]
toks = [h.get("num_tokens") for h in trainer.state.log_history if "num_tokens" in h]
print("RESULT " + json.dumps({"step_s": steps, "num_tokens": toks}))
"""


def run_trl(model: str, problems: list[tuple[str, str]], a: argparse.Namespace) -> dict:
    py = ensure_bench_venv()
    payload = {
        "model": model,
        "problems": problems,
        "prompts": a.prompts,
        "generations": a.generations,
        "max_new_tokens": 6,
        "steps": a.steps,
        "out": "/tmp/tempering_bench_trl",
    }
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    r = subprocess.run(
        [str(py), "-c", TRL_SCRIPT, json.dumps(payload)], capture_output=True, text=True, env=env
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"TRL run failed:\n{r.stderr[-3000:]}")
    return json.loads(line[0][7:])


def run_tempering(a: argparse.Namespace) -> tuple[dict, str, list[tuple[str, str]]]:
    from tempering.algorithms import grpo
    from tempering.algorithms.loss_functions import ClippedPGLoss
    from tempering.config import GRPOMasterConfig, load_config

    n = a.prompts * a.generations
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [
            f"grpo.num_prompts_per_step={a.prompts}",
            f"grpo.num_generations_per_prompt={a.generations}",
            f"policy.train_global_batch_size={n}",
            f"policy.train_micro_batch_size={n}",
            "policy.num_threads=2",
            "grpo.val_period=0",
            "checkpointing.enabled=false",
            "logger.tensorboard_enabled=false",
            "logger.log_dir=/tmp/tempering_bench_grpo",
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    loss_fn = ClippedPGLoss()
    steps, toks = [], []
    try:
        for _ in range(a.steps):
            t0 = time.perf_counter()
            m = grpo.grpo_step(run, loss_fn)
            steps.append(time.perf_counter() - t0)
            toks.append(m["throughput/tokens_per_s"] * m["timing/step_s"])
        model_path = run.policy.worker_group  # keep the run alive until timing is done
        del model_path
        from tempering.models.registry import resolve_model_path

        model = resolve_model_path(cfg.policy.model_name)
        problems = [(p.prompt, p.answer) for p in run.train_problems[: 4 * a.prompts * a.steps]]
    finally:
        run.close()
    return {"step_s": steps, "num_tokens": toks}, model, problems


def summarise(name: str, res: dict) -> tuple[float, float]:
    steps = res["step_s"][1:] or res["step_s"]
    s = statistics.median(steps)
    toks = res["num_tokens"]
    per_step = (
        (toks[-1] / len(toks)) if toks and name == "TRL" else statistics.median(toks[1:] or toks)
    )
    return s, per_step / s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    a = p.parse_args()
    ours, model, problems = run_tempering(a)
    trl = run_trl(model, problems, a)
    s_ours, tps_ours = summarise("tempering", ours)
    s_trl, tps_trl = summarise("TRL", trl)
    print(
        f"\nGRPO, tiny-arith, {a.prompts}x{a.generations} per step, fp32 CPU, median of "
        f"{a.steps - 1} steps after warm-up"
    )
    print(f"{'':12s}{'s/step':>10s}{'tokens/s':>12s}")
    print(f"{'tempering':12s}{s_ours:10.2f}{tps_ours:12.0f}")
    print(f"{'TRL 1.16':12s}{s_trl:10.2f}{tps_trl:12.0f}")
    print(f"speed-up (TRL s/step / tempering s/step): {s_trl / s_ours:.2f}x")


if __name__ == "__main__":
    main()
