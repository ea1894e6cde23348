"""PPO's critic pieces (fast tier): GAE against a plain recursion, whitening, the clipped
value loss against its formula and gradient, the value head's layout, and what the config
refuses. The loop with a learning critic is tests/functional/test_ppo_learning.py."""

from __future__ import annotations

import pytest
import torch

from tempering.algorithms.advantages import gae_advantages, whiten
from tempering.losses import ValueLoss


def _reference_gae(reward, values, mask, gamma, lam):
    """One row by the textbook recursion over its generated tokens only."""
    idx = [t for t in range(len(mask)) if mask[t]]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    next_v = next_a = 0.0
    for i in reversed(range(len(idx))):
        t = idx[i]
        r = reward if i == len(idx) - 1 else 0.0
        delta = r + gamma * next_v - values[t]
        a = delta + gamma * lam * next_a
        adv[t], ret[t] = a, a + values[t]
        next_v, next_a = values[t], a
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.0)])
def test_gae_matches_the_recursion_over_generated_tokens(gamma, lam):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = torch.zeros(4, 9)
    mask[0, 3:8] = 1  # one turn
    mask[1, 2:4] = 1
    mask[1, 6:9] = 1  # two turns with a tool reply between: one trajectory
    mask[2, 8] = 1  # one token
    rewards = torch.tensor([1.0, 0.5, -1.0, 2.0], dtype=torch.float64)  # row 3: no tokens
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    for b in range(4):
        want_a, want_r = _reference_gae(float(rewards[b]), values[b].tolist(), mask[b], gamma, lam)
        torch.testing.assert_close(adv[b], torch.tensor(want_a, dtype=torch.float64))
        torch.testing.assert_close(ret[b], torch.tensor(want_r, dtype=torch.float64))
    assert adv[3].abs().sum() == 0 and ret[3].abs().sum() == 0


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value():
    values = torch.tensor([[0.0, 0.2, 0.4, 0.9]])
    mask = torch.tensor([[0, 1, 1, 1]])
    adv, ret = gae_advantages(torch.tensor([1.0]), values, mask)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.8, 0.6, 0.1]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0]]))


def test_whiten_over_the_masked_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    w = whiten(x, mask)
    on = mask.bool()
    assert abs(float(w[on].mean())) < 1e-6
    assert abs(float(w[on].var(unbiased=False)) - 1) < 1e-4
    assert (w[~on] == 0).all()


def _data(returns, prev, mask):
    return {"returns": returns, "prev_values": prev, "token_mask": mask,
            "sample_mask": torch.ones(mask.shape[0])}  # fmt: skip


def test_value_loss_is_the_clipped_squared_error():
    values = torch.tensor([[0.0, 0.5, 1.0, -0.4]], requires_grad=True)
    prev = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[0, 1, 1, 1]])
    loss, m = ValueLoss(value_clip=0.2)(values, _data(returns, prev, mask), 3, 1)
    # token 1: unclipped (0.5-1)^2=0.25, clipped (0.2-1)^2=0.64 -> 0.64 (clipped larger)
    # token 2: 0 vs (0.2-1)^2=0.64 -> 0.64; token 3: (-1.4)^2=1.96 vs (-0.2-1)^2=1.44 -> 1.96
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.64 + 1.96) / 3)
    assert m["value_clip_fraction"] == pytest.approx(2 / 3) and m["num_valid_tokens"] == 3
    loss.backward()
    # the clipped terms give no gradient (their value is clamped); token 3's does
    assert values.grad[0].tolist() == pytest.approx([0, 0, 0, 0.5 * 2 * (-1.4) / 3])
    unclipped, _ = ValueLoss(value_clip=None)(values, _data(returns, prev, mask), 3, 1)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 0.0 + 1.96) / 3)


def test_a_value_inside_the_clip_is_never_counted_clipped():
    """Inside the clip ``old + (v - old)`` is ``v`` only up to rounding (here 4.7e-10 below
    it, which made the clipped term the larger): neither counted as clipped nor taken, so the
    fraction cannot flip on a last-bit difference between two runs."""
    values = torch.tensor([[0.0, 0.007715140003710985]], requires_grad=True)
    prev = torch.tensor([[0.0, 0.03156883642077446]])
    returns = torch.tensor([[0.0, 0.12487322092056274]])
    mask = torch.tensor([[0, 1]])
    rounded = prev[0, 1] + (values[0, 1] - prev[0, 1]).clamp(-0.2, 0.2)
    assert (rounded - returns[0, 1]) ** 2 > (values[0, 1] - returns[0, 1]) ** 2  # the trap
    loss, m = ValueLoss(value_clip=0.2)(values, _data(returns, prev, mask), 1, 1)
    assert m["value_clip_fraction"] == 0
    assert loss.item() == 0.5 * ((values[0, 1] - returns[0, 1]) ** 2).item()


def test_config_refuses_what_a_critic_would_not_read():
    from pydantic import ValidationError

    from tempering.config.schemas import GRPOMasterConfig

    ok = GRPOMasterConfig(critic={"enabled": True}, grpo={"use_leave_one_out_baseline": False})
    assert ok.critic.enabled and ok.critic.value_clip == 0.2
    with pytest.raises(ValidationError, match="use_leave_one_out_baseline=true would not be read"):
        GRPOMasterConfig(critic={"enabled": True})
    with pytest.raises(ValidationError, match="use_dynamic_sampling"):
        GRPOMasterConfig(critic={"enabled": True}, grpo={
            "use_leave_one_out_baseline": False, "use_dynamic_sampling": True})  # fmt: skip
    packed = GRPOMasterConfig(critic={"enabled": True}, policy={"sequence_packing": {
        "enabled": True}}, grpo={"use_leave_one_out_baseline": False})  # fmt: skip
    assert packed.policy.sequence_packing.enabled  # the critic packs as the policy does
    with pytest.raises(ValidationError, match="critic.learning_rate is read only by PPO"):
        GRPOMasterConfig(critic={"learning_rate": 1e-3})  # not enabled: nothing reads it
    with pytest.raises(ValidationError, match="critic.bogus|bogus"):
        GRPOMasterConfig(critic={"enabled": True, "bogus": 1})
    with pytest.raises(ValidationError, match="critic.warmup_steps=200 leaves no step"):
        GRPOMasterConfig(critic={"enabled": True, "warmup_steps": 200},
                         grpo={"use_leave_one_out_baseline": False, "max_num_steps": 200})  # fmt: skip


def test_the_warm_up_counts_the_loop_steps_it_holds_the_policy_for():
    from tempering.algorithms.ppo_critic import warming_up
    from tempering.config.schemas import GRPOMasterConfig

    cfg = GRPOMasterConfig(critic={"enabled": True, "warmup_steps": 2},
                           grpo={"use_leave_one_out_baseline": False})  # fmt: skip
    assert [warming_up(cfg, step) for step in (1, 2, 3)] == [True, True, False]
    assert not warming_up(cfg, None)  # a direct grpo_step call trains the policy
    assert not warming_up(GRPOMasterConfig(), 1)  # GRPO: no critic, no warm-up


def test_the_value_head_reads_each_token_at_the_position_before_it():
    from tempering.models.policy.microbatching import ForwardPass

    class Model(torch.nn.Module):  # a token classifier whose value at position p is p + 1
        def forward(self, input_ids, attention_mask, **kwargs):
            out = torch.arange(1.0, input_ids.shape[1] + 1).expand(input_ids.shape[0], -1)
            return type("Out", (), {"logits": out[..., None]})()

    fp = ForwardPass("value", torch.device("cpu"), None, None)
    mb = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "input_lengths": torch.tensor([4, 3])}
    values = fp.logits(Model(), mb)
    assert values.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]  # token t's value from t - 1


def test_the_lr_schedule_spans_the_run_when_a_step_takes_several_optimizer_steps(monkeypatch):
    """A GRPO step of 256 samples in global batches of 64 is 4 optimizer steps: the worker's
    cosine schedule must count 4 x max_num_steps of them (it counted max_num_steps, so the lr
    hit its floor a quarter of the way through the run)."""
    from tempering.algorithms import common
    from tempering.config.schemas import GRPOMasterConfig
    from tempering.models.policy import lm_policy

    seen = {}
    monkeypatch.setattr(lm_policy, "build_policy", lambda cluster, path, **kw: seen.update(kw))
    cfg = GRPOMasterConfig(
        grpo={"num_prompts_per_step": 32, "num_generations_per_prompt": 8, "max_num_steps": 50},
        policy={"train_global_batch_size": 64, "train_micro_batch_size": 64,
                "scheduler": {"name": "cosine", "warmup_steps": 5}},
    )  # fmt: skip
    common.build_policy_from_config(cfg.policy, None, total_steps=50,
                                    samples_per_step=32 * 8)  # fmt: skip
    assert (seen["total_steps"], seen["warmup_steps"]) == (200, 20)  # 4 optimizer steps a step
    common.build_policy_from_config(cfg.policy, None, total_steps=50)  # SFT, DPO: one a step
    assert (seen["total_steps"], seen["warmup_steps"]) == (50, 5)


@pytest.fixture
def value_worker(monkeypatch):
    from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
    from tempering.models.registry import resolve_model_path

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = FSDP2PolicyWorker(resolve_model_path("tiny-arith"), head="value",
                               learning_rate=1e-3, num_threads=1, seed=0)  # fmt: skip
    yield worker
    worker.shutdown()


def _sums(tokenizer, n=32):
    """Rows "a+b=<answer>": every other answer right; returns 1 on a right answer's tokens."""
    import random

    from tempering.distributed.batched_data_dict import BatchedDataDict

    rng, rows = random.Random(0), []
    for i in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        answer = a + b if i % 2 == 0 else a + b + rng.randint(1, 9)
        prompt = tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
        rows.append((prompt, tokenizer(str(answer), add_special_tokens=False)["input_ids"]))
    width = max(len(p) + len(c) for p, c in rows) + 2  # padding past every row
    ids, mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) : len(p) + len(c)] = 1
    returns = mask * torch.tensor([1.0 - i % 2 for i in range(n)])[:, None]
    lengths = torch.tensor([len(p) + len(c) for p, c in rows])
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=mask,
                           sample_mask=torch.ones(n), returns=returns,
                           prev_values=torch.zeros(n, width))  # fmt: skip


def test_a_value_head_learns_a_fixed_batch_of_returns(value_worker):
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    data = _sums(load_tokenizer(resolve_model_path("tiny-arith")))
    on = data["token_mask"] > 0

    def explained() -> float:
        values = value_worker.values(data, 16)["values"]
        assert values.shape == data["input_ids"].shape
        assert (values[:, 0] == 0).all()  # no state before the first token
        r = data["returns"][on]
        return float(1 - (r - values[on]).var() / r.var())

    before = explained()
    for _ in range(25):
        metrics = value_worker.train(data, ValueLoss(None), global_batch_size=32,
                                     micro_batch_size=16)  # fmt: skip
    after = explained()
    # measured: -0.26 -> 0.57 at 25 steps (tiny-arith's body, a new head, lr 1e-3)
    assert before < 0.1 and after > before + 0.3, (before, after)
    assert metrics["num_valid_tokens"] == float(on.sum())


def test_a_critic_packs_and_budgets_its_rows_as_the_policy_does(value_worker):
    """Values and the value loss alike whether the rows are padded, cut by a token budget
    (`policy.dynamic_batching`) or packed (`policy.sequence_packing`)."""
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    data = _sums(load_tokenizer(resolve_model_path("tiny-arith")))
    batchings = {"padded": (16, None, False), "budget": (None, 64, False),
                 "packed": (None, 64, True)}  # fmt: skip
    values = {k: value_worker.values(data, *b)["values"] for k, b in batchings.items()}
    valid = torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]
    assert (values["padded"][~valid] == 0).all() and values["padded"][valid].abs().sum() > 0
    data["prev_values"] = values["padded"]
    losses = {}
    for kind, (mbs, tokens, pack) in batchings.items():
        torch.testing.assert_close(values[kind], values["padded"], atol=1e-5, rtol=1e-5)
        losses[kind] = value_worker.train(
            data, ValueLoss(0.2), global_batch_size=32, micro_batch_size=mbs,
            max_tokens_per_microbatch=tokens, pack_sequences=pack, eval_mode=True,
        )["loss"]  # fmt: skip
    assert losses["padded"] > 0.05  # random head, returns of 0 and 1
    assert losses["budget"] == pytest.approx(losses["padded"], abs=1e-6)
    assert losses["packed"] == pytest.approx(losses["padded"], abs=1e-6)


def test_a_packed_critics_gradient_equals_its_rows_computed_whole():
    from tempering.distributed.batched_data_dict import BatchedDataDict, PackedBin
    from tempering.models.hf import load_token_classifier
    from tempering.models.policy.microbatching import ForwardPass

    torch.manual_seed(0)
    model = load_token_classifier("tiny-arith").eval()
    lengths = (9, 4, 12, 7)
    ids = torch.zeros(4, 12, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 60, (n,))
    mb = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths))
    packing = ForwardPass("value", torch.device("cpu"), None, 0)
    (part,), (layout,), perm = packing.split(mb, None, 64, pack=True)
    assert isinstance(layout, PackedBin) and len(layout.indices) == 4
    got = packing.logits(model, part, layout)
    want = packing.logits(model, part)  # the same rows, padded
    _assert_same_values_and_head_gradient(model, part, got, want)


@pytest.mark.parametrize("over_rows", [False, True])
def test_a_critic_shares_a_group_prompt_as_the_policy_does(over_rows):
    """A GRPO group's rows share their prompt: the critic computes it once (a shared-prefix
    plan), and its values and their gradient equal the rows computed whole."""
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.models.hf import load_token_classifier
    from tempering.models.policy.microbatching import ForwardPass
    from tempering.models.policy.model_setup import shared_prefix_ratio
    from tempering.models.policy.packed_attention import attends_over_rows, use_packed_sdpa
    from tempering.models.policy.shared_prefix import SharedPrefixPlan

    torch.manual_seed(0)
    model = load_token_classifier("tiny-arith").eval()
    if over_rows:  # as the worker sets it up: attention over the rows' own layout
        assert use_packed_sdpa(model) and attends_over_rows(model)
    prompt = torch.randint(3, 60, (14,))
    rows = [torch.cat([prompt, torch.randint(3, 60, (n,))]) for n in (4, 2, 5, 3)]
    ids = torch.zeros(4, 19, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    mb = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(r) for r in rows]))
    ratio = shared_prefix_ratio(model, "value")
    shared = ForwardPass("value", torch.device("cpu"), ratio, 0, over_rows=over_rows)
    (part,), (layout,), _ = shared.split(mb, 4, None)
    assert isinstance(layout, SharedPrefixPlan) and (layout.over_rows is not None) == over_rows
    whole = ForwardPass("value", torch.device("cpu"), None, 0)
    got = shared.logits(model, part, layout)
    want = whole.logits(model, part)
    _assert_same_values_and_head_gradient(model, part, got, want)


def _assert_same_values_and_head_gradient(model, part, got, want):
    """``got`` and ``want`` (two layouts' values of ``part``) agree on each row's valid tokens,
    and so does the value head's gradient through them."""
    valid = torch.arange(part["input_ids"].shape[1])[None] < part["input_lengths"][:, None]
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    grads = []
    for values in (got, want):
        model.zero_grad()
        (values * valid).sum().backward(retain_graph=True)
        grads.append(model.score.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_gae_takes_a_reward_on_every_token_too():
    """PPO-RLHF's KL penalty: a reward on each generated token besides the episode's at its
    last; the recursion's advantages with per-token rewards, the prompt's ignored."""
    values = torch.tensor([[0.0, 0.3, 0.1, 0.2, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    per_token = torch.tensor([[5.0, -0.1, -0.2, -0.3, 7.0]])  # 5 and 7 fall outside the mask
    adv, ret = gae_advantages(torch.tensor([1.0]), values, mask, 0.9, 0.8, per_token)
    want, nv, na = [0.0] * 5, 0.0, 0.0
    for t, r in ((3, 1.0 - 0.3), (2, -0.2), (1, -0.1)):
        delta = r + 0.9 * nv - float(values[0, t])
        na = delta + 0.9 * 0.8 * na
        want[t], nv = na, float(values[0, t])
    torch.testing.assert_close(adv[0], torch.tensor(want))
    torch.testing.assert_close(ret, (adv + values) * mask)


def test_the_reward_kls_reference_log_probs_serve_the_losss_kl_term_too():
    """With both ``critic.reward_kl_coef`` and the loss's KL penalty, the frozen reference's
    log-probs are computed once a step: `ppo_critic.advantages` leaves them in the batch and
    `grpo_learning.train_policy` trains without asking the workers for them again."""
    from types import SimpleNamespace

    from tempering.algorithms import grpo_learning, ppo_critic
    from tempering.config.schemas import GRPOMasterConfig
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.utils.timers import Timer

    cfg = GRPOMasterConfig(critic={"enabled": True, "reward_kl_coef": 0.1},
                           grpo={"use_leave_one_out_baseline": False},
                           loss_fn={"reference_policy_kl_penalty": 0.01})  # fmt: skip
    calls = []

    class Policy:  # the two calls the step makes of the policy, counted
        def get_reference_policy_logprobs(self, data, temperature):
            calls.append("reference")
            return {"reference_policy_logprobs": torch.full((2, 4), -1.0)}

        def train(self, data, loss_fn, with_reference=False):
            calls.append(("train", with_reference, "reference_policy_logprobs" in data))
            return {}

    critic = SimpleNamespace(values=lambda batch: {"values": torch.zeros(2, 4)})
    batch = {
        "rewards": torch.tensor([1.0, 0.0]), "sample_mask": torch.ones(2),
        "token_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]]),
        "generation_logprobs": torch.full((2, 4), -1.5),
    }  # fmt: skip
    metrics = ppo_critic.advantages(cfg, critic, batch, Policy())
    assert metrics["critic/reward_kl"] == pytest.approx(-0.5)
    data = BatchedDataDict({"reference_policy_logprobs": batch["reference_policy_logprobs"]})
    run = SimpleNamespace(cfg=cfg, policy=Policy())
    grpo_learning.train_policy(run, data, None, Timer())
    assert calls == ["reference", ("train", False, True)]
    grpo_learning.train_policy(
        run, BatchedDataDict({}), None, Timer()
    )  # GRPO's KL: the workers' call
    assert calls[-1] == ("train", True, False)
