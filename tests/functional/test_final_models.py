"""Every algorithm ends with a usable model, and any step checkpoint exports to one.

Each algorithm runs two steps through `setup()`/`train()` on the committed tiny-arith; its
`<checkpoint_dir>/final_hf` must load with plain transformers and generate (the reward model:
load as a sequence classifier and score). For SFT and DPO, final_hf must hold the trained
weights: its log-probs on fixed text equal the live trained policy's (within 1e-5) and differ
from the initial model's. GRPO runs on a user's own problems file in
OpenMathInstruct-2's shape (`problem` / `expected_answer`), scored by math-verify. The GRPO
step checkpoint goes through `tempering export`: the exported model's log-probs equal the
live policy's within 1e-6 (fp32), and a partial checkpoint is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tempering.config import (
    DPOMasterConfig,
    GRPOMasterConfig,
    RMMasterConfig,
    SFTMasterConfig,
    load_config,
)

REPO = Path(__file__).parents[2]


def _common(tmp: Path) -> list[str]:
    return [
        "policy.num_threads=1",
        f"logger.log_dir={tmp}/logs",
        "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp}/ckpt",
    ]


def _generates(folder: Path) -> str:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("Q: 23+45=? A:", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert tokenizer.chat_template and (folder / "generation_config.json").is_file()
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _hf_logprobs(
    folder: str | Path | torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """``[B, S-1]`` log-probs of each next token under the HF model in `folder` (fp32), or
    under a model already built (e.g. a ``PeftModel``)."""
    model = (
        folder
        if isinstance(folder, torch.nn.Module)
        else (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    )
    model.eval()
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]


def _fixed_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids of a few fixed arithmetic lines, and their lengths."""
    texts = ["Q: 23+45=? A: 68", "Q: 7+8=? A: 15", "Q: 90+9=? A: 99", "Q: 1+1=? A: 2"]
    rows = [tokenizer(t)["input_ids"] for t in texts]
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.full((len(rows), int(lengths.max())), tokenizer.pad_token_id or 0)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, lengths


def _omi2_file(path: Path, n: int) -> Path:
    from tempering.models.tiny_arith import make_problems

    rows = [{"problem": p["prompt"], "expected_answer": p["answer"], "problem_source": "tiny"}
            for p in make_problems(n, seed=5)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grpo_on_own_problems_leaves_final_hf_and_exports_any_step(ray_session, tmp_path):
    from tempering.algorithms import grpo
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.evaluation import resolve_model
    from tempering.models.export import PartialCheckpointError, export_checkpoint

    data = _omi2_file(tmp_path / "omi2.jsonl", 400)
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [*_common(tmp_path), "data.dataset_name=problems", f"data.train_data_path={data}",
         "data.num_val_samples=32", "grpo.num_prompts_per_step=8", "grpo.max_num_steps=2",
         "grpo.val_period=2", "policy.train_global_batch_size=64",
         "policy.train_micro_batch_size=64", "checkpointing.save_period=1",
         # rows computed whole on both sides, so the export comparison can ask for 1e-6 (a
         # shared prompt run once reorders float sums: ~1e-6, see test_shared_prefix.py)
         "policy.shared_prefix=false"],
        schema=GRPOMasterConfig,
    )  # fmt: skip
    run = grpo.setup(cfg, resolved)
    try:
        assert {p.task_name for p in run.train_problems} == {"math"}  # math-verify by default
        summary = grpo.train(run)
        assert run.signal.observed == 2  # every step reached the no-signal watch
        assert "warning" in summary  # and the summary carries its verdict (None: too short)
        rewards = [json.loads(line).get("train/reward_mean") for line in
                   (tmp_path / "logs/metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert max(r for r in rewards if r is not None) > 0  # math-verify scored " 68" as 68
        exported, info = export_checkpoint(tmp_path / "ckpt/step_2", tmp_path / "exported")
        assert info["step"] == 2
        probe = grpo.rollout_batch(run, run.val_problems[:4], 2)
        data_view = BatchedDataDict(
            input_ids=probe["input_ids"], input_lengths=probe["input_lengths"]
        )
        live = run.policy.get_logprobs(data_view)["logprobs"]
    finally:
        run.close()
    final = Path(summary["final_model"])
    assert final == tmp_path / "ckpt/final_hf"
    _generates(final)
    ids, lengths = probe["input_ids"], probe["input_lengths"]
    lp = _hf_logprobs(exported, ids, lengths)
    valid = (torch.arange(ids.shape[1])[None] < lengths[:, None])[:, 1:]
    diff = (lp - live[:, 1:]).abs()[valid].max()
    assert diff < 1e-6, f"exported vs checkpoint log-probs differ by {float(diff):.2e}"
    # a checkpoint that was never finished is refused, by name
    partial = tmp_path / "ckpt/step_9"
    shutil.copytree(tmp_path / "ckpt/step_2", partial)
    (partial / "training_info.json").unlink()
    with pytest.raises(PartialCheckpointError, match="step_9 is not a complete step checkpoint"):
        export_checkpoint(partial, tmp_path / "never")
    # the run's checkpoint folder itself: export and eval name what it holds and the newest
    hint = r"checkpoint folder, not one step: it holds step_1, step_2; .*ckpt/step_2 or its final"
    with pytest.raises(PartialCheckpointError, match=hint):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "never")
    with pytest.raises(FileNotFoundError, match=hint):
        resolve_model(str(tmp_path / "ckpt"), tmp_path / "scratch")


@pytest.mark.parametrize("algorithm", ["sft", "dpo", "rm"])
def test_sft_dpo_rm_leave_final_hf(ray_session, tmp_path, algorithm):
    from tempering.algorithms import dpo, rm, sft

    module, schema, config, extra = {
        "sft": (sft, SFTMasterConfig, "sft.yaml", ["sft.max_num_steps=2", "sft.val_period=0",
                                                   "policy.model_name=tiny-arith"]),
        "dpo": (dpo, DPOMasterConfig, "dpo.yaml", ["dpo.max_num_steps=2", "dpo.val_period=0"]),
        "rm": (rm, RMMasterConfig, "rm.yaml", ["rm.max_num_steps=2", "rm.val_period=0",
                                                "policy.scheduler.warmup_steps=0"]),
    }[algorithm]  # fmt: skip
    cfg, resolved = load_config(
        REPO / "examples/configs" / config, [*_common(tmp_path), *extra], schema=schema
    )
    run = module.setup(cfg, resolved)
    try:
        module.train(run)
        if algorithm == "rm":
            folder = rm.export(run)
        else:  # the trained weights, as the live policy holds them
            from tempering.distributed.batched_data_dict import BatchedDataDict

            ids, lengths = _fixed_batch(AutoTokenizer.from_pretrained(tmp_path / "ckpt/final_hf"))
            policy = run.model if algorithm == "dpo" else run.policy  # PreferenceRun: .model
            live = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lengths))
    finally:
        run.close()
    if algorithm != "rm":
        from tempering.models.registry import resolve_model_path

        final = tmp_path / "ckpt/final_hf"
        _generates(final)
        valid = (torch.arange(ids.shape[1])[None] < lengths[:, None])[:, 1:]
        trained = live["logprobs"][:, 1:][valid]
        vs_live = (_hf_logprobs(final, ids, lengths)[valid] - trained).abs().max()
        initial = _hf_logprobs(resolve_model_path(cfg.policy.model_name), ids, lengths)[valid]
        vs_initial = (initial - trained).abs().max()
        assert vs_live < 1e-5, f"final_hf is not the trained policy: log-probs differ by {vs_live}"
        assert vs_initial > 1e-3, f"training left the model as it was (max change {vs_initial})"
        return
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = model(**tokenizer(["Q: 1+1=? A: 2"], return_tensors="pt")).logits
    assert scores.shape == (1, 1) and torch.isfinite(scores).all()


def test_a_base_model_learns_and_eval_agrees_with_the_runs_validation(ray_session, tmp_path):
    """A base model -- tiny-arith without its chat template, as a pretrained-only checkpoint
    ships -- trains with GRPO on raw prompts (its turns end at EOS) and learns: held-out
    accuracy rises by at least 5 points from 40.6% (measured: +14.6 in 15 steps). And
    `tempering eval` scores the same problems the way GRPO validation does: on the main
    job's config, the final model's eval accuracy equals the run's last validation."""
    from tempering.algorithms import grpo
    from tempering.evaluation import evaluate
    from tempering.models.registry import resolve_model_path

    base = tmp_path / "base"
    shutil.copytree(resolve_model_path("tiny-arith"), base)
    (base / "chat_template.jinja").unlink()
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [*_common(tmp_path), f"policy.model_name={base}", "grpo.max_num_steps=15",
         "grpo.val_period=15", "data.num_val_samples=96", "grpo.max_val_samples=96",
         "checkpointing.save_period=15"],
        schema=GRPOMasterConfig,
    )  # fmt: skip
    run = grpo.setup(cfg, resolved)
    try:
        assert run.chat.prompts.chat_template is None
        assert run.chat.prompts.eot_token_id == run.tokenizer.eos_token_id
        summary = grpo.train(run)
    finally:
        run.close()
    assert summary["end_accuracy"] >= summary["start_accuracy"] + 0.05, summary
    final = evaluate(summary["final_model"], "arithmetic", samples=96, progress=False)
    assert final.accuracy == summary["end_accuracy"]
    assert final.settings["use_chat_template"] is False
    start = evaluate(str(base), "arithmetic", samples=96, progress=False)
    assert start.accuracy == summary["start_accuracy"]
    step = evaluate(str(tmp_path / "ckpt/step_15"), "arithmetic", samples=96, progress=False)
    assert step.correct == final.correct  # a step checkpoint, exported on the fly


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_loads_final_hf_and_eval_agrees_across_engines(
    ray_session, worker_venvs_dir, tmp_path
):
    """A run's final_hf loads in vLLM (its own venv, a Ray worker), and `tempering eval
    --backend vllm` scores it as the torch engine does (fp32 greedy: the same tokens)."""
    from tempering.algorithms import sft
    from tempering.evaluation import evaluate

    cfg, resolved = load_config(
        REPO / "examples/configs/sft.yaml",
        [*_common(tmp_path), "sft.max_num_steps=1", "sft.val_period=0",
         "policy.model_name=tiny-arith"],
        schema=SFTMasterConfig,
    )  # fmt: skip
    run = sft.setup(cfg, resolved)
    try:
        sft.train(run)
    finally:
        run.close()
    final = str(tmp_path / "ckpt/final_hf")
    torch_result = evaluate(final, "arithmetic", samples=32, progress=False)
    vllm_result = evaluate(final, "arithmetic", samples=32, progress=False, backend="vllm")
    assert vllm_result.correct == torch_result.correct
    assert [e["completions"] for e in vllm_result.examples] == [
        e["completions"] for e in torch_result.examples
    ]


# a chat template of the run's own (`policy.tokenizer.chat_template`), told apart by its marker
RUN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}{# the run's #}"
)


def test_lora_grpo_leaves_merged_final_hf_a_peft_adapter_and_exports_either(ray_session, tmp_path):
    """The LoRA config end to end (colocated refit of merged weights, adapter-only step
    checkpoints): final_hf is the trained policy, final_adapter on the base model equals it,
    and `tempering export` writes the merged model or the adapter from a step checkpoint.

    The model folder holds weights only, the tokenizer is `policy.tokenizer.name` and the chat
    template `policy.tokenizer.chat_template`: the workers decoded with the model folder's
    tokenizer (a folder without one failed in the worker) and final_hf shipped its template."""
    import shutil

    from peft import PeftModel

    from tempering.algorithms import grpo
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.models.export import export_checkpoint
    from tempering.models.registry import resolve_model_path

    weights_only = tmp_path / "weights_only"
    shutil.copytree(resolve_model_path("tiny-arith"), weights_only,
                    ignore=shutil.ignore_patterns("tokenizer*", "chat_template.jinja"))  # fmt: skip
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny_lora.yaml",
        [*_common(tmp_path), "grpo.max_num_steps=2", "grpo.val_period=2",
         "data.num_val_samples=32", "grpo.max_val_samples=32", "checkpointing.save_period=1",
         "policy.shared_prefix=false", f"policy.model_name={weights_only}",
         "policy.tokenizer.name=tiny-arith", f"policy.tokenizer.chat_template={RUN_TEMPLATE!r}"],
        schema=GRPOMasterConfig,
    )  # fmt: skip
    run = grpo.setup(cfg, resolved)
    try:
        grpo.train(run)
        ids, lengths = _fixed_batch(AutoTokenizer.from_pretrained(tmp_path / "ckpt/final_hf"))
        live = run.policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lengths))
    finally:
        run.close()
    valid = (torch.arange(ids.shape[1])[None] < lengths[:, None])[:, 1:]
    trained = live["logprobs"][:, 1:][valid]
    base_path = resolve_model_path("tiny-arith")
    assert (_hf_logprobs(base_path, ids, lengths)[valid] - trained).abs().max() > 1e-3
    merged, _ = export_checkpoint(tmp_path / "ckpt/step_2", tmp_path / "exported")
    adapter, info = export_checkpoint(tmp_path / "ckpt/step_2", tmp_path / "adapter", adapter=True)
    assert info["dtype"] == "float32" and (adapter / "adapter_config.json").is_file()
    for folder in (tmp_path / "ckpt/final_hf", merged):  # the run's tokenizer and template
        assert AutoTokenizer.from_pretrained(folder).chat_template == RUN_TEMPLATE, folder
    for folder in (tmp_path / "ckpt/final_hf", merged):
        lp = _hf_logprobs(folder, ids, lengths)[valid]
        assert (lp - trained).abs().max() < 1e-5, folder
    for folder in (tmp_path / "ckpt/final_adapter", adapter):
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        lp = _hf_logprobs(PeftModel.from_pretrained(base, folder), ids, lengths)[valid]
        assert (lp - trained).abs().max() < 1e-5, folder
