"""GRPO speed: tempering vs TRL's GRPOTrainer on the same workload, per step and per
generated token.

    uv run bench/bench_grpo_vs_trl.py [--scale tiny|smollm2] [--steps N] [--runs 3]

Workloads (identical on both sides: the same prompts, sampling, lengths and precision; fp32,
CPU, 2 threads; one optimizer step per generation batch; TRL's first step of a run and ours
are warm-up and not counted):

- ``tiny``: the committed tiny-arith model, 16 prompts x 8 completions per step, up to 6 new
  tokens, temperature 1, exact-answer reward, no KL (beta 0: neither side keeps a reference
  model), constant lr 5e-5 (grpo_math_tiny.yaml's model, sampling and lr);
- ``smollm2``: grpo_math_smollm2.yaml's workload: SmolLM2-135M-Instruct, 4 GSM8K/chain-sum
  prompts x 4 completions in the chat template, up to 128 new tokens, temperature 0.7, KL
  0.01 against a reference model, lr 1e-6.

Both sides see the same prompts in the same order: tempering's data loader draws each step's
prompts and TRL is given that sequence unshuffled (``shuffle_dataset=False``), so step k of
either side samples completions for the same 4 (or 16) problems. Sampled lengths still differ
(different random streams), so the speed-up is reported per generated token
(generated tokens per second, TRL's from its ``completions/mean_length`` log) as well as per
step. Each side runs ``--runs`` times, interleaved (these machines are noisy): the figures are
the median of the per-run medians with their spread (min-max). Each run also reports which
share of its timed steps ran with the machine's two cores on two L3 caches (`placement.py`),
and the per-token speed-ups are printed again grouped by tempering's placement, then over
the steps both sides ran on the same placement (`placement.print_matched`).

TRL runs in its own environment (`venvs/bench`, the `bench` dependency group, built on first
use) as a subprocess, so it never enters tempering's lock-in environment.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from peers import ensure_bench_venv, peer_env  # bench/peers.py (this folder is on sys.path)
from placement import PlacementProbe, placement_note, print_by_placement, print_matched
from result_files import record  # bench/result_files.py: the docs' Benchmarks page reads its files

REPO = Path(__file__).resolve().parents[1]

TRL_SCRIPT = r"""
import json, sys, time, torch
torch.set_num_threads(2)
torch.manual_seed(0)
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
args = json.loads(sys.argv[1])
tok = AutoTokenizer.from_pretrained(args["model"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
def prompt(text, system):
    if not args["chat"]:
        return text
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
ds = Dataset.from_list([{"prompt": prompt(p, s), "answer": a} for p, a, s in args["problems"]])

def exact(completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]  # conversational prompts
        out.append(1.0 if a in text.split() else 0.0)
    return out

class Clock(TrainerCallback):  # ``ends``: on the machine-wide monotonic clock (placement)
    def __init__(self): self.t, self.ends = [time.perf_counter()], []
    def on_step_end(self, *a, **k):
        self.t.append(time.perf_counter())
        self.ends.append(time.monotonic())

n = args["prompts"] * args["generations"]
cfg = GRPOConfig(
    output_dir=args["out"], per_device_train_batch_size=n, num_generations=args["generations"],
    max_completion_length=args["max_new_tokens"], temperature=args["temperature"],
    learning_rate=args["lr"], top_p=1.0, top_k=0,
    beta=args["beta"], max_steps=args["steps"], logging_steps=1, report_to=[], use_cpu=True, bf16=False,
    gradient_checkpointing=False, use_vllm=False, save_strategy="no", seed=0,
    steps_per_generation=1, num_iterations=1, dataloader_num_workers=0,
    shuffle_dataset=False,  # the problems arrive in tempering's order, one step's worth each
)
clock = Clock()
trainer = GRPOTrainer(model=model, reward_funcs=exact, args=cfg, train_dataset=ds,
                      processing_class=tok, callbacks=[clock])
trainer.train()
steps = [b - a for a, b in zip(clock.t, clock.t[1:])]
lengths = [h["completions/mean_length"] for h in trainer.state.log_history
           if "completions/mean_length" in h]
print("RESULT " + json.dumps(
    {"step_s": steps, "gen_tokens": [n * x for x in lengths], "ends": clock.ends}
))
"""


SCALES = {
    "tiny": {
        "config": "grpo_math_tiny.yaml",
        "overrides": [
            "grpo.num_prompts_per_step=16",
            "grpo.num_generations_per_prompt=8",
            "policy.train_global_batch_size=128",
            "policy.train_micro_batch_size=128",
            "policy.scheduler.name=constant",
        ],
        "steps": 16,
    },
    "smollm2": {"config": "grpo_math_smollm2.yaml", "overrides": [], "steps": 3},
}


def run_trl(cfg, model: str, problems: list, steps: int) -> dict:
    py = ensure_bench_venv()
    payload = {
        "model": model,
        "problems": problems,
        "chat": cfg.data.use_chat_template,
        "prompts": cfg.grpo.num_prompts_per_step,
        "generations": cfg.grpo.num_generations_per_prompt,
        "max_new_tokens": cfg.policy.generation.max_new_tokens,
        "temperature": cfg.policy.generation.temperature,
        "lr": cfg.policy.optimizer.kwargs.lr,
        "beta": cfg.loss_fn.reference_policy_kl_penalty,
        "steps": steps,
        "out": "/tmp/tempering_bench_trl",
    }
    env = peer_env(OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", WANDB_DISABLED="true")
    r = subprocess.run(
        [str(py), "-c", TRL_SCRIPT, json.dumps(payload)], capture_output=True, text=True, env=env
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"TRL run failed:\n{r.stderr[-3000:]}")
    return json.loads(line[0][7:])


def load(scale: str, overrides: tuple[str, ...] = ()):
    from tempering.config import GRPOMasterConfig, load_config

    return load_config(
        REPO / "examples/configs" / SCALES[scale]["config"],
        [
            *SCALES[scale]["overrides"],
            *overrides,
            "policy.num_threads=2",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "checkpointing.enabled=false",
            "logger.tensorboard_enabled=false",
            "logger.log_dir=/tmp/tempering_bench_grpo",
        ],
        schema=GRPOMasterConfig,
    )


def run_tempering(
    scale: str, steps: int, overrides: tuple[str, ...] = ()
) -> tuple[dict, str, list]:
    """``steps`` GRPO steps of the scale's workload: seconds and generated tokens per step,
    plus each phase's seconds (``timing/*``), the model folder and the problems drawn."""
    from tempering.algorithms import grpo
    from tempering.models.registry import resolve_model_path

    cfg, resolved = load(scale, overrides)
    n = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    run = grpo.setup(cfg, resolved)
    loss_fn = grpo.make_loss(cfg)
    out: dict = {"step_s": [], "gen_tokens": [], "ends": []}
    problems: list = []  # every step's problems, in the order tempering's loader drew them
    next_batch = run.dataloader.next_batch

    def recording_next_batch():
        batch = next_batch()
        problems.extend((p.prompt, p.answer, p.system) for p in batch)
        return batch

    run.dataloader.next_batch = recording_next_batch
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            m = grpo.grpo_step(run, loss_fn)
            out["step_s"].append(time.perf_counter() - t0)
            out["ends"].append(time.monotonic())
            out["gen_tokens"].append(m["train/gen_length_mean"] * n)
            for k, v in m.items():
                if k.startswith("timing/"):
                    out.setdefault(k, []).append(v)
    finally:
        run.close()
    return out, str(resolve_model_path(cfg.policy.model_name)), problems


def per_run(res: dict) -> tuple[float, float]:
    """Median seconds per step and generated tokens per second, warm-up step left out."""
    steps, toks = res["step_s"][1:], res["gen_tokens"][1:]
    return statistics.median(steps), statistics.median(
        t / s for t, s in zip(toks, steps, strict=True)
    )


def spread(values: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", choices=list(SCALES), default="tiny")
    p.add_argument("--steps", type=int, default=None, help="steps per run (first is warm-up)")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    steps = a.steps or SCALES[a.scale]["steps"]
    cfg, _ = load(a.scale)
    rows = {"tempering": [], "TRL 1.16": []}
    split = []  # per run: the split-L3 share of tempering's and TRL's timed steps
    matched: tuple[list, list] = ([], [])  # every timed step: (placement, seconds, tokens)
    with PlacementProbe() as probe:
        for r in range(a.runs):
            ours, model, problems = run_tempering(a.scale, steps)
            rows["tempering"].append(per_run(ours))
            theirs = run_trl(cfg, model, problems, steps)
            rows["TRL 1.16"].append(per_run(theirs))
            # the timed steps: from the warm-up step's end
            split.append([probe.split_share(x["ends"][0], x["ends"][-1]) for x in (ours, theirs)])
            for side, res in zip(matched, (ours, theirs), strict=True):
                side.extend(
                    probe.placed_steps(res["ends"][1:], res["step_s"][1:], res["gen_tokens"][1:])
                )
            print(
                f"run {r + 1}: "
                + ", ".join(
                    f"{k} {v[-1][0]:.3f} s/step {v[-1][1]:.0f} tok/s" for k, v in rows.items()
                )
                + f"; cores on two L3s: {placement_note(split[-1])}"
            )
    print(
        f"\nGRPO, {a.scale}, {cfg.grpo.num_prompts_per_step}x"
        f"{cfg.grpo.num_generations_per_prompt} per step, up to "
        f"{cfg.policy.generation.max_new_tokens} new tokens, fp32 CPU; per run the median of "
        f"{steps - 1} steps after warm-up, below the median of {a.runs} runs (min-max)"
    )
    print(f"{'':12s}{'s/step':>24s}{'generated tokens/s':>28s}")
    for name, vals in rows.items():
        print(f"{name:12s}{spread([v[0] for v in vals], '.3f'):>24s}"
              f"{spread([v[1] for v in vals], '.1f'):>28s}")  # fmt: skip
    pairs = list(zip(rows["tempering"], rows["TRL 1.16"], strict=True))
    print(f"speed-up per step (TRL s/step / tempering s/step): "
          f"{spread([t[0] / o[0] for o, t in pairs])}x")  # fmt: skip
    print(f"speed-up per generated token (tempering tok/s / TRL tok/s): "
          f"{spread([o[1] / t[1] for o, t in pairs])}x")  # fmt: skip
    print_by_placement([o[1] / t[1] for o, t in pairs], [share for share, _ in split])
    record(
        "grpo_vs_trl",
        "GRPO against TRL 1.16 GRPOTrainer (per generated token)",
        a.scale,
        "generated tokens/s",
        [o[1] for o, _ in pairs],
        [t[1] for _, t in pairs],
        "TRL 1.16",
        higher_is_better=True,
    )
    print_matched(*matched, unit="generated tokens")


if __name__ == "__main__":
    main()
