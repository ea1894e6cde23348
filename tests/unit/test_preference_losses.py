"""The preference losses (`tempering.preference_losses`) against the papers' formulas written
out here, loss and gradient, on test_losses.py's batch: DPO's losses by TRL's names (sigmoid,
conservative, robust, hinge, IPO, SimPO, ORPO) and Bradley-Terry."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses import B, S, hand_lp, leaf, make_batch

from tempering.losses import token_logprobs
from tempering.preference_losses import BradleyTerryLoss, DPOLoss, count_valid_pairs


@pytest.fixture
def batch() -> dict:
    return make_batch()


def dpo_data(batch: dict, masked_pair: bool) -> dict:
    ids = batch["input_ids"]
    curr = token_logprobs(batch["logits"], ids)
    return {
        "input_ids": ids,
        "token_mask": batch["token_mask"],
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0] if masked_pair else [1.0] * 4),
        "reference_policy_logprobs": curr + batch["noise"],
    }


def hand_preference(z: torch.Tensor, beta: float, kind: str, eps: float) -> torch.Tensor:
    """The papers' per-pair losses of the reward margin z = beta * d, written out."""
    log_sig = lambda x: torch.log(1 / (1 + torch.exp(-x)))  # noqa: E731
    if kind == "sigmoid":  # DPO; conservative DPO with eps > 0
        return -(1 - eps) * log_sig(z) - eps * log_sig(-z)
    if kind == "robust":  # robust DPO (Chowdhury et al. 2024)
        return (-(1 - eps) * log_sig(z) + eps * log_sig(-z)) / (1 - 2 * eps)
    if kind == "hinge":  # SLiC
        return torch.clamp(1 - z, min=0)
    if kind == "simpo":  # SimPO: z from the policy alone, shifted by the margin gamma
        return -(1 - eps) * log_sig(z - SIMPO_GAMMA) - eps * log_sig(SIMPO_GAMMA - z)
    assert kind == "ipo"  # IPO: the log-ratio difference d regressed to 1 / (2 beta)
    return (z / beta - 1 / (2 * beta)) ** 2


SIMPO_GAMMA = 0.7


def hand_orpo(
    lp_c: torch.Tensor, lp_r: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO (Hong et al. 2024): -lambda log sigmoid(log(odds_c / odds_r)), odds = p / (1 - p)
    of the mean-per-token probability p; returns the loss and the log odds ratio."""
    p_c, p_r = torch.exp(lp_c), torch.exp(lp_r)
    ratio = torch.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
    return -beta * torch.log(1 / (1 + torch.exp(-ratio))), ratio


DPO_KINDS = [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.2), ("hinge", 0.0), ("ipo", 0.0),
             ("simpo", 0.0), ("simpo", 0.1), ("orpo", 0.0)]  # fmt: skip
REFERENCE_FREE = ("simpo", "orpo")


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("masked_pair", [False, True])
@pytest.mark.parametrize("kind,eps", DPO_KINDS)
def test_dpo_loss_and_grad(batch, average, masked_pair, kind, eps):
    beta, sft_w = 0.3, 0.5
    data = dpo_data(batch, masked_pair)
    pairs = count_valid_pairs(data["sample_mask"])
    assert pairs.item() == (1 if masked_pair else 2)
    logits = leaf(batch)
    loss_fn = DPOLoss(beta, preference_average_log_probs=average, sft_loss_weight=sft_w,
                      preference_loss_type=kind, label_smoothing=eps,
                      simpo_gamma=SIMPO_GAMMA if kind == "simpo" else None)  # fmt: skip
    if kind in REFERENCE_FREE:  # the loss must not read the reference
        data = {k: v for k, v in data.items() if k != "reference_policy_logprobs"}
    loss, metrics = loss_fn(logits, data, torch.tensor(0.0), pairs)
    loss.backward()

    ref_logits = leaf(batch)

    def seq(b: int, policy: bool):
        total, n = 0.0, 0
        for t in range(1, S):
            if data["token_mask"][b, t]:
                if policy:
                    total = total + hand_lp(ref_logits, data["input_ids"], b, t)
                elif kind in REFERENCE_FREE:
                    pass
                else:
                    total = total + float(data["reference_policy_logprobs"][b, t])
                n += 1
        return total / n if average else total

    hand, accs, margins, rc, odds = 0.0, [], [], [], []
    for i in range(B // 2):
        c, r = 2 * i, 2 * i + 1
        if not (data["sample_mask"][c] and data["sample_mask"][r]):
            continue
        reward_c = beta * (seq(c, True) - seq(c, False))
        reward_r = beta * (seq(r, True) - seq(r, False))
        margin = reward_c - reward_r
        if kind == "orpo":
            pref, ratio = hand_orpo(seq(c, True), seq(r, True), beta)
            odds.append(ratio.item())
        else:
            pref = hand_preference(margin, beta, kind, eps)
        hand = hand + pref + sft_w * (-seq(c, True))
        accs.append(float(margin > 0))
        margins.append(margin.item())
        rc.append(reward_c.item())
    hand = hand / len(margins)
    hand.backward()
    assert loss.item() == pytest.approx(hand.item(), abs=1e-6)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)
    assert metrics["preference_accuracy"] == pytest.approx(sum(accs) / len(accs))
    assert metrics["reward_margin"] == pytest.approx(sum(margins) / len(margins), abs=1e-9)
    assert metrics["rewards_chosen_mean"] == pytest.approx(sum(rc) / len(rc), abs=1e-9)
    if kind == "orpo":
        assert metrics["log_odds_ratio"] == pytest.approx(sum(odds) / len(odds), abs=1e-6)
    else:
        assert "log_odds_ratio" not in metrics
    if masked_pair:  # the masked pair contributes no gradient
        assert logits.grad[2:].abs().sum() == 0


def test_bradley_terry_loss_and_grad():
    scores = torch.tensor([2.0, 0.5, -1.0, 0.3, 0.7, 0.7], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    pairs = count_valid_pairs(mask)
    loss, metrics = BradleyTerryLoss()(scores, {"sample_mask": mask}, torch.tensor(0.0), pairs)
    loss.backward()
    # hand: pairs (2.0, 0.5) and (-1.0, 0.3); the third is masked
    m1, m2 = 1.5, -1.3
    hand = (math.log(1 + math.exp(-m1)) + math.log(1 + math.exp(-m2))) / 2
    assert loss.item() == pytest.approx(hand, abs=1e-12)
    # d/ds_c of -logsigmoid(s_c - s_r) = -(1 - sigmoid(m)); divided by 2 pairs
    g1, g2 = -(1 - 1 / (1 + math.exp(-m1))) / 2, -(1 - 1 / (1 + math.exp(-m2))) / 2
    expected = torch.tensor([g1, -g1, g2, -g2, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(scores.grad, expected, atol=1e-12)
    assert metrics["accuracy"] == 0.5
    assert metrics["margin"] == pytest.approx((m1 + m2) / 2)
    assert metrics["num_valid_pairs"] == 2
