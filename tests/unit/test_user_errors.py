"""A user's mistake in a known-up-front input prints one message, no traceback, exit 2, and is
found before Ray or any worker starts (issue: a missing model and a bad JSONL row surfaced
only after 16-19 s of start-up under a traceback).

Each case runs an example script as a user would. ``RAY_ADDRESS`` points at a port where no
Ray listens: a script that reached Ray before finding the mistake would fail there with a
connection error instead of the message asserted here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tempering.config.schemas import (
    GRPO_DATASETS,
    KTO_DATASETS,
    PREFERENCE_DATASETS,
    SFT_DATASETS,
)

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}  # nothing listens on the discard port
    return subprocess.run(
        [sys.executable, f"examples/{script}", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bad_rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    path.write_text('{"problem": "1+1", "expected_answer": "2"}\n{"problem": 5}\n')
    return path


@pytest.fixture(scope="module")
def bad_labels(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text('{"prompt": "1+1=?", "completion": " 2", "label": true}\n'
                    '{"prompt": "1+2=?", "completion": " 5", "label": 0}\n')  # fmt: skip
    return path


@pytest.fixture(scope="module")
def two_rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "two.jsonl"
    path.write_text('{"problem": "1+1", "expected_answer": "2"}\n' * 2)  # 1 trains, 1 validates
    return path


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory) -> Path:
    """tiny-arith's folder without its tokenizer, as a weights-only checkpoint comes."""
    import shutil

    from tempering.models.registry import resolve_model_path

    folder = tmp_path_factory.mktemp("models") / "weights_only"
    shutil.copytree(resolve_model_path("tiny-arith"), folder,
                    ignore=shutil.ignore_patterns("tokenizer*", "chat_template.jinja"))  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def no_slot(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompt.txt"
    path.write_text("Solve the problem and put the answer last.\n")  # no '{}' for the problem
    return path


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """tiny-arith as a base model: its tokenizer without a chat template."""
    import shutil

    from tempering.models.registry import resolve_model_path

    folder = tmp_path_factory.mktemp("models") / "base"
    shutil.copytree(resolve_model_path("tiny-arith"), folder)
    (folder / "chat_template.jinja").unlink()
    return folder


CASES = {
    "missing model": (
        "run_grpo_math.py", ["policy.model_name=/no/such/model"], ["'/no/such/model'", "Fix:"],
    ),
    "malformed JSONL row": (
        "run_grpo_math.py",
        ["data.dataset_name=problems", "data.train_data_path={bad_rows}"],
        ["problems.jsonl:2:", "'expected_answer'", "data.on_bad_row=skip"],
    ),
    "missing data file": (
        "run_sft.py",
        ["data.dataset_name=messages", "data.train_data_path=/no/such.jsonl"],
        ["'/no/such.jsonl' does not exist"],
    ),
    "unknown dataset name": (
        "run_dpo.py", ["data.dataset_name=ultrafeedback"], ["data.dataset_name='ultrafeedback'"],
    ),
    "NeMo Gym rows not written yet": (
        "run_grpo_nemo_gym.py",
        ["data.dataset_name=nemo_gym", "data.train_data_path=/no/gym.jsonl"],
        ["data.train_data_path='/no/gym.jsonl' does not exist", "tempering gym-examples /no/gym.jsonl"],
    ),
    "fewer problems than one step takes": (
        "run_grpo_math.py",
        ["data.dataset_name=problems", "data.train_data_path={two_rows}"],
        ["the training problems (data.train_data_path='", "example, fewer than the 32 one step",
         "lower grpo.num_prompts_per_step"],
    ),
    "custom reward module not there": (
        "run_grpo_math.py", ["env.reward_fn=no_such_rewards:brevity"],
        ["env.reward_fn='no_such_rewards:brevity': 'no_such_rewards' is not found from "],
    ),
    "a base model's prompts through a chat template": (
        "run_grpo_math.py", ["policy.model_name={base_model}", "data.use_chat_template=true"],
        ["its tokenizer has no chat template (a base model?), and data.use_chat_template=true "
         "needs one", "data.use_chat_template=false for raw prompts"],
    ),
    "a base model offered a tool": (
        "run_grpo_math.py", ["policy.model_name={base_model}", "env.task_name=calculator"],
        ["its tokenizer has no chat template (a base model?), and the tasks ['calculator'] "
         "(messages, tools) needs one", "policy.tokenizer.chat_template"],
    ),
    "a base model's DPO pairs through a chat template": (
        "run_dpo.py", ["policy.model_name={base_model}", "data.use_chat_template=true"],
        ["its tokenizer has no chat template (a base model?)"],
    ),
    "a prompt file with no place for the problem": (
        "run_grpo_math.py", ["data.prompt_file={no_slot}"],
        ["data.prompt_file='", "prompt.txt' must hold exactly one '{}'", "it has 0"],
    ),
    "SFT validation data smaller than one validation batch": (
        "run_sft.py", ["data.num_val_samples=32"],
        ["the validation data (data.dataset_name='arithmetic', data.num_val_samples=32) has 32 "
         "examples, fewer than the 128 one validation batch takes (set by "
         "sft.val_global_batch_size): validation would never run", "sft.val_period=0"],
    ),
    "DPO validation pairs fewer than one validation batch holds": (
        "run_dpo.py", ["data.num_val_samples=16"],
        ["has 16 pairs, fewer than the 64 one validation batch takes (set by "
         "dpo.val_global_batch_size)"],
    ),
    "a model folder without a tokenizer": (
        "run_grpo_math.py", ["policy.model_name={weights_only}"],
        ["policy.model_name='", "weights_only': no tokenizer can be read from",
         "Fix: set policy.tokenizer.name to the folder or hub id of the model's tokenizer"],
    ),
    "file dataset without its file": (
        "run_rm.py", ["data.dataset_name=preference"], ["data.train_data_path"],
    ),
    "a KTO row labelled 0, not false": (
        "run_kto.py", ["data.dataset_name=unpaired", "data.train_data_path={bad_labels}"],
        ["rows.jsonl:2:", "field 'label' must be bool, got int", "data.on_bad_row=skip"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def mistakes(bad_rows, bad_labels, two_rows, base_model, no_slot, weights_only,
             tmp_path_factory) -> dict:  # fmt: skip
    """Every case's script run, as many at a time as there are cores (each spends ~12 s
    importing torch and transformers before it refuses: 3.5 minutes one after another), each
    with folders of its own (two runs on one folder are refused: utils/run_lock.py)."""
    from concurrent.futures import ThreadPoolExecutor

    files = {"bad_rows": bad_rows, "bad_labels": bad_labels, "two_rows": two_rows, "base_model": base_model,
             "no_slot": no_slot, "weights_only": weights_only}  # fmt: skip

    def run(case: str) -> subprocess.CompletedProcess:
        script, overrides, _ = CASES[case]
        out = tmp_path_factory.mktemp("case")
        return _run(script, *(o.format(**files) for o in overrides),
                    f"logger.log_dir={out}/logs", f"checkpointing.checkpoint_dir={out}/ckpt")  # fmt: skip

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(CASES, pool.map(run, CASES), strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_is_one_message_before_anything_starts(case, mistakes):
    _, _, expected = CASES[case]
    proc = mistakes[case]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr[-2000:])
    if case == "missing model":  # named before the plan, which could not have sized it
        assert "placement plan" not in proc.stderr and "is unknown here" not in proc.stderr


def test_dataset_names_in_the_schema_are_the_loaders_names():
    """The config-time check must neither refuse a dataset a loader reads nor let through
    one that none reads."""
    from tempering.data.preference_datasets import PREFERENCE_LOADERS
    from tempering.data.sft_datasets import SFT_LOADERS

    assert set(SFT_DATASETS) == {"arithmetic", "arithmetic_calculator", "gsm8k", *SFT_LOADERS}
    assert set(PREFERENCE_DATASETS) == {"arithmetic", "arithmetic_parity", "gsm8k",
                                        *PREFERENCE_LOADERS}  # fmt: skip
    assert set(KTO_DATASETS) == {*PREFERENCE_DATASETS, "unpaired"}  # kto.load_data's branch
    from tempering.config.schemas import DataConfig
    from tempering.data.grpo_problems import _dataset_problems

    with pytest.raises(ValueError, match="has no GRPO prompts"):
        _dataset_problems(DataConfig(dataset_name="squad"), None)
    for name in GRPO_DATASETS:  # each has a branch (a missing file is another error)
        cfg = DataConfig(dataset_name=name, train_data_path="/no/such.jsonl", num_train_samples=4)
        try:
            _dataset_problems(cfg, None)
        except (ValueError, FileNotFoundError) as err:
            assert "has no GRPO prompts" not in str(err), name


def test_a_folder_another_run_is_using_is_refused_before_anything_starts(tmp_path):
    """The same command started twice (two terminals, a requeued job): the second would
    overwrite the first's checkpoints and interleave its metrics."""
    from types import SimpleNamespace

    from tempering.utils.run_lock import lock_run_dirs

    ckpt = tmp_path / "ckpt"
    running = SimpleNamespace(
        logger=SimpleNamespace(log_dir=str(tmp_path / "logs")),
        checkpointing=SimpleNamespace(enabled=True, checkpoint_dir=str(ckpt)),
    )
    with lock_run_dirs(running):  # this test process plays the run that is going
        proc = _run("run_grpo_math.py", f"checkpointing.checkpoint_dir={ckpt}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"checkpointing.checkpoint_dir='{ckpt}' is in use by another run (pid {os.getpid()} " \
        in proc.stderr, proc.stderr[-2000:]  # fmt: skip


def test_a_folder_holding_another_models_run_is_refused_before_anything_starts(tmp_path):
    """Reusing a checkpoint_dir for another model: the refusal (with the fix) used to come
    only after Ray and the workers had started."""
    import json

    from tempering.models.registry import resolve_model_path
    from tempering.utils.checkpoint import CheckpointManager

    bigger = tmp_path / "bigger"  # a model folder of another size than tiny-arith
    bigger.mkdir()
    tiny = json.loads((Path(resolve_model_path("tiny-arith")) / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**tiny, "hidden_size": 256}))
    ckpt = CheckpointManager(tmp_path / "ckpt", save_period=1)
    with ckpt.save(3, {}, config={"policy": {"model_name": str(bigger)}}) as folder:
        (folder / "policy").mkdir()
    proc = _run("run_grpo_math.py", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    expected = f"holds step 3 of another model's run (policy.model_name: '{bigger}' there, "
    assert expected in proc.stderr, proc.stderr[-2000:]
    assert f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}_2" in proc.stderr


def test_a_custom_reward_in_the_working_folder_is_found_as_its_actor_finds_it(
    tmp_path, monkeypatch
):
    """Ray's workers import from the driver's working folder, so the check looks there too
    (a run from the folder holding my_rewards.py trains; from elsewhere it stops)."""
    from tempering.environments.reward_fn import RewardFnNotFoundError, check_reward_fn

    (tmp_path / "my_rewards_here.py").write_text("def brevity(p, c, m):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    check_reward_fn("my_rewards_here:brevity")
    check_reward_fn("my_rewards_here.py:brevity")
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(RewardFnNotFoundError, match="run from the folder that holds it"):
        check_reward_fn("my_rewards_here:brevity")
