"""Held-out evaluation outside training: ``tempering eval``.

    tempering eval MODEL [--baseline MODEL] --task NAME [--split test] [--samples N]
                   [--pass-at-k K] [--data FILE] [--backend torch|vllm] [--report FILE]

MODEL is a Hugging Face folder (e.g. a run's ``final_hf``), a registered name (``tiny-arith``)
or a step checkpoint (``results/<run>/step_N``, exported on the fly with
`tempering.models.export`). Problems, prompts and scoring are GRPO validation's own: the same
problem sets (``arithmetic`` is tiny-arith's held-out problems with GRPO's seed, so 256 of them
are exactly a run's validation set), the same prompt construction (`data.prompts`, chat
template or not), the same rollout loop and environments (`experience.rollouts`), greedy.

Tasks: ``arithmetic`` (exact answer), ``arithmetic_retry`` (multi-turn, ``--max-turns``),
``calculator`` (the arithmetic problems with the calculator tool offered: calls are run, the
final answer is scored; multi-turn, 4 turns by default; needs a chat template), ``gsm8k``
(math-verify), ``rg:<name>`` (a reasoning-gym generator, math-verify), ``problems``
(your data file or Hugging Face dataset via ``--data``, keys ``--problem-key`` / ``--answer-key``).

Printed and written to the JSON report: accuracy with a 95% Wilson interval; with
``--baseline``, the baseline's, and the paired difference on the same problems with its 95%
interval (normal approximation over per-problem differences); with ``--pass-at-k K``, pass@K
from K samples per problem at ``--temperature``.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["EvalResult", "evaluate", "paired_difference", "wilson_interval"]

Z95 = 1.959963984540054
TASKS = ("arithmetic", "arithmetic_retry", "calculator", "gsm8k", "problems", "rg:<name>")
MULTI_TURN = {"arithmetic_retry": 3, "calculator": 4}  # task -> default --max-turns


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(a: list[bool], b: list[bool], z: float = Z95) -> tuple[float, float, float]:
    """Mean of a_i - b_i over the same problems, with its 95% interval."""
    n = len(a)
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


@dataclass
class EvalResult:
    model: str
    task: str
    metric: str  # "accuracy" (single turn) or "solved within N turns"
    samples: int
    correct: list[bool]
    accuracy: float
    ci95: tuple[float, float]
    pass_at_k: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------------ problems
def task_problems(
    task: str,
    *,
    split: str,
    samples: int,
    seed: int,
    data: str | None,
    problem_key: str,
    answer_key: str,
) -> list[Any]:
    """The task's problems (`tempering.data.grpo_problems.Problem`), as GRPO builds them."""
    from tempering.data.grpo_problems import Problem, reasoning_gym_problems

    if task in ("arithmetic", "arithmetic_retry", "calculator"):
        from tempering.models.tiny_arith import make_problems

        if split not in ("train", "test"):
            raise ValueError(f"--split {split!r}: arithmetic has 'train' and 'test'")
        return [
            Problem(p["prompt"], p["answer"], task) for p in make_problems(samples, seed, split)
        ]
    if task == "gsm8k":
        from tempering.data.gsm8k import gsm8k_rl_pairs, gsm8k_user_prompt

        pairs = gsm8k_rl_pairs(split)[:samples]
        return [Problem(gsm8k_user_prompt(q), a, "math") for q, a in pairs]
    if task.startswith("rg:"):
        return reasoning_gym_problems(task[3:], samples, seed)
    if task == "problems":
        from tempering.data.problems import load_problem_rows

        if not data:
            raise ValueError(
                "--task problems needs --data FILE (JSONL, JSON, Parquet, CSV or a Hugging Face "
                "dataset)"
            )
        rows = load_problem_rows(data, problem_key, answer_key, split)[:samples]
        return [Problem(q, a, "math") for q, a in rows]
    raise ValueError(f"--task {task!r} is unknown; use one of {', '.join(TASKS)}")


# ------------------------------------------------------------------------- models
def resolve_model(model: str, scratch: Path) -> tuple[str, dict[str, Any] | None]:
    """(an HF folder or registered name, the run's config when MODEL is a checkpoint)."""
    import yaml

    from tempering.models.export import export_checkpoint
    from tempering.utils.checkpoint import run_folder_hint

    path = Path(model)
    step = path.parent if path.name == "policy" else path
    if (step / "config.yaml").is_file() and (step / "policy").is_dir():
        out = scratch / step.name
        export_checkpoint(step, out)
        return str(out), yaml.safe_load((step / "config.yaml").read_text())
    if path.is_dir() and not (path / "config.json").is_file():
        hint = run_folder_hint(path)
        if hint:
            raise FileNotFoundError(hint)
        raise FileNotFoundError(
            f"{model} is neither a Hugging Face folder (no config.json) nor a step checkpoint "
            "(no config.yaml + policy/); pass results/<run>/final_hf or results/<run>/step_<N>"
        )
    return model, None


def generation_backend(
    model_path: str, backend: str, sampling: Any, tokenizer: Any, adapter: str | None = None,
    *, max_model_len: int | None = None, kv_cache_bytes: int = 256 * 2**20,
) -> tuple[Any, Any]:  # fmt: skip
    """(generation backend, a close function) on the torch engine here or a vLLM worker;
    `adapter`: a PEFT adapter folder merged into the model (torch only); `max_model_len` and
    `kv_cache_bytes`: the vLLM engine's (None: the model's positions)."""
    from tempering.models.generation.cpu_inference import optimize_for_cpu_inference
    from tempering.models.generation.torch_engine import TorchGenerationEngine
    from tempering.models.hf import load_causal_lm

    if backend == "torch":
        model = load_causal_lm(model_path)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        optimize_for_cpu_inference(model)  # as GRPO's generation workers do
        return TorchGenerationEngine(model, tokenizer, sampling), lambda: None
    if backend != "vllm":
        raise ValueError(f"--backend {backend!r}: use torch or vllm")
    if adapter is not None:
        raise ValueError(f"--adapter {adapter} with --backend vllm: merge it first (tempering "
                         "export of the run's step, without --adapter) or use --backend torch")  # fmt: skip
    from tempering.distributed.virtual_cluster import cluster_from_config, init_ray
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
    from tempering.models.generation.builders import VLLM_WORKER_FQN, SplitGeneration
    from tempering.models.registry import resolve_model_path

    model_path = str(resolve_model_path(model_path))  # a registered name: vLLM needs its folder
    init_ray()
    cluster = cluster_from_config(1, 0, workers_per_node=1, cpus_per_worker=1, name="eval")
    builder = RayWorkerBuilder(
        VLLM_WORKER_FQN, model_path, sampling, dtype="float32", enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_bytes, tokenizer_path=tokenizer.name_or_path,
        max_model_len=max_model_len,
    )  # fmt: skip
    generation = SplitGeneration(RayWorkerGroup(cluster, builder, name_prefix="eval-vllm"), cluster)
    return generation, generation.shutdown


# ----------------------------------------------------------------------- evaluate
def evaluate(
    model: str,
    task: str,
    *,
    split: str = "test",
    samples: int = 256,
    seed: int = 0,
    max_new_tokens: int | None = None,
    use_chat_template: bool | None = None,
    max_turns: int | None = None,
    pass_at_k: int = 0,
    temperature: float = 1.0,
    batch_size: int = 256,
    backend: str = "torch",
    data: str | None = None,
    problem_key: str = "problem",
    answer_key: str = "expected_answer",
    progress: bool | None = None,
    tokenizer: str | None = None,
) -> EvalResult:
    """Score `model` on `task` as GRPO validation does (see the module docstring): the
    problems -> the model (a checkpoint exported) -> its settings -> a generation backend ->
    greedy rollouts, scored -> pass@k with sampling -> the result with its interval."""
    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.hf import load_tokenizer

    problems = task_problems(task, split=split, samples=samples, seed=seed, data=data,
                             problem_key=problem_key, answer_key=answer_key)  # fmt: skip
    multi_turn = task in MULTI_TURN
    threshold = 0.0 if task == "arithmetic_retry" else 0.5  # solved (any turn) / correct
    with tempfile.TemporaryDirectory(prefix="tempering_eval_") as scratch:
        path, run_cfg = resolve_model(model, Path(scratch))
        named = ("--tokenizer " if tokenizer else "MODEL ") + repr(tokenizer or model)
        tok = load_tokenizer(tokenizer or path, named=(named, "pass --tokenizer FOLDER_OR_ID"))
        settings = eval_settings(task, run_cfg or {}, max_new_tokens, use_chat_template, max_turns,
                                 has_template=bool(getattr(tok, "chat_template", None)),
                                 max_positions=_max_positions(path))  # fmt: skip
        sampling = SamplingConfig(max_new_tokens=settings.max_new_tokens, temperature=temperature)
        generation, close = generation_backend(path, backend, sampling, tok)
        try:
            rollouts = EvalRollouts(generation, tok, sampling, settings)
            chunks = [problems[i : i + batch_size] for i in range(0, len(problems), batch_size)]
            correct, examples = score_greedy(rollouts, chunks, threshold, f"eval {task}", progress)
            passk = None
            if pass_at_k:
                passk = score_pass_at_k(rollouts, chunks, pass_at_k, temperature, threshold)
            rollouts.shutdown()
        finally:
            close()
    k = sum(correct)
    return EvalResult(
        model=model,
        task=task,
        metric=f"solved within {settings.max_turns} turns" if multi_turn else "accuracy",
        samples=len(correct),
        correct=correct,
        accuracy=k / len(correct),
        ci95=wilson_interval(k, len(correct)),
        pass_at_k=passk,
        settings={
            "split": split,
            "seed": seed,
            "max_new_tokens": settings.max_new_tokens,
            "use_chat_template": settings.use_chat_template,
            "max_turns": settings.max_turns,
            "backend": backend,
            "greedy": True,
        },
        examples=examples,
    )


class EvalSettings(NamedTuple):
    max_new_tokens: int
    use_chat_template: bool
    max_turns: int
    max_len: int  # the run's policy.max_total_sequence_length (4096 without a run config)


def eval_settings(
    task: str,
    run_cfg: dict[str, Any],
    max_new_tokens: int | None,
    use_chat_template: bool | None,
    max_turns: int | None,
    has_template: bool = True,
    max_positions: int | None = None,
) -> EvalSettings:
    """Each setting from its argument, else the run's config (a checkpoint's), else the
    task's default; a tokenizer without a chat template (a base model's) reads raw prompts
    unless the template is asked for by name (an error naming the fix). The sequence budget
    is the run's, else 4096, and never past the model's ``max_positions``."""
    if task == "calculator" and not has_template:
        raise ValueError(
            "--task calculator offers the model a tool in chat messages, and the model's "
            "tokenizer has no chat template (a base model?): pass --tokenizer FOLDER with one"
        )
    policy_cfg = run_cfg.get("policy") or {}
    gen_cfg = policy_cfg.get("generation") or {}
    turns = max_turns or MULTI_TURN.get(task, 1)
    chat = use_chat_template
    if chat is None:
        chat = (run_cfg.get("data") or {}).get("use_chat_template")
    if chat and not has_template:
        raise ValueError(
            "the model's tokenizer has no chat template (a base model?) and "
            f"{'--chat-template' if use_chat_template else 'its run set data.use_chat_template'} "
            "asks for it: pass --no-chat-template for raw prompts"
        )
    if chat is None:  # the task's default, where the tokenizer can
        chat = has_template and task not in ("arithmetic", "arithmetic_retry")
    new_tokens = max_new_tokens or gen_cfg.get("max_new_tokens") or (
        6 if task.startswith("arithmetic") else 256)  # fmt: skip
    max_len = int(policy_cfg.get("max_total_sequence_length") or 4096)
    max_len = min(max_len, max_positions or max_len)
    return EvalSettings(new_tokens, chat, turns, max_len)


class EvalRollouts:
    """GRPO's rollout loop over one generation backend: an in-process chat service, the
    tasks' environments (created on first use), prompts encoded as GRPO encodes them."""

    def __init__(
        self, generation: Any, tokenizer: Any, sampling: Any, settings: EvalSettings
    ) -> None:
        from tempering.experience.rollouts import InProcessTurnClient
        from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings

        service = ChatCompletionService(generation, tokenizer, ServerSettings(
            model_name="eval", max_model_len=settings.max_len, default_sampling=sampling))  # fmt: skip
        self.client = InProcessTurnClient(service)
        self.tokenizer, self.sampling, self.settings = tokenizer, sampling, settings
        self.env_kwargs = {"arithmetic_retry": {"max_attempts": settings.max_turns}}
        self.envs: dict[str, Any] = {}

    def __call__(self, chunk: list[Any], greedy: bool, repeat: int = 1) -> Any:
        """``repeat`` episodes per problem of ``chunk``, scored (a rollout batch)."""
        from tempering.environments.registry import create_environment
        from tempering.experience.rollouts import problem_samples, run_rollouts

        for p in chunk:
            if p.task_name not in self.envs:
                self.envs[p.task_name] = create_environment(
                    p.task_name, **self.env_kwargs.get(p.task_name, {})
                )
        once = problem_samples(chunk, self.tokenizer, self.settings.use_chat_template, True)
        samples = [sample for sample in once for _ in range(repeat)]
        return run_rollouts(self.client, samples, self.envs, sampling=self.sampling,
                            max_turns=self.settings.max_turns, max_seq_len=self.settings.max_len,
                            greedy=greedy)  # fmt: skip

    def shutdown(self) -> None:
        for env in self.envs.values():
            env.shutdown()


def score_greedy(
    rollouts: EvalRollouts,
    chunks: list[list[Any]],
    threshold: float,
    description: str,
    progress: bool | None,
) -> tuple[list[bool], list[dict[str, Any]]]:
    """One greedy episode per problem: (solved or not, the example records)."""
    from tempering.utils.logger import track

    correct: list[bool] = []
    examples: list[dict[str, Any]] = []
    with track(chunks, len(chunks), description, enabled=progress) as bar:
        for chunk in bar:
            batch = rollouts(chunk, greedy=True)
            for p, reward, log in zip(chunk, batch["rewards"].tolist(),
                                      batch["message_logs"], strict=True):  # fmt: skip
                correct.append(reward > threshold)
                said = [_said(m) for m in log if m["role"] == "assistant"]
                examples.append({"prompt": p.prompt, "answer": p.answer,
                                 "completions": said, "reward": reward})  # fmt: skip
    return correct, examples


def _said(message: dict[str, Any]) -> str:
    """An assistant turn as the report shows it: its text, then its tool calls."""
    calls = [f"{c['function']['name']}({c['function']['arguments']})"
             for c in message.get("tool_calls") or []]  # fmt: skip
    return " ".join(filter(None, [message.get("content"), *calls]))


def _max_positions(model_path: str) -> int | None:
    """The positions the model was made for (None where its config does not say)."""
    from tempering.models.shapes import max_positions

    return max_positions(str(model_path))


def score_pass_at_k(
    rollouts: EvalRollouts, chunks: list[list[Any]], k: int, temperature: float, threshold: float
) -> dict[str, Any]:
    """pass@k: the share of problems solved by any of k sampled episodes, with its interval."""
    hits = []
    for chunk in chunks:
        rewards = rollouts(chunk, greedy=False, repeat=k)["rewards"]
        hits += (rewards.view(-1, k) > threshold).any(dim=1).tolist()
    n_hit = sum(hits)
    return {"k": k, "temperature": temperature, "value": n_hit / len(hits),
            "ci95": wilson_interval(n_hit, len(hits))}  # fmt: skip


def report(result: EvalResult, baseline: EvalResult | None, path: str | None) -> str:
    """The printed summary; the JSON report goes to `path` (atomically) when given."""
    from tempering.utils.atomic import atomic_write_text

    def line(r: EvalResult, role: str) -> str:
        lo, hi = r.ci95
        text = (f"  {role:9s}{r.model}: {r.metric} {r.accuracy:.1%} [{lo:.1%}, {hi:.1%}] "
                f"({sum(r.correct)}/{r.samples})")  # fmt: skip
        if r.pass_at_k:
            p = r.pass_at_k
            text += f"; pass@{p['k']} {p['value']:.1%} [{p['ci95'][0]:.1%}, {p['ci95'][1]:.1%}]"
        return text

    s = result.settings
    lines = [
        f"tempering eval: {result.task} ({s['split']} split, {result.samples} problems, greedy, "
        f"{s['backend']} engine, max {s['max_new_tokens']} new tokens, "
        + ("chat template" if s["use_chat_template"] else "raw prompts")
        + (f", {s['max_turns']} turns" if s["max_turns"] > 1 else "")
        + ")",
        line(result, "model"),
    ]
    out: dict[str, Any] = {"model": asdict(result)}
    if baseline is not None:
        lines.append(line(baseline, "baseline"))
        d, lo, hi = paired_difference(result.correct, baseline.correct)
        lines.append(f"  difference {100 * d:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}] "
                     "(paired over the same problems, 95%)")  # fmt: skip
        out["baseline"] = asdict(baseline)
        out["difference"] = {"value": d, "ci95": [lo, hi]}
    if path:
        atomic_write_text(path, json.dumps(out, indent=1))
        lines.append(f"  report: {path}")
    return "\n".join(lines)


def arithmetic_before_after(final_model: str, cfg: Any) -> str | None:
    """The held-out task accuracy a preference run on tiny-arith data (DPO's or KTO's
    ``arithmetic`` / ``arithmetic_parity``) ends with: the base model (before) and
    ``final_model`` (after) on the same problems, with the paired difference; None for other
    data. The example scripts print it below the run's report."""
    if cfg.data.dataset_name not in ("arithmetic", "arithmetic_parity"):
        return None
    kwargs = {"samples": cfg.data.num_val_samples, "seed": cfg.data.seed, "progress": False,
              "max_new_tokens": cfg.policy.generation.max_new_tokens}  # fmt: skip
    after = evaluate(final_model, "arithmetic", **kwargs)
    before = evaluate(cfg.policy.model_name, "arithmetic", **kwargs)
    note = ""
    if cfg.data.dataset_name == "arithmetic_parity":
        note = (
            "\n  (arithmetic_parity pairs prefer an even number to an odd one, neither the "
            "answer: task accuracy is expected to fall)"
        )
    head = "  held-out task accuracy, before (baseline) and after (model):\n"
    return head + report(after, before, None) + note
