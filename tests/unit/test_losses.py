"""Loss functions against hand computations written out here (float64 loops over samples and
tokens, not calling the library's helpers), plus micro-batch invariance and clip behaviour.
The preference losses': test_preference_losses.py, on this module's batch."""

from __future__ import annotations

import math

import pytest
import torch

from tempering.losses import ClippedPGLoss, NLLLoss, kl_estimate, token_entropy, token_logprobs
from tempering.preference_losses import count_valid_pairs

B, S, V = 4, 7, 5


def hand_lp(logits: torch.Tensor, ids: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """log p(ids[b, t] | prefix) from the logits at position t - 1, written out."""
    row = logits[b, t - 1]
    norm = torch.log(sum(torch.exp(row[v]) for v in range(row.shape[0])))
    return row[ids[b, t]] - norm


def hand_entropy(logits: torch.Tensor, b: int, t: int) -> float:
    row = logits[b, t - 1].detach()
    z = sum(math.exp(float(x)) for x in row)
    return -sum((math.exp(float(x)) / z) * (float(x) - math.log(z)) for x in row)


def valid(data: dict, b: int, t: int) -> bool:
    return bool(data["token_mask"][b, t] * data["sample_mask"][b])


@pytest.fixture
def batch() -> dict:
    return make_batch()


def make_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    token_mask = torch.zeros(B, S)
    # prompt = first 2 tokens; response lengths differ; the rest is padding
    for b, end in enumerate([7, 5, 6, 4]):
        token_mask[b, 2:end] = 1
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    return {
        "input_ids": ids,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "logits": torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2,
        "noise": torch.rand(B, S, generator=g, dtype=torch.float64) * 1.6 - 0.8,
        "noise2": torch.rand(B, S, generator=g, dtype=torch.float64) * 0.6 - 0.3,
        "noise3": torch.rand(B, S, generator=g, dtype=torch.float64) * 0.6 - 0.3,
    }


def leaf(batch: dict) -> torch.Tensor:
    return batch["logits"].clone().requires_grad_(True)


def counts(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    toks = (data["token_mask"] * data["sample_mask"][:, None]).sum()
    return toks, data["sample_mask"].sum()


def test_token_logprobs_alignment_and_values(batch):
    logits = batch["logits"]
    lp = token_logprobs(logits, batch["input_ids"])
    assert lp.shape == (B, S)
    assert torch.all(lp[:, 0] == 0)
    for b in range(B):
        for t in range(1, S):
            assert lp[b, t].item() == pytest.approx(
                hand_lp(logits, batch["input_ids"], b, t).item(), abs=1e-12
            )
    # half precision is computed in fp32; huge logits stay finite
    big = (logits * 1e4).to(torch.bfloat16)
    lp_big = token_logprobs(big, batch["input_ids"])
    assert lp_big.dtype == torch.float32 and torch.isfinite(lp_big).all()


def test_token_logprobs_gradient_is_onehot_minus_softmax(batch):
    """The fused backward writes (onehot(next token) - softmax) x upstream grad at each scored
    position and nothing at the last one; checked against torch's gradcheck in float64 and, in
    bfloat16, against a float64 hand gradient (the returned grad keeps the logits' dtype)."""
    ids = batch["input_ids"]
    logits = batch["logits"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids), (logits,))
    weight = batch["noise"]
    half = batch["logits"].to(torch.bfloat16).requires_grad_()
    (token_logprobs(half, ids) * weight).sum().backward()
    assert half.grad.dtype == torch.bfloat16
    probs = torch.softmax(half.detach().double(), -1)
    for b in range(B):
        assert torch.all(half.grad[b, S - 1] == 0)  # the last position scores nothing
        for t in range(S - 1):
            expect = -probs[b, t] * weight[b, t + 1]
            expect[ids[b, t + 1]] += weight[b, t + 1]
            assert torch.allclose(half.grad[b, t].double(), expect, atol=1e-2, rtol=1e-2)


def test_token_entropy_with_mask_computes_only_masked_entries(batch):
    logits, mask = batch["logits"], batch["token_mask"]
    ent = token_entropy(logits, mask)
    whole = token_entropy(logits)
    for b in range(B):
        for t in range(1, S):
            assert whole[b, t].item() == pytest.approx(hand_entropy(logits, b, t), abs=1e-9)
            want = hand_entropy(logits, b, t) if mask[b, t] else 0.0
            assert ent[b, t].item() == pytest.approx(want, abs=1e-9)


def test_nll_loss_and_grad(batch):
    data = {k: batch[k] for k in ("input_ids", "token_mask", "sample_mask")}
    toks, seqs = counts(data)
    logits = leaf(batch)
    loss, metrics = NLLLoss()(logits, data, toks, seqs)
    loss.backward()

    ref_logits = leaf(batch)
    total, n = 0.0, 0
    for b in range(B):
        for t in range(1, S):
            if valid(data, b, t):
                total = total - hand_lp(ref_logits, data["input_ids"], b, t)
                n += 1
    hand = total / n
    hand.backward()
    assert n == 10 and metrics["num_valid_tokens"] == 10
    assert loss.item() == pytest.approx(hand.item(), abs=1e-6)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)
    assert metrics["loss"] == pytest.approx(hand.item(), abs=1e-6)


def pg_data(batch: dict) -> dict:
    ids = batch["input_ids"]
    curr = token_logprobs(batch["logits"], ids)
    prev = curr + batch["noise"]  # ratios exp(-noise) in [0.45, 2.2]: some clipped
    prev[:, 0] = 0
    return {
        "input_ids": ids,
        "token_mask": batch["token_mask"],
        "sample_mask": batch["sample_mask"],
        "advantages": torch.tensor([1.5, -0.7, 0.3, -2.0], dtype=torch.float64),
        "prev_logprobs": prev,
        "generation_logprobs": prev + batch["noise2"],
        "reference_policy_logprobs": curr + batch["noise3"],
    }


def hand_entropy_grad(logits: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """The entropy at (b, t), written out, differentiable."""
    row = logits[b, t - 1]
    norm = torch.log(sum(torch.exp(row[v]) for v in range(row.shape[0])))
    return -sum(torch.exp(row[v] - norm) * (row[v] - norm) for v in range(row.shape[0]))


DR_GRPO_L = 6  # Dr. GRPO's constant length (longer than every response of the batch)


def pg_loss(level: str, **kwargs) -> ClippedPGLoss:
    """A ClippedPGLoss reduced per `level`: token, sequence or dr_grpo (sequence-level with
    `length_normalizer`)."""
    return ClippedPGLoss(
        loss_type="token" if level == "token" else "sequence",
        length_normalizer=DR_GRPO_L if level == "dr_grpo" else None,
        **kwargs,
    )


def hand_pg(logits, data, lo, hi, c, beta, estimator, level, cap, use_is, ent_coeff=0.0,
            on_policy_kl=False):  # fmt: skip
    """Per-token clipped PG (importance-weighted with `use_is`) + KL (weighted by pi_theta /
    pi_generator with `on_policy_kl`) - the entropy bonus, reduced per `level` (dr_grpo: each
    sequence's sum over DR_GRPO_L, not its mean), all written out as scalar ops."""
    per_seq, total, n_tok, n_seq = [], 0.0, 0, 0
    for b in range(B):
        seq_sum, seq_n = 0.0, 0
        a = float(data["advantages"][b])
        for t in range(1, S):
            if not valid(data, b, t):
                continue
            lp = hand_lp(logits, data["input_ids"], b, t)
            prev = float(data["prev_logprobs"][b, t])
            ratio = torch.exp(lp - prev)
            clipped = torch.clamp(ratio, 1 - lo, 1 + hi)
            pg = torch.maximum(-a * ratio, -a * clipped)
            if c is not None and a < 0:
                pg = torch.minimum(pg, torch.tensor(-a * c, dtype=torch.float64))
            log_r = lp - float(data["reference_policy_logprobs"][b, t])
            if estimator == "k1":
                kl = log_r
            elif estimator == "k2":
                kl = 0.5 * log_r * log_r
            else:
                kl = torch.exp(-log_r) - 1 + log_r
            w = 1.0
            if use_is:
                w = math.exp(prev - float(data["generation_logprobs"][b, t]))
                if cap is not None:
                    w = min(w, cap)
            v = (
                math.exp(lp.item() - float(data["generation_logprobs"][b, t]))  # detached
                if on_policy_kl
                else 1.0
            )
            term = w * pg + beta * v * kl
            if ent_coeff:
                term = term - ent_coeff * hand_entropy_grad(logits, b, t)
            total = total + term
            seq_sum = seq_sum + term
            seq_n += 1
            n_tok += 1
        if seq_n:
            per_seq.append(seq_sum / (DR_GRPO_L if level == "dr_grpo" else seq_n))
            n_seq += 1
    if level == "token":
        return total / n_tok
    return sum(per_seq) / n_seq


@pytest.mark.parametrize(
    "level,estimator,c,use_is,cap,ent",
    [
        ("token", "k3", None, False, None, 0.0),
        ("token", "k1", 1.3, True, 1.2, 0.0),
        ("sequence", "k2", 1.3, True, None, 0.0),
        ("sequence", "k3", None, True, 1.1, 0.0),
        ("token", "k3", 1.3, True, 1.2, 0.3),  # with verl's entropy bonus
        ("sequence", "k1", None, False, None, 0.2),
        ("dr_grpo", "k3", 1.3, True, 1.2, 0.0),  # Dr. GRPO's constant length
        ("dr_grpo", "k2", None, False, None, 0.2),
    ],
)
@pytest.mark.parametrize("on_policy_kl", [False, True])
def test_clipped_pg_loss_and_grad(batch, level, estimator, c, use_is, cap, ent, on_policy_kl):
    data = pg_data(batch)
    toks, seqs = counts(data)
    loss_fn = pg_loss(
        level,
        use_on_policy_kl_approximation=on_policy_kl,
        ratio_clip_min=0.2,
        ratio_clip_max=0.28,
        ratio_clip_c=c,
        reference_policy_kl_penalty=0.05,
        kl_estimator=estimator,
        use_importance_sampling_correction=use_is,
        truncated_importance_sampling_type=None if cap is None else "tis",
        truncated_importance_sampling_ratio=cap,
        entropy_coeff=ent,
    )
    logits = leaf(batch)
    loss, metrics = loss_fn(logits, data, toks, seqs)
    loss.backward()

    ref_logits = leaf(batch)
    hand = hand_pg(ref_logits, data, 0.2, 0.28, c, 0.05, estimator, level, cap, use_is, ent,
                   on_policy_kl)  # fmt: skip
    hand.backward()
    if ent:  # the bonus is the difference from the loss without it, logged as such
        plain = hand_pg(leaf(batch), data, 0.2, 0.28, c, 0.05, estimator, level, cap, use_is,
                        on_policy_kl=on_policy_kl)  # fmt: skip
        assert metrics["entropy_bonus"] == pytest.approx(plain.item() - hand.item(), abs=1e-6)
        assert metrics["entropy_bonus"] > 0.01
    else:
        assert "entropy_bonus" not in metrics
    assert loss.item() == pytest.approx(hand.item(), abs=1e-6)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)
    assert logits.grad.abs().sum() > 0

    # metrics by hand over valid tokens
    vals = [(b, t) for b in range(B) for t in range(1, S) if valid(data, b, t)]
    curr = {bt: hand_lp(batch["logits"], data["input_ids"], *bt).item() for bt in vals}
    ratios = [math.exp(curr[bt] - float(data["prev_logprobs"][bt])) for bt in vals]
    err = [
        math.exp(abs(float(data["prev_logprobs"][bt]) - float(data["generation_logprobs"][bt])))
        for bt in vals
    ]
    clipped = [r < 0.8 or r > 1.28 for r in ratios]
    assert 0 < sum(clipped) < len(vals)  # the fixture really exercises clipping
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / len(vals), abs=1e-9)
    assert metrics["clip_fraction"] == pytest.approx(sum(clipped) / len(vals), abs=1e-9)
    assert metrics["token_mult_prob_error"] == pytest.approx(sum(err) / len(vals), abs=1e-9)
    ent = [hand_entropy(batch["logits"], *bt) for bt in vals]
    assert metrics["entropy"] == pytest.approx(sum(ent) / len(vals), abs=1e-9)
    assert metrics["num_valid_tokens"] == len(vals)


def test_clipped_pg_without_prev_logprobs_is_on_policy(batch):
    """No ``prev_logprobs``: the behaviour policy is the current one (GRPO's one optimizer step
    per rollout batch). Same loss and gradient as passing the current log-probs, computed
    independently and detached, as ``prev_logprobs``; ratio exactly 1, nothing clipped."""
    data = pg_data(batch)
    toks, seqs = counts(data)
    loss_fn = ClippedPGLoss(
        ratio_clip_min=0.2, ratio_clip_max=0.28, reference_policy_kl_penalty=0.05
    )
    explicit = dict(data, prev_logprobs=token_logprobs(batch["logits"], data["input_ids"]))
    ref_logits = leaf(batch)
    want, _ = loss_fn(ref_logits, explicit, toks, seqs)
    want.backward()

    implicit = {k: v for k, v in data.items() if k != "prev_logprobs"}
    logits = leaf(batch)
    loss, metrics = loss_fn(logits, implicit, toks, seqs)
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-9)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-9)
    assert logits.grad.abs().sum() > 0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["clip_fraction"] == 0.0


def test_kl_estimators_hand_worked():
    # pi = 0.5, pi_ref = 0.25 -> log r = ln 2
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + 0.693147, abs=1e-6)
    # swapped: log r = -ln 2; k3 = 2 - 1 - ln 2 = 0.306853 (k3 >= 0 both ways, k1 is not)
    assert kl_estimate(ref, lp, "k1").item() == pytest.approx(-0.693147, abs=1e-6)
    assert kl_estimate(ref, lp, "k3").item() == pytest.approx(0.306853, abs=1e-6)
    assert kl_estimate(lp, lp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")
    # NeMo RL's clamps: log r = -30 (the reference finds the token e^30 times as likely)
    far = torch.tensor([-30.0])
    assert kl_estimate(far, torch.zeros(1), "k3").item() == pytest.approx(math.exp(30) - 31)
    assert kl_estimate(far, torch.zeros(1), "k1", input_clamp=20.0).item() == -20.0
    k3 = kl_estimate(far, torch.zeros(1), "k3", input_clamp=20.0, output_clamp=10.0)
    assert k3.item() == 10.0  # exp(20) - 21 clamped to 10
    near = kl_estimate(lp, ref, "k3", input_clamp=20.0, output_clamp=10.0)
    assert near.item() == pytest.approx(0.5 - 1 + 0.693147, abs=1e-6)  # inside: unchanged


def test_the_kl_penalty_is_bounded_and_read_only_with_a_penalty(batch):
    """A token the reference all but rules out costs at most the output clamp, with no
    gradient past it (NeMo RL's defaults, 20 and 10); the KL options are refused without
    a penalty."""
    data = pg_data(batch)
    data["reference_policy_logprobs"] = data["reference_policy_logprobs"] - 40.0  # log r ~ 40
    toks, seqs = counts(data)
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1)
    logits = leaf(batch)
    loss, metrics = loss_fn(logits, data, toks, seqs)
    assert metrics["kl_penalty"] == pytest.approx(0.1 * 10)  # k3 at log r = 20: 19, then 10
    loss.backward()
    plain = leaf(batch)
    ClippedPGLoss()(plain, data, toks, seqs)[0].backward()
    assert torch.equal(logits.grad, plain.grad)  # saturated: the penalty pulls no further
    unclamped = ClippedPGLoss(reference_policy_kl_penalty=0.1, kl_input_clamp_value=None,
                              kl_output_clamp_value=None)  # fmt: skip
    assert unclamped(leaf(batch), data, toks, seqs)[1]["kl_penalty"] > 3.5  # ~0.1 * 40
    for option in ({"use_on_policy_kl_approximation": True}, {"kl_input_clamp_value": 5.0},
                   {"kl_output_clamp_value": None}):  # fmt: skip
        with pytest.raises(ValueError, match="is read only with a KL penalty"):
            ClippedPGLoss(**option)
    with pytest.raises(ValueError, match="kl_output_clamp_value=0.0 must be > 0"):
        ClippedPGLoss(reference_policy_kl_penalty=0.1, kl_output_clamp_value=0.0)


def one_token_case(ratio: float, advantage: float, **loss_kwargs) -> tuple[float, float]:
    """One sample, one response token with a chosen ratio; returns (loss, |dloss/dlogits|)."""
    logits = torch.tensor([[[0.3, -0.4], [0.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 0]])
    curr = token_logprobs(logits.detach(), ids)[0, 1].item()
    prev = torch.tensor([[0.0, curr - math.log(ratio)]], dtype=torch.float64)
    data = {
        "input_ids": ids,
        "token_mask": torch.tensor([[0.0, 1.0]]),
        "sample_mask": torch.tensor([1.0]),
        "advantages": torch.tensor([advantage], dtype=torch.float64),
        "prev_logprobs": prev,
        "generation_logprobs": prev.clone(),
    }
    loss, _ = ClippedPGLoss(**loss_kwargs)(logits, data, torch.tensor(1.0), torch.tensor(1.0))
    loss.backward()
    return loss.item(), logits.grad.abs().sum().item()


def test_clip_behaviour_hand_picked():
    sym = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2}
    # A > 0, ratio 1.5: clipped to 1.2 -> loss -1.2, no gradient
    loss, grad = one_token_case(1.5, 1.0, **sym)
    assert loss == pytest.approx(-1.2) and grad == 0
    # A < 0, ratio 1.5: pessimistic branch keeps the unclipped ratio -> 1.5, gradient flows
    loss, grad = one_token_case(1.5, -1.0, **sym)
    assert loss == pytest.approx(1.5) and grad > 0
    # A > 0, ratio 0.5: unclipped -> -0.5, gradient flows
    loss, grad = one_token_case(0.5, 1.0, **sym)
    assert loss == pytest.approx(-0.5) and grad > 0
    # A < 0, ratio 0.5: clipped at 0.8 -> 0.8, no gradient
    loss, grad = one_token_case(0.5, -1.0, **sym)
    assert loss == pytest.approx(0.8) and grad == 0
    # clip-higher (DAPO): ratio 1.25 is inside [0.8, 1.28]
    loss, grad = one_token_case(1.25, 1.0, ratio_clip_min=0.2, ratio_clip_max=0.28)
    assert loss == pytest.approx(-1.25) and grad > 0
    # dual clip: A = -1, ratio 4 -> min(max(4, 1.2), 3) = 3, no gradient; without it: 4
    loss, grad = one_token_case(4.0, -1.0, ratio_clip_c=3.0, **sym)
    assert loss == pytest.approx(3.0) and grad == 0
    loss, grad = one_token_case(4.0, -1.0, **sym)
    assert loss == pytest.approx(4.0) and grad > 0
    # dual clip never touches positive advantages
    loss, _ = one_token_case(4.0, 1.0, ratio_clip_c=3.0, **sym)
    assert loss == pytest.approx(-1.2)


def test_dr_grpo_weighs_a_token_alike_in_long_and_short_answers():
    """The point of Dr. GRPO's constant: with the sequence mean, a token of a 2-token answer
    pulls 5/2 as hard as one of a 5-token answer with the same advantage (the length bias the
    paper removes); divided by a constant, they pull alike."""
    ids = torch.ones(2, 7, dtype=torch.long)
    token_mask = torch.zeros(2, 7)
    token_mask[0, 2:7], token_mask[1, 2:4] = 1, 1  # 5 tokens, 2 tokens
    data = {"input_ids": ids, "token_mask": token_mask, "sample_mask": torch.ones(2),
            "advantages": torch.tensor([1.0, 1.0], dtype=torch.float64)}  # fmt: skip
    data["generation_logprobs"] = torch.zeros(2, 7, dtype=torch.float64)
    pulls = {}
    for level in ("sequence", "dr_grpo"):
        logits = torch.zeros(2, 7, V, dtype=torch.float64, requires_grad=True)  # alike everywhere
        loss, _ = pg_loss(level)(logits, data, token_mask.sum(), torch.tensor(2.0))
        loss.backward()
        short, long = logits.grad[1, 1, 1], logits.grad[0, 1, 1]  # the first answer token's
        assert short < 0 and long < 0  # both pulled up
        pulls[level] = float(short / long)
    assert pulls["sequence"] == pytest.approx(5 / 2)
    assert pulls["dr_grpo"] == pytest.approx(1.0)


@pytest.mark.parametrize("level", ["token", "sequence", "dr_grpo"])
def test_microbatch_invariance(batch, level):
    data = pg_data(batch)
    toks, seqs = counts(data)
    loss_fn = pg_loss(
        level, ratio_clip_c=1.5, reference_policy_kl_penalty=0.1,
        use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
    )  # fmt: skip
    full_logits = leaf(batch)
    full, _ = loss_fn(full_logits, data, toks, seqs)
    full.backward()

    mb_logits = leaf(batch)
    total = 0.0
    for lo, hi in [(0, 1), (1, 4)]:
        part = {k: v[lo:hi] for k, v in data.items()}
        loss, _ = loss_fn(mb_logits[lo:hi], part, toks, seqs)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), abs=1e-10)
    assert torch.allclose(mb_logits.grad, full_logits.grad, atol=1e-10)

    # the same for NLL
    nll_full_logits, nll_mb_logits = leaf(batch), leaf(batch)
    full, _ = NLLLoss()(nll_full_logits, data, toks, seqs)
    full.backward()
    total = 0.0
    for lo, hi in [(0, 3), (3, 4)]:
        part = {k: v[lo:hi] for k, v in data.items()}
        loss, _ = NLLLoss()(nll_mb_logits[lo:hi], part, toks, seqs)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), abs=1e-10)
    assert torch.allclose(nll_mb_logits.grad, nll_full_logits.grad, atol=1e-10)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="ratio_clip_c=0.5"):
        ClippedPGLoss(ratio_clip_c=0.5)
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        ClippedPGLoss(temperature=0.0)
    with pytest.raises(ValueError, match="entropy_coeff=-0.1 must be >= 0"):
        ClippedPGLoss(entropy_coeff=-0.1)
    with pytest.raises(ValueError, match="even"):
        count_valid_pairs(torch.ones(3))
    with pytest.raises(KeyError, match="token_mask"):
        NLLLoss()(torch.zeros(1, 2, 3), {"input_ids": torch.zeros(1, 2, dtype=torch.long)}, 1, 1)


# --------------------------------------------------------------------------------------------
# Off-policy correction (truncated importance sampling) and GSPO, on hand-worked numbers.
#
# Three sequences with zero logits over a 2-token vocabulary, so every current log-prob is
# exactly ln 0.5. Each test picks per-token log ratios d = curr - prev (the PPO ratio is
# exp(d)) and importance weights w = exp(prev - gen) by choosing prev and gen; the expected
# numbers below are worked out by hand from those.
# --------------------------------------------------------------------------------------------

OP_B, OP_S = 3, 4
OP_ADV = [1.0, -2.0, 0.5]
OP_MASK = [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1]]  # 8 valid tokens; sequence 1 has 2
OP_W = [[0.5, 1.0, 4.0], [1.2, 0.9], [3.0, 3.0, 1.0]]  # w on each sequence's valid tokens


def op_case(log_ratios: list[list[float]], weights: list[list[float]]) -> tuple[torch.Tensor, dict]:
    """(zero logits [3, 4, 2] as a leaf, the loss data) for the chosen ratios and weights."""
    half = math.log(0.5)
    prev = torch.zeros(OP_B, OP_S, dtype=torch.float64)
    gen = torch.zeros(OP_B, OP_S, dtype=torch.float64)
    for b in range(OP_B):
        for i, (d, w) in enumerate(zip(log_ratios[b], weights[b], strict=True)):
            prev[b, i + 1] = half - d
            gen[b, i + 1] = prev[b, i + 1] - math.log(w)
    data = {
        "input_ids": torch.ones(OP_B, OP_S, dtype=torch.long),
        "token_mask": torch.tensor(OP_MASK, dtype=torch.float64),
        "sample_mask": torch.ones(OP_B, dtype=torch.float64),
        "advantages": torch.tensor(OP_ADV, dtype=torch.float64),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
    }
    return torch.zeros(OP_B, OP_S, 2, dtype=torch.float64, requires_grad=True), data


def on_ratio_one() -> list[list[float]]:
    return [[0.0] * len(row) for row in OP_W]


def plain_loss(kept: list[list[float]], level: str) -> float:
    """Ratio 1 everywhere, so each token's term is -A * w (plain Python)."""
    terms = [[-OP_ADV[b] * w for w in row] for b, row in enumerate(kept)]
    if level == "token":
        return sum(sum(row) for row in terms) / 8
    return sum(sum(row) / len(row) for row in terms) / 3


# kind, lo, hi -> the weights each valid token keeps, the loss (token level), is_oob_ratio
IS_CASES = {
    # clamp to [0.8, 2]: 0.5 -> 0.8, 4 -> 2, 3 -> 2; 4 of 8 tokens were outside
    "tis": ("tis", 0.8, 2.0, [[0.8, 1.0, 2.0], [1.2, 0.9], [2.0, 2.0, 1.0]], -0.2625, 4 / 8),
    # tis without a lower bound clamps to [0, 2]: only 4, 3, 3 are outside
    "tis-no-min": ("tis", None, 2.0, [[0.5, 1.0, 2.0], [1.2, 0.9], [2.0, 2.0, 1.0]], -0.225, 3 / 8),
    # icepop zeroes the tokens outside [0.8, 2]
    "icepop": ("icepop", 0.8, 2.0, [[0.0, 1.0, 0.0], [1.2, 0.9], [0.0, 0.0, 1.0]], 0.3375, 4 / 8),
    # seq-mask-tis: geometric means (0.5*1*4)^(1/3) = 1.26, (1.2*0.9)^(1/2) = 1.039 are inside
    # [0.8, 2], 9^(1/3) = 2.08 is not: sequence 2 goes, the others keep their raw weights
    "seq-mask": ("seq-mask-tis", 0.8, 2.0, [[0.5, 1, 4], [1.2, 0.9], [0, 0, 0]], -0.1625, 1 / 3),
    # no type: the raw weights
    "none": (None, None, None, [[0.5, 1.0, 4.0], [1.2, 0.9], [3.0, 3.0, 1.0]], -0.6, None),
}


@pytest.mark.parametrize("case", sorted(IS_CASES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_importance_sampling_hand_worked(case, level):
    kind, lo, hi, kept, token_loss, oob = IS_CASES[case]
    assert plain_loss(kept, "token") == pytest.approx(token_loss)  # the table is consistent
    loss_fn = ClippedPGLoss(
        loss_type=level,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type=kind,
        truncated_importance_sampling_ratio=hi,
        truncated_importance_sampling_ratio_min=lo,
    )
    logits, data = op_case(on_ratio_one(), OP_W)
    loss, metrics = loss_fn(logits, data, torch.tensor(8.0), torch.tensor(3.0))
    loss.backward()
    assert loss.item() == pytest.approx(plain_loss(kept, level), abs=1e-12)
    # ratio 1 is inside the clip range, so d loss / d curr[b, t] = -A_b * w / N, and the logits
    # that scored token 1 get that times (onehot(1) - softmax) = (-0.5, +0.5)
    count = 8 if level == "token" else 3
    for b, row in enumerate(kept):
        for i, w in enumerate(row):
            n = 1 if level == "token" else len(row)
            g = -OP_ADV[b] * w / (count * n)
            assert logits.grad[b, i].tolist() == pytest.approx([-0.5 * g, 0.5 * g], abs=1e-12)
    assert metrics["is_weight_mean"] == pytest.approx(sum(map(sum, kept)) / 8, abs=1e-12)
    if oob is None:
        assert "is_oob_ratio" not in metrics
    else:
        assert metrics["is_oob_ratio"] == pytest.approx(oob, abs=1e-12)
    # mismatch metrics over the 8 raw weights: exp(|ln w|) and k3 of KL(gen || trainer),
    # with log r = gen - prev = -ln w: exp(ln w) - 1 - ln w = w - 1 - ln w
    raw = [w for row in OP_W for w in row]
    assert metrics["token_mult_prob_error"] == pytest.approx(
        sum(max(w, 1 / w) for w in raw) / 8, abs=1e-12
    )
    assert metrics["gen_kl_error"] == pytest.approx(
        sum(w - 1 - math.log(w) for w in raw) / 8, abs=1e-12
    )


def test_gen_kl_error_follows_the_kl_estimator():
    """k1 of KL(gen || trainer) is mean(gen - prev) = mean(-ln w); without the correction the
    weights are 1 but the mismatch metrics are still reported."""
    logits, data = op_case(on_ratio_one(), OP_W)
    loss_fn = ClippedPGLoss(kl_estimator="k1")
    _, metrics = loss_fn(logits, data, torch.tensor(8.0), torch.tensor(3.0))
    raw = [w for row in OP_W for w in row]
    assert metrics["gen_kl_error"] == pytest.approx(-sum(map(math.log, raw)) / 8, abs=1e-12)
    assert metrics["is_weight_mean"] == 1.0 and "is_oob_ratio" not in metrics


GSPO_D = [[0.1, 0.2, 0.3], [-0.1, 0.0], [0.5, -0.5, 0.3]]  # log ratios; means 0.2, -0.05, 0.1


def test_gspo_sequence_ratio_hand_worked():
    """GSPO: one ratio per sequence, s = exp(mean log ratio) = e^0.2, e^-0.05, e^0.1, clipped
    to [0.8, 1.2]: sequence 0 (A = 1, s = 1.2214) is clipped at 1.2 and gets no gradient; the
    others are inside. Per-token PPO would clip sequence 2's first token (e^0.5 = 1.65)."""
    s = [math.exp(0.2), math.exp(-0.05), math.exp(0.1)]
    pg = [-1.2, 2.0 * s[1], -0.5 * s[2]]  # max(-A s, -A clip(s)) per sequence
    want = sum(pg) / 3
    assert want == pytest.approx((-1.2 + 1.9024588 - 0.5525855) / 3, abs=1e-6)
    loss_fn = ClippedPGLoss(loss_type="sequence", sequence_level_importance_ratios=True)
    logits, data = op_case(GSPO_D, [[1.0] * len(r) for r in OP_W])
    loss, metrics = loss_fn(logits, data, torch.tensor(8.0), torch.tensor(3.0))
    loss.backward()
    assert loss.item() == pytest.approx(want, abs=1e-12)
    # d loss / d curr[b, t] = (1/3) * (-A_b) * s_b / n_b on each of the n_b valid tokens of an
    # unclipped sequence (the gradient of exp(mean) spreads evenly), 0 for the clipped one
    for b, row in enumerate(GSPO_D):
        for i in range(len(row)):
            g = 0.0 if b == 0 else -OP_ADV[b] * s[b] / (3 * len(row))
            assert logits.grad[b, i].tolist() == pytest.approx([-0.5 * g, 0.5 * g], abs=1e-12)
    assert metrics["clip_fraction"] == pytest.approx(3 / 8)  # sequence 0's three tokens
    assert metrics["ratio_mean"] == pytest.approx((3 * s[0] + 2 * s[1] + 3 * s[2]) / 8)


def hand_gspo(logits, data, lo, hi, beta, tis):
    """GSPO written out per sequence: s = exp(mean_t(curr - prev)), pg = max(-A s, -A clip(s)),
    w = clamp(exp(sum_t(prev - gen)), tis) (1 without tis), term = w * pg + beta * the mean
    over tokens of k3 (the importance weight is the policy-gradient term's alone)."""
    terms, outside, n_tok = [], 0, 0
    for b in range(B):
        toks = [t for t in range(1, S) if valid(data, b, t)]
        if not toks:
            continue
        a = float(data["advantages"][b])
        curr = [hand_lp(logits, data["input_ids"], b, t) for t in toks]
        prev = [float(data["prev_logprobs"][b, t]) for t in toks]
        gen = [float(data["generation_logprobs"][b, t]) for t in toks]
        s = torch.exp(sum(c - p for c, p in zip(curr, prev, strict=True)) / len(toks))
        pg = torch.maximum(-a * s, -a * torch.clamp(s, 1 - lo, 1 + hi))
        w = 1.0  # without the correction
        if tis is not None:
            w = math.exp(sum(p - g for p, g in zip(prev, gen, strict=True)))
            outside += len(toks) * (not tis[0] <= w <= tis[1])
            w = min(max(w, tis[0]), tis[1])
        kl = 0.0
        for c, t in zip(curr, toks, strict=True):
            log_r = c - float(data["reference_policy_logprobs"][b, t])
            kl = kl + torch.exp(-log_r) - 1 + log_r
        terms.append(w * pg + beta * kl / len(toks))
        n_tok += len(toks)
    return sum(terms) / len(terms), outside / n_tok


@pytest.mark.parametrize("tis", [None, (0.7, 1.3)])
def test_gspo_loss_and_grad_match_an_independent_formula(batch, tis):
    data = pg_data(batch)
    toks, seqs = counts(data)
    loss_fn = ClippedPGLoss(
        ratio_clip_min=0.1, ratio_clip_max=0.15, reference_policy_kl_penalty=0.05,
        loss_type="sequence", sequence_level_importance_ratios=True,
        use_importance_sampling_correction=tis is not None,
        truncated_importance_sampling_type=None if tis is None else "tis",
        truncated_importance_sampling_ratio_min=None if tis is None else tis[0],
        truncated_importance_sampling_ratio=None if tis is None else tis[1],
    )  # fmt: skip
    logits = leaf(batch)
    loss, metrics = loss_fn(logits, data, toks, seqs)
    loss.backward()
    ref_logits = leaf(batch)
    hand, oob = hand_gspo(ref_logits, data, 0.1, 0.15, 0.05, tis)
    hand.backward()
    assert loss.item() == pytest.approx(hand.item(), abs=1e-9)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-9)
    assert logits.grad.abs().sum() > 0
    assert 0 < metrics["clip_fraction"] < 1  # the fixture clips some sequences, not all
    if tis is not None:
        assert 0 < oob < 1  # and truncates some sequence weights, not all
        assert metrics["is_oob_ratio"] == pytest.approx(oob, abs=1e-12)


def test_off_policy_metrics_aggregate_across_micro_batches():
    """The trainer folds micro-batch metrics weighted by valid tokens, so the token-level ones
    (gen_kl_error, is_oob_ratio for icepop) over two micro-batches equal the whole batch's;
    every key reaches the step's metrics (prefixed ``train/``) unchanged."""
    from tempering.models.policy.training import aggregate_loss_metrics

    loss_fn = ClippedPGLoss(
        use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=0.8,
    )  # fmt: skip
    logits, data = op_case(on_ratio_one(), OP_W)
    _, whole = loss_fn(logits, data, torch.tensor(8.0), torch.tensor(3.0))
    parts = [
        loss_fn(logits[lo:hi], {k: v[lo:hi] for k, v in data.items()}, 8.0, 3.0)[1]
        for lo, hi in [(0, 1), (1, 3)]
    ]
    folded = aggregate_loss_metrics(parts)
    for key in ("gen_kl_error", "is_oob_ratio", "token_mult_prob_error", "is_weight_mean"):
        assert folded[key] == pytest.approx(whole[key], abs=1e-12), key
    assert folded["loss"] == pytest.approx(whole["loss"], abs=1e-12)


# options -> a phrase the refusal must contain (each a combination NeMo RL refuses too)
REFUSED = [
    ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
     "apply only with use_importance_sampling_correction=true"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0},
     "truncated_importance_sampling_ratio=2.0 is read only with a truncated_importance_sampling_type"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"},
     "needs truncated_importance_sampling_ratio > 0"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
      "truncated_importance_sampling_ratio": 5.0},
     "'icepop' needs truncated_importance_sampling_ratio_min"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
      "truncated_importance_sampling_ratio": 2.0, "truncated_importance_sampling_ratio_min": 3.0},
     "truncated_importance_sampling_ratio_min=3.0 must be >= 0 and <="),
    ({"use_importance_sampling_correction": True, "token_level_loss": False,
      "truncated_importance_sampling_type": "seq-mask-tis", "sequence_level_importance_ratios": True,
      "truncated_importance_sampling_ratio": 1.002, "truncated_importance_sampling_ratio_min": 0.999},
     "'seq-mask-tis' masks sequences but keeps per-token weights"),
    ({"sequence_level_importance_ratios": True},
     "sequence_level_importance_ratios=true (GSPO) needs the sequence-level loss"),
    ({"use_on_policy_kl_approximation": True},
     "use_on_policy_kl_approximation=True is read only with a KL penalty"),
    ({"length_normalizer": 512},
     "length_normalizer=512 (Dr. GRPO) divides each sequence's token sum in the sequence-level "
     "loss: set token_level_loss=false"),
]  # fmt: skip


@pytest.mark.parametrize("options,phrase", REFUSED)
def test_off_policy_refusals_at_construction_and_config_load(options, phrase):
    from pathlib import Path

    from tempering.config import ConfigError, GRPOMasterConfig, load_config

    kwargs = {k: v for k, v in options.items() if k != "token_level_loss"}
    level = "token" if options.get("token_level_loss", True) else "sequence"
    with pytest.raises(ValueError) as info:
        ClippedPGLoss(loss_type=level, **kwargs)
    assert phrase in str(info.value)

    yaml = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny.yaml"
    overrides = [f"loss_fn.{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in options.items()]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_config(yaml, overrides, schema=GRPOMasterConfig)
    assert phrase in str(info.value) and "loss_fn" in str(info.value)


def test_unknown_truncation_type_is_refused():
    with pytest.raises(ValueError, match="truncated_importance_sampling_type='clip' is unknown"):
        ClippedPGLoss(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="clip",
            truncated_importance_sampling_ratio=2.0,
        )


def test_grpo_builds_the_loss_with_every_off_policy_key():
    """make_loss reads each loss_fn key into the loss (a key no code reads would be a bug)."""
    from pathlib import Path

    from tempering.algorithms.grpo import make_loss
    from tempering.config import GRPOMasterConfig, load_config

    yaml = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny.yaml"
    cfg, _ = load_config(yaml, [
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_type=icepop",
        "loss_fn.truncated_importance_sampling_ratio=5.0",
        "loss_fn.truncated_importance_sampling_ratio_min=0.5",
        "loss_fn.sequence_level_importance_ratios=true",
        "loss_fn.token_level_loss=false",
        "loss_fn.length_normalizer=8",
        "loss_fn.reference_policy_kl_penalty=0.01",
        "loss_fn.use_on_policy_kl_approximation=true",
        "loss_fn.kl_input_clamp_value=15",
        "loss_fn.kl_output_clamp_value=null",
    ], schema=GRPOMasterConfig)  # fmt: skip
    loss = make_loss(cfg)
    assert loss.use_importance_sampling_correction is True
    assert loss.truncated_importance_sampling_type == "icepop"
    assert loss.truncated_importance_sampling_ratio == 5.0
    assert loss.truncated_importance_sampling_ratio_min == 0.5
    assert loss.sequence_level_importance_ratios is True
    assert loss.loss_type == "sequence"
    assert loss.length_normalizer == 8
    assert loss.use_on_policy_kl_approximation is True
    assert loss.kl_clamps == (15.0, None)
