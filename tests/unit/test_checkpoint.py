"""Checkpoints: `CheckpointManager` (atomic step_N folders, latest_complete, keep_top_k,
resume with RNG state) and the worker's DCP save/load and HF export (one rank, in process;
the two-rank sharded case is in test_lm_policy.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.losses import NLLLoss
from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
from tempering.utils.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    change_lines,
    restore_rng_state,
)
from tests.tiny_models import save_tiny_llama


def _save(mgr: CheckpointManager, step: int, metrics: dict | None = None) -> None:
    with mgr.save(
        step, {"metrics": metrics or {}, "dataloader": {"epoch": 0, "index": step}}, {"a": 1}
    ) as d:
        (d / "policy").mkdir()
        (d / "policy" / "weights.bin").write_bytes(b"x" * 10)


def _steps(mgr: CheckpointManager) -> list[int]:
    return [s for s, _ in mgr.complete_checkpoints()]


def test_save_writes_complete_folder_and_resume_info(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt", save_period=2)
    assert mgr.latest_complete() is None and mgr.maybe_resume() is None
    _save(mgr, 2, {"val/loss": 1.5})
    _save(mgr, 4, {"val/loss": 1.2})
    latest = mgr.latest_complete()
    assert latest == tmp_path / "ckpt" / "step_4"
    assert (latest / "policy" / "weights.bin").exists()
    assert (latest / "config.yaml").read_text().strip() == "a: 1"
    step, info = mgr.maybe_resume()
    assert step == 4 and info["metrics"] == {"val/loss": 1.2} and info["dataloader"]["index"] == 4
    assert [mgr.should_save(s) for s in range(1, 6)] == [False, True, False, True, False]
    assert mgr.should_save(5, is_last_step=True)


def test_a_resume_names_the_config_keys_that_changed(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1)
    saved = {"grpo": {"max_num_steps": 10, "seed": 42}, "policy": {"model_name": "tiny-arith"},
             "logger": {"wandb": {"api_key": "s3cret"}}}  # fmt: skip
    with mgr.save(1, {}, config=saved) as d:
        (d / "policy").mkdir()
    assert (
        change_lines(mgr.config_diff(mgr.step_dir(1), saved)) == []
    )  # a plain resume: nothing to say
    now = {"grpo": {"max_num_steps": 20, "seed": 42}, "policy": {"model_name": "smollm2"},
           "logger": {"wandb": {"api_key": "other"}}, "new": [1]}  # fmt: skip
    assert change_lines(mgr.config_diff(mgr.step_dir(1), now)) == [
        "grpo.max_num_steps: 10 -> 20",
        "new: '(absent)' -> [1]",
        "policy.model_name: 'tiny-arith' -> 'smollm2'",
    ]  # the key stays redacted on both sides, never printed


class _Policy:
    """Stand-in for a Policy: records what it was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_checkpoint(self, path: str) -> None:
        self.loaded.append(path)


def test_a_ppo_checkpoint_resumes_only_its_own_critic(tmp_path) -> None:
    """critic.model_name of another size than the critic was saved from (null: the policy's)
    is refused by name before anything loads; the same body under another name (a critic's
    exported folder, its head's config keys aside) resumes."""
    from tempering.algorithms.common import maybe_resume
    from tempering.utils.checkpoint import CheckpointMismatchError

    mgr = CheckpointManager(tmp_path / "results", save_period=1)
    saved = {"policy": {"model_name": "tiny-arith"}, "critic": {"enabled": True}}
    with mgr.save(3, {}, config=saved) as d:
        (d / "policy").mkdir()
    tiny = json.loads((Path(__file__).parents[2] / "models/tiny-arith/config.json").read_text())
    for name, cfg in (("bigger", {**tiny, "hidden_size": 256}),
                      ("exported", {**tiny, "architectures": ["LlamaForTokenClassification"],
                                    "num_labels": 1, "classifier_dropout": 0.0})):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    policy = _Policy()
    bigger = {**saved, "critic": {"enabled": True, "model_name": str(tmp_path / "bigger")}}
    with pytest.raises(CheckpointMismatchError) as err:
        maybe_resume(mgr, policy, None, bigger)
    assert "critic started from 'tiny-arith'" in str(err.value)
    assert "to resume that run, give critic.model_name=null" in str(err.value)
    assert policy.loaded == []
    exported = {**saved, "critic": {"enabled": True, "model_name": str(tmp_path / "exported")}}
    assert maybe_resume(mgr, policy, None, exported)[0] == 3
    off = {**bigger, "critic": {"enabled": False, "model_name": str(tmp_path / "bigger")}}
    assert maybe_resume(mgr, policy, None, off)[0] == 3  # no critic to load


def test_a_checkpoint_of_another_model_is_refused_by_name_with_the_fix(tmp_path) -> None:
    from tempering.algorithms.common import maybe_resume
    from tempering.utils.checkpoint import CheckpointMismatchError

    mgr = CheckpointManager(tmp_path / "results", save_period=1)
    lora_8 = {"lora_cfg": {"enabled": True, "dim": 8}}
    saved = {"policy": {"model_name": "tiny-arith", "dtensor_cfg": lora_8}}
    with mgr.save(3, {}, config=saved) as d:
        (d / "policy").mkdir()
    policy = _Policy()
    bigger = tmp_path / "bigger"  # a model folder of another size
    bigger.mkdir()
    tiny = json.loads((Path(__file__).parents[2] / "models/tiny-arith/config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**tiny, "hidden_size": 256}))
    other = {"policy": {"model_name": str(bigger), "dtensor_cfg": lora_8}}
    with pytest.raises(CheckpointMismatchError) as err:
        maybe_resume(mgr, policy, None, other)
    message = str(err.value)
    assert f"policy.model_name: 'tiny-arith' there, '{bigger}' now" in message
    assert f"checkpointing.checkpoint_dir={tmp_path / 'results'}_2" in message
    assert "to resume that run, give what it had: policy.model_name='tiny-arith'" in message
    lora_16 = {"lora_cfg": {"enabled": True, "dim": 16}}
    lora = {"policy": {"model_name": "tiny-arith", "dtensor_cfg": lora_16}}
    with pytest.raises(CheckpointMismatchError, match="lora_cfg.dim: 8 there, 16 now"):
        maybe_resume(mgr, policy, None, lora)
    off = {"policy": {"model_name": "tiny-arith", "dtensor_cfg": {"lora_cfg": {"dim": 16}}}}
    with pytest.raises(
        CheckpointMismatchError, match="lora_cfg.enabled: True there, '.absent.' now"
    ):
        maybe_resume(mgr, policy, None, off)
    assert policy.loaded == []  # nothing was loaded into the wrong model
    # the same model by another name (its folder): resumed, the change only logged
    same = {"policy": {"model_name": str(Path(__file__).parents[2] / "models/tiny-arith"),
                       "dtensor_cfg": lora_8}}  # fmt: skip
    assert maybe_resume(mgr, policy, None, same)[0] == 3
    # a LoRA setting that leaves the weights' shapes alone: resumed too
    lora_8_alpha = {"lora_cfg": {"enabled": True, "dim": 8, "alpha": 64.0}}
    alpha = {"policy": {"model_name": "tiny-arith", "dtensor_cfg": lora_8_alpha}}
    assert maybe_resume(mgr, policy, None, alpha)[0] == 3
    assert policy.loaded == [str(mgr.policy_dir(3))] * 2
    # LoRA off on both sides: its rank is not read, so it may differ
    plain = CheckpointManager(tmp_path / "plain", save_period=1)
    off_8 = {"policy": {"model_name": "tiny-arith", "dtensor_cfg": {"lora_cfg": {"dim": 8}}}}
    with plain.save(2, {}, config=off_8) as d:
        (d / "policy").mkdir()
    assert maybe_resume(plain, policy, None, off)[0] == 2


def test_crash_inside_save_leaves_no_checkpoint(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1)
    _save(mgr, 1)
    with pytest.raises(RuntimeError, match="boom"):
        with mgr.save(2, {}) as d:
            (d / "policy").mkdir()
            raise RuntimeError("boom")
    assert _steps(mgr) == [1]
    assert mgr.latest_complete() == tmp_path / "step_1"
    assert not (tmp_path / "step_2").exists()


def test_stray_temp_and_unfinished_dirs_are_ignored(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1)
    _save(mgr, 3)
    # A killed process leaves its temporary folder (with training_info, even) behind ...
    stray = tmp_path / "step_9.tmp-12345"
    stray.mkdir()
    (stray / "training_info.json").write_text(json.dumps({"step": 9}))
    # ... and a hand-made folder without the completion file is not a checkpoint either.
    (tmp_path / "step_7" / "policy").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    assert mgr.latest_complete() == tmp_path / "step_3"
    assert mgr.maybe_resume()[0] == 3


def test_partial_saves_of_dead_processes_are_removed_and_an_interrupted_rename_undone(
    tmp_path,
) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1)
    with mgr.save(2, {"metrics": {}}):
        pass
    dead = 2**22 + 12345  # above Linux's default pid_max: no such process
    (tmp_path / f"step_4.tmp-{dead}").mkdir()  # killed while writing step 4
    # Killed between moving an older step_3 aside (to overwrite it) and renaming the new in:
    (tmp_path / f"step_3.old.tmp-{dead}").mkdir()
    (tmp_path / f"step_3.old.tmp-{dead}" / "training_info.json").write_text('{"step": 3}')
    (tmp_path / "step_5.tmp-1").mkdir()  # pid 1 is alive: another writer, left alone
    step, _ = mgr.maybe_resume()
    assert step == 3  # the restored folder is the newest complete one
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_2", "step_3", "step_5.tmp-1"]


def test_keep_top_k_by_metric_keeps_latest(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1, keep_top_k=2, metric_name="val/loss")
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 0.5), (5, 4.0)]:
        _save(mgr, step, {"val/loss": loss})
    # best two by lowest loss: 4 (0.5) and 2 (1.0); 5 is the latest and is always kept
    assert _steps(mgr) == [2, 4, 5]
    hi = CheckpointManager(
        tmp_path / "hi", save_period=1, keep_top_k=1, metric_name="acc", higher_is_better=True
    )
    for step, acc in [(1, 0.2), (2, 0.9), (3, 0.5)]:
        _save(hi, step, {"acc": acc})
    assert _steps(hi) == [2, 3]


def test_keep_top_k_without_metric_keeps_newest(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1, keep_top_k=2)
    for step in range(1, 5):
        _save(mgr, step)
    assert _steps(mgr) == [3, 4]


def test_rng_state_round_trips_through_training_info(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _save(mgr, 1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    _, info = mgr.maybe_resume()
    restore_rng_state(info["rng_state"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    json.dumps(capture_rng_state())  # JSON-able


def test_invalid_settings_name_the_key(tmp_path) -> None:
    with pytest.raises(ValueError, match="save_period=0"):
        CheckpointManager(tmp_path, save_period=0)
    with pytest.raises(ValueError, match="keep_top_k=0"):
        CheckpointManager(tmp_path, save_period=1, keep_top_k=0)


# ----------------------------------------------------------------- worker state (DCP)
@pytest.fixture
def worker_factory(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    model_dir = tmp_path / "model"
    save_tiny_llama(model_dir, tie_word_embeddings=True)
    built: list[FSDP2PolicyWorker] = []

    def build() -> FSDP2PolicyWorker:
        if built:
            built[-1].shutdown()
        built.append(
            FSDP2PolicyWorker(
                str(model_dir),
                learning_rate=1e-2,
                lr_schedule="cosine",
                warmup_steps=1,
                total_steps=6,
                num_threads=1,
            )
        )
        return built[-1]

    yield build
    if built:
        built[-1].shutdown()


def _batch(seed: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (4, 10), generator=g)
    lens = torch.tensor([10, 6, 8, 3])
    mask = (torch.arange(10)[None] < lens[:, None]).float()
    return BatchedDataDict(
        input_ids=ids * mask.long(), input_lengths=lens, token_mask=mask, sample_mask=torch.ones(4)
    )


def test_worker_resume_matches_uninterrupted_run(worker_factory, tmp_path) -> None:
    """Save after 2 steps, restore into a FRESH worker: steps 3-4 equal the uninterrupted run
    (AdamW moments and the cosine schedule position must both be restored for this)."""
    batches = [_batch(s) for s in range(4)]
    loss_fn = NLLLoss()

    worker = worker_factory()
    for b in batches[:2]:
        worker.train(b, loss_fn, micro_batch_size=2)
    mgr = CheckpointManager(tmp_path / "ckpt", save_period=1)
    with mgr.save(2, {}) as folder:
        worker.checkpoint.save(str(folder / "policy"))
    uninterrupted = [worker.train(b, loss_fn, micro_batch_size=2) for b in batches[2:]]

    fresh = worker_factory()
    step, _ = mgr.maybe_resume()
    fresh.checkpoint.load(str(mgr.policy_dir(step)))
    resumed = [fresh.train(b, loss_fn, micro_batch_size=2) for b in batches[2:]]
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
    # and a worker that was NOT restored differs (so the check above has teeth)
    unrestored = worker_factory()
    assert abs(unrestored.train(batches[2], loss_fn)["loss"] - uninterrupted[0]["loss"]) > 1e-3


def test_load_checkpoint_names_missing_folder(worker_factory, tmp_path) -> None:
    worker = worker_factory()
    with pytest.raises(FileNotFoundError, match="no DCP checkpoint"):
        worker.checkpoint.load(str(tmp_path / "nothing"))


def test_export_hf_loads_with_from_pretrained(worker_factory, tmp_path) -> None:
    worker = worker_factory()
    data = _batch(0)
    worker.train(data, NLLLoss())
    worker.checkpoint.export_hf(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    mask = (torch.arange(10)[None] < data["input_lengths"][:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    lp = torch.nn.functional.pad(lp, (1, 0)) * mask
    torch.testing.assert_close(worker.get_logprobs(data)["logprobs"], lp, atol=1e-5, rtol=0)
    # the trained weights were exported, not the initial ones
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert not torch.allclose(initial.lm_head.weight, model.lm_head.weight)


def test_checkpoint_config_carries_no_credentials(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path, save_period=1)
    config = {"env": {"nemo_gym": {"extra_config": {"judge_api_key": "sk-live-123"}}},
              "policy": {"generation": {"http_server": {"api_key_env": "MY_KEY"}}}}  # fmt: skip
    with mgr.save(1, {}, config) as folder:
        (Path(folder) / "policy").mkdir()
    text = (tmp_path / "step_1" / "config.yaml").read_text()
    assert "sk-live-123" not in text and "REDACTED" in text
    assert "MY_KEY" in text  # the NAME of the variable holding a key is kept (not a secret)
