"""bf16 mixed precision on CPU (policy.precision=bfloat16): FSDP2 casts the parameters to bf16
for forward/backward, keeps fp32 master weights and AdamW state, and reduces gradients in fp32.

Tested by training: SFT of the untrained tiny-arith model on arithmetic (the SFT recipe's start,
lr 1e-3, AdamW, 40 steps of 64) once in fp32 and once in bf16 from the same init and batches.
Both must learn (loss 5.7 -> below 1.5), and bf16's loss curve must track fp32's within 5% of
fp32's loss at every step (measured on this machine: at most 3%), while not being identical to
it (identical curves would mean bf16 was not in effect)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tempering.config import ConfigError, SFTMasterConfig, load_config
from tempering.data.arithmetic import arithmetic_sft_message_logs
from tempering.data.collate import collate_sft, pad_token_id_of
from tempering.data.processing import tokenize_message_log
from tempering.losses import NLLLoss
from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
from tempering.models.registry import resolve_model_path

BATCH, STEPS = 64, 40


def _sft_curve(path: str, precision: str, batches: list) -> tuple[list[float], FSDP2PolicyWorker]:
    worker = FSDP2PolicyWorker(path, precision=precision, learning_rate=1e-3, num_threads=2)
    losses = [worker.train(b, NLLLoss(), global_batch_size=BATCH)["loss"] for b in batches]
    return losses, worker


# The FSDP2-wrapped model must not return a view (torch warns in every run's log that an
# in-place op on it would skip the module's backward hooks).
@pytest.mark.filterwarnings("error:FSDP2-wrapped module")
def test_bf16_sft_tracks_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    path = str(resolve_model_path("tiny-arith-untrained"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    logs = arithmetic_sft_message_logs(BATCH * STEPS, seed=0).examples
    examples = [tokenize_message_log(log, tokenizer, 32) for log in logs]
    pad = pad_token_id_of(tokenizer)
    batches = [collate_sft(examples[i * BATCH : (i + 1) * BATCH], pad) for i in range(STEPS)]

    curves = {}
    for precision in ("float32", "bfloat16"):
        curves[precision], worker = _sft_curve(path, precision, batches)
        if precision == "bfloat16":  # fp32 master weights and optimizer state
            assert {p.dtype for p in worker.state.model.parameters()} == {torch.float32}
            states = [s for s in worker.state.optimizer.state.values() if "exp_avg" in s]
            assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
        worker.shutdown()

    fp32, bf16 = curves["float32"], curves["bfloat16"]
    print(f"\nfp32: {[round(x, 3) for x in fp32[::8]]}\nbf16: {[round(x, 3) for x in bf16[::8]]}")
    assert fp32[0] > 5.0 and fp32[-1] < 1.5 and bf16[-1] < 1.5, (fp32, bf16)
    gaps = [abs(b - f) / f for f, b in zip(fp32, bf16, strict=True)]
    assert max(gaps) < 0.05, max(gaps)
    assert max(gaps) > 1e-4, "bf16 and fp32 curves are identical: bf16 compute was not used"


def test_float16_training_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"policy.precision='float16'.*loss scaling.*bfloat16"):
        load_config(
            Path(__file__).parents[2] / "examples/configs/sft.yaml",
            ["policy.precision=float16"],
            schema=SFTMasterConfig,
        )
