"""`DistillationLoss` and `topk_logprobs` (tempering/losses.py) against KLs computed by hand.

One position, a vocabulary of 4: teacher probabilities (0.5, 0.3, 0.15, 0.05), student
(0.25, 0.25, 0.25, 0.25), top-2 = tokens {0, 1}. Written out with `math`, independently of
the loss's tensor code: renormalised on the top-2 the teacher is (0.625, 0.375) and the
student (0.5, 0.5).
"""

from __future__ import annotations

import math

import pytest
import torch

from tempering.losses import DistillationLoss, topk_logprobs

TEACHER = [0.5, 0.3, 0.15, 0.05]
STUDENT = [0.25, 0.25, 0.25, 0.25]


def _batch(k: int) -> tuple[torch.Tensor, dict]:
    """Student logits [1, 2, 4] and a batch whose token 1 the teacher scored (top-k)."""
    teacher_logits = torch.log(torch.tensor([TEACHER, TEACHER]))[None]  # [1, 2, 4]
    values, indices = topk_logprobs(teacher_logits, k)
    student_logits = torch.log(torch.tensor([STUDENT, STUDENT]))[None].requires_grad_(True)
    data = {
        "input_ids": torch.tensor([[1, 0]]),
        "token_mask": torch.tensor([[0.0, 1.0]]),
        "sample_mask": torch.tensor([1.0]),
        "teacher_topk_logprobs": values,
        "teacher_topk_indices": indices,
    }
    return student_logits, data


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


# renormalised on the top-2 set
T2, S2 = [0.5 / 0.8, 0.3 / 0.8], [0.5, 0.5]
HAND = {
    ("forward", False): _kl(T2, S2),
    ("reverse", False): _kl(S2, T2),
    ("mixed", False): 0.3 * _kl(T2, S2) + 0.7 * _kl(S2, T2),
    # not renormalised: partial sums over the top-2 of the full distributions
    ("forward", True): 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25),
    ("reverse", True): 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.3),
    ("mixed", True): 0.3 * (0.5 * math.log(2) + 0.3 * math.log(1.2))
    + 0.7 * (0.25 * math.log(0.5) + 0.25 * math.log(0.25 / 0.3)),
}


@pytest.mark.parametrize("kl_type,zero_outside", list(HAND), ids=[f"{k}-{z}" for k, z in HAND])
def test_each_kl_type_equals_the_hand_computed_value(kl_type, zero_outside):
    logits, data = _batch(k=2)
    loss_fn = DistillationLoss(kl_type, mixed_kl_weight=0.3, zero_outside_topk=zero_outside)
    loss, metrics = loss_fn(logits, data, torch.tensor(1.0), torch.tensor(1.0))
    assert float(loss.detach()) == pytest.approx(HAND[kl_type, zero_outside], abs=1e-6)
    assert metrics["teacher_topk_mass"] == pytest.approx(0.8, abs=1e-6)
    assert metrics["student_topk_mass"] == pytest.approx(0.5, abs=1e-6)
    loss.backward()  # the student's gradient exists and is finite
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0].abs().sum() > 0


@pytest.mark.parametrize("zero_outside", [False, True])
def test_k_equal_to_the_vocabulary_gives_the_full_kl(zero_outside):
    logits, data = _batch(k=4)
    for kl_type, want in (("forward", _kl(TEACHER, STUDENT)), ("reverse", _kl(STUDENT, TEACHER))):
        loss, _ = DistillationLoss(kl_type, zero_outside_topk=zero_outside)(
            logits, data, torch.tensor(1.0), torch.tensor(1.0)
        )
        assert float(loss.detach()) == pytest.approx(want, abs=1e-6)


def test_masked_tokens_and_the_global_count():
    logits, data = _batch(k=2)
    loss_fn = DistillationLoss("forward")
    one, _ = loss_fn(logits, data, torch.tensor(4.0), torch.tensor(1.0))
    assert float(one.detach()) == pytest.approx(HAND["forward", False] / 4, abs=1e-6)
    data["sample_mask"] = torch.tensor([0.0])
    none, metrics = loss_fn(logits, data, torch.tensor(4.0), torch.tensor(1.0))
    assert float(none.detach()) == 0.0 and metrics["num_valid_tokens"] == 0.0


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="kl_type='jsd' is unknown"):
        DistillationLoss("jsd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mixed_kl_weight=1.5"):
        DistillationLoss("mixed", mixed_kl_weight=1.5)
