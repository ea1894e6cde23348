"""What every metric key in ``metrics.jsonl`` means: the one list the docs site's metrics
reference is generated from (tools/docs_reference.py).

Keys are grouped by their prefix. A ``<name>`` part stands for a family (an environment, a
role, a reward function, a number). Two tests keep the list true: every metric key written as
a literal in ``tempering/`` is here (fast tier, tests/unit/test_docs_site.py), and every key a
real run logs matches an entry (slow tier, through the runs the learning tests make already).
Nothing here is imported by the loops: a key they log that is missing fails a test, not a run.
"""

from __future__ import annotations

import re

METRICS: dict[str, dict[str, str]] = {
    "Every step": {
        "step": "the loop's step number (1-based), written with every record",
        "timing/step_s": "wall time of the whole step, seconds",
    },
    "Training (every algorithm)": {
        "train/loss": "the loss the optimizer stepped on, averaged over the step's tokens or rows",
        "train/grad_norm": "gradient norm before clipping (`policy.max_grad_norm`)",
        "train/lr": "learning rate after the scheduler's step",
        "train/tokens_per_s": "training tokens (valid, not padding) per second of the train call",
        "train/step_time_s": "seconds of the policy's train call",
        "train/num_steps": "optimizer steps the train call took (several with `grpo.num_iterations` "
        "or a `train_global_batch_size` below the step's samples)",
        "train/num_tokens": "tokens the train call's micro-batches held, padding included",
        "train/num_valid_tokens": "tokens the loss read (the mask's ones)",
        "train/num_computed_tokens": "tokens the forward computed: below `num_tokens` where "
        "shared prefixes ran once (`policy.shared_prefix`) or padding was dropped",
        "train/num_nonfinite_skipped": "updates skipped because the loss or gradient norm was "
        "NaN/Inf; `policy.max_consecutive_nonfinite_steps` in a row stop the run",
        "train/entropy": "mean entropy of the policy at the generated tokens (nats)",
        "train/entropy_bonus": "the entropy term subtracted from the loss (`loss_fn.entropy_coeff`)",
        "train/moe_aux_loss": "a mixture-of-experts router's load-balancing loss",
        "train/moe_expert_load_max": "MoE: the busiest expert's share of routed tokens times the "
        "number of experts (1.0 is an even load)",
        "train/moe_expert_load_min": "MoE: the idlest expert's share likewise (0 is an expert "
        "no token reached)",
    },
    "GRPO and PPO: the policy loss": {
        "train/clip_fraction": "share of valid tokens whose probability ratio fell outside the "
        "clip range (`loss_fn.ratio_clip_min`/`max`)",
        "train/ratio_mean": "mean probability ratio of the policy against the log-probs taken "
        "before the step",
        "train/kl_penalty": "the KL penalty against the reference "
        "(`loss_fn.reference_policy_kl_penalty`), as added to the loss",
        "train/token_mult_prob_error": "exp(|log p_trainer - log p_sampler|) averaged over the "
        "generated tokens: 1.0 when the trainer and the sampler agree; above 1 when they differ "
        "(bf16 sampling ~1.01, stale samples in async GRPO). The importance correction "
        "(`loss_fn.use_importance_sampling_correction`) weighs by that difference",
        "train/gen_kl_error": "mean KL estimate between the sampler's and the trainer's token "
        "distributions at the generated tokens (0 when they agree)",
        "train/is_weight_mean": "mean importance weight after truncation (`loss_fn.truncated_"
        "importance_sampling_*`); 1.0 when the sampler is the trainer",
        "train/<name>": "any other term a loss reports (e.g. a loss's own diagnostics), averaged "
        "over the step",
    },
    "GRPO: rollouts and rewards": {
        "train/reward_mean": "mean environment reward of the step's samples",
        "train/reward_std": "its standard deviation",
        "train/accuracy": "share of the step's samples the environment scored correct "
        "(rewards above its `correct_above`); reward models: share of pairs scored chosen first",
        "train/gen_length_mean": "mean generated tokens per sample",
        "train/gen_length_max": "most generated tokens of one sample",
        "train/truncated_fraction": "share of generations that stopped at the token budget "
        "(finish reason `length`)",
        "train/episode_truncated_fraction": "share of episodes cut by the sequence or turn budget",
        "train/turns_mean": "mean model turns per episode (1 for single-turn)",
        "train/zero_variance_groups": "prompt groups whose samples all got the same reward (no "
        "learning signal from them)",
        "train/prompt_too_long": "episodes whose prompt alone exceeds "
        "`policy.max_total_sequence_length`: masked out, warned",
        "train/overlong_masked": "episodes left out of the loss by `grpo.overlong_filtering`",
        "train/shaped_reward_mean": "mean reward after `grpo.reward_scaling`/`reward_shaping`",
        "train/reward_penalized_fraction": "share of episodes the overlong shaping penalised",
        "train/reward_penalty_mean": "mean penalty the overlong shaping took",
        "train/rewards_clamped": "rewards clamped into `grpo.reward_scaling.source_*`",
        "train/deadline_cut_episodes": "episodes cut by `grpo.async_grpo.group_timeout_s`",
        "train/deadline_cut_groups": "prompt groups with at least one such episode",
        "throughput/tokens_per_s": "prompt and generated tokens of the step per second of the step",
        "throughput/generated_tokens_per_s": "generated tokens per second of generation",
        "server/requests": "HTTP requests the generation server answered this step",
        "server/backend_calls": "engine calls those requests became (batched requests share one)",
        "server/bad_requests": "requests refused with a 4xx (malformed, over the context length)",
        "server/noncontiguous_rejected": "chat histories refused because they do not extend the "
        "tokens the server returned (`on_noncontiguous=error`)",
        "server/noncontiguous_truncated": "chat histories cut to their contiguous part instead",
        "server/retokenized_assistant_turns": "assistant turns sent without their token ids, "
        "encoded again by the chat template",
        "server/max_tokens_clipped": "requests whose `max_tokens` was cut to the context left",
        "server/tool_call_parse_errors": "tool calls the parser could not read (left in the text)",
        "server/ignored_request_fields": "request fields the server does not read (logged once "
        "per name)",
        "server/<name>": "other counters of the generation server, per step",
    },
    "Dynamic sampling (`grpo.use_dynamic_sampling`)": {
        "dynamic_sampling/rounds": "generation batches drawn to fill the step",
        "dynamic_sampling/groups_seen": "prompt groups generated",
        "dynamic_sampling/groups_filtered": "groups dropped for equal rewards",
        "dynamic_sampling/groups_kept": "groups the step trains on",
        "dynamic_sampling/groups_discarded_extra": "kept groups past the step's need, discarded",
        "dynamic_sampling/shortfall": "groups missing after `dynamic_sampling_max_gen_batches`",
        "dynamic_sampling/padded_groups": "placeholder groups, masked out of the loss, filling the shortfall",
    },
    "Asynchronous GRPO": {
        "train/buffer_size": "prompt groups waiting in the replay buffer",
        "train/avg_trajectory_age": "mean weight versions between a trained group's sampler and "
        "the trainer",
        "train/max_trajectory_age": "the oldest; never above "
        "`grpo.async_grpo.max_trajectory_age_steps`",
        "train/avg_token_age": "mean age per token, with in-flight weight updates",
        "train/max_token_age": "the oldest token's age, with in-flight weight updates",
        "train/mixed_version_samples": "share of samples whose tokens came from more than one "
        "weight version (in-flight updates)",
        "train/stale_groups_dropped": "groups older than the bound, dropped (counted, never used)",
        "train/generation_failures": "collector failures retried so far "
        "(`grpo.async_grpo.max_generation_failures` stop the run)",
        "timing/idle/buffer_starvation_s": "seconds the trainer waited for the collector",
        "timing/idle/refit_bubble_s": "seconds the refit waited for the batch in flight",
    },
    "PPO's critic (`critic.enabled`)": {
        "critic/loss": "clipped value loss",
        "critic/value_clip_fraction": "share of values whose move was clipped (`critic.value_clip`)",
        "critic/values_mean": "mean value the critic gave the step's tokens",
        "critic/returns_mean": "mean GAE return the critic trains toward",
        "critic/explained_variance": "1 - Var(returns - values) / Var(returns): how much of the "
        "returns the values explain (1 perfect, 0 no better than their mean)",
        "critic/reward_kl": "mean per-token KL penalty in the reward (`critic.reward_kl_coef`)",
        "critic/warming_up": "1 during `critic.warmup_steps` (the policy does not train), else 0",
        "critic/<name>": "the critic's train-call figures, as `train/<name>` for the policy "
        "(grad_norm, lr, num_steps, num_tokens, step_time_s, tokens_per_s, ...)",
        "timing/critic_s": "seconds of the critic's train call",
        "timing/values_s": "seconds of the critic's value pass",
    },
    "Distillation": {
        "train/kl_forward": "KL(teacher || student) over the teacher's top-k",
        "train/kl_reverse": "KL(student || teacher) over the teacher's top-k",
        "train/teacher_topk_mass": "share of the teacher's probability inside its top-k",
        "train/student_topk_mass": "share of the student's probability on the teacher's top-k",
        "train/teacher_topk_mb": "MiB of teacher log-probs and ids sent to the student this step",
        "timing/teacher_s": "seconds of the teacher's top-k pass",
    },
    "DPO, KTO and reward models": {
        "train/preference_loss": "the preference term of the loss (without the SFT term)",
        "train/sft_loss": "the NLL of the chosen responses (`dpo.sft_loss_weight`)",
        "train/preference_accuracy": "share of pairs whose implicit reward ranks chosen first",
        "train/logprob_accuracy": "share of pairs where the policy gives the chosen response the "
        "higher log-prob",
        "train/reference_logprob_accuracy": "the same for the frozen reference",
        "train/reward_margin": "mean chosen minus rejected implicit reward",
        "train/rewards_chosen_mean": "mean implicit reward of the chosen responses",
        "train/rewards_rejected_mean": "mean implicit reward of the rejected responses",
        "train/log_odds_ratio": "ORPO's log odds ratio of chosen over rejected",
        "train/kl": "KTO's reference point: the KL rows' mean log-ratio, clamped at 0",
        "train/reward_accuracy": "KTO: share of rows whose reward sits on their label's side of "
        "the reference point",
        "train/margin": "reward models: mean score of the chosen response minus the rejected's",
        "train/rewards_desirable_mean": "KTO: mean reward of the desirable rows",
        "train/rewards_undesirable_mean": "KTO: mean reward of the undesirable rows",
        "data/num_train_pairs": "preference pairs in the training data",
        "data/num_val_pairs": "preference pairs in the validation data",
        "data/num_train_rows": "KTO rows in the training data",
        "data/num_val_rows": "KTO rows in the validation data",
        "data/num_train_desirable": "KTO's desirable training rows",
        "data/desirable_weight_ratio": "KTO: desirable_weight x desirable rows / (undesirable_"
        "weight x undesirable rows); TRL advises [1, 4/3]",
        "data/num_skipped": "bad rows skipped (`data.on_bad_row=skip`)",
    },
    "Validation": {
        "val/accuracy": "held-out greedy accuracy (GRPO, distillation: the environment's "
        "correct answers; SFT: exact-match answers)",
        "val/success": "held-out share of episodes solved (multi-turn tasks count any turn)",
        "val/reward_mean": "held-out mean reward (the headline where rewards are scores: reward "
        "functions, reward models)",
        "val/turns_mean": "held-out mean turns per episode",
        "val/time_s": "seconds the validation took",
        "val/loss": "held-out loss (SFT, DPO, KTO, reward models)",
        "val/greedy_accuracy": "DPO/KTO: held-out task accuracy of the policy's greedy answers",
        "val/greedy_via_export": "1 when that accuracy was measured on an exported copy",
        "val/pass@<k>": "held-out pass@k (`grpo.val_pass_at_k`)",
        "val/<name>/reward_mean": "held-out mean reward of one `data.blend` entry",
        "val/<name>/accuracy": "held-out greedy accuracy of one blend entry (where its "
        "environment's rewards are correct answers)",
        "val/<name>/samples": "held-out problems of that blend entry the validation read",
        "val/<name>": "the held-out value of the matching `train/<name>` (preference accuracy, "
        "rewards by label, margins, ...)",
    },
    "Timing": {
        "timing/generation_s": "seconds generating the step's samples",
        "timing/logprobs_s": "seconds of the policy's (and reference's) log-prob passes",
        "timing/train_s": "seconds of the policy's train call",
        "timing/refit_s": "seconds moving the new weights into the generation engine",
        "timing/<name>_s": "other phases of a step, seconds",
    },
    "Environments": {
        "env/arithmetic_samples": "answers the arithmetic environment scored this step",
        "env/arithmetic_accuracy": "their share scored correct",
        "env/arithmetic_no_integer": "answers with no integer to read",
        "env/arithmetic_too_long": "answers too long to score (counted, scored 0)",
        "env/retry_solved_at_<n>": "arithmetic_retry episodes solved at turn n",
        "env/retry_failed": "arithmetic_retry episodes never solved",
        "env/calculator_tool_calls": "calculator calls the model made",
        "env/calculator_tool_errors": "calls that answered `error: ...`",
        "env/calculator_over_budget": "calls past the episode's tool budget",
        "env/calculator_<name>": "the calculator environment's other counters",
        "env/math_samples": "answers math-verify scored",
        "env/math_accuracy": "their share scored correct",
        "env/math_parse_failures": "answers with nothing to parse (scored 0)",
        "env/math_timeouts": "answers whose scoring ran out of time",
        "env/math_errors": "verifier exceptions (`env.math.max_error_rate` stops the run)",
        "env/math_sandbox_refusals": "answers whose scoring the sandbox refused (an attack)",
        "env/math_protocol_errors": "malformed replies from a scorer worker",
        "env/math_workers_replaced": "scorer subprocesses replaced",
        "env/math_sandbox_netns": "1 when the scorer runs without a network namespace's network",
        "env/reward_fn/<name>_mean": "a custom reward function's own mean (`env.reward_fn`)",
        "env/reward_fn_<name>": "custom reward counters (errors, answers that did not apply)",
        "env/reward_model_<name>": "reward-model environment counters",
        "env/<name>/reward_mean": "mean reward of one `data.blend` entry's samples this step "
        "(or of one NeMo Gym agent's rows)",
        "env/<name>/samples": "samples that blend entry (or rows that Gym agent) ran this step",
        "env/<name>/accuracy": "share of a blend entry's samples its environment scored correct "
        "(absent where its rewards are scores: reward functions, reward models)",
        "env/<name>/<component>_mean": "the mean of a reward component one NeMo Gym agent's "
        "results carry (`reward_components`)",
        "gym/masked_samples": "NeMo Gym episodes left out of the loss because their result asked "
        "for it (`mask_sample`), this step",
        "gym/noncontiguous_truncated": "Gym episodes cut at a model call whose prompt does not "
        "extend the previous call's (`env.nemo_gym.on_noncontiguous=truncate`)",
        "gym/over_length_truncated": "Gym episodes cut at the model call that would pass "
        "`policy.max_total_sequence_length`",
        "gym/retries": "retried HTTP calls to Gym's agents this step (`env.nemo_gym.max_retries`)",
        "gym/shard/<name>/groups": "prompt groups one Gym shard ran this step "
        "(`env.nemo_gym.shards`; every shard is logged, 0 when no row went to it)",
        "gym/shard/<name>/samples": "episodes (rows x generations) that shard ran this step",
        "gym/shard/<name>/retries": "retried HTTP calls to that shard's servers this step",
        "gym/shard/<name>/restarts": "instances of that shard restarted this step after dying "
        "mid-step (`env.nemo_gym.shard_restarts` bounds them per run)",
        "gym/shard/<name>/retried_groups": "prompt groups sent again, once, to a restarted "
        "instance of that shard this step",
        "gym/shard/<name>/replica_<index>_groups": "prompt groups one replica of that shard "
        "ran this step (groups go round-robin over `replicas`, carried over between steps)",
    },
    "External harnesses (`grpo.rollout_transport=external`)": {
        "rollouts/external_episodes": "episodes the harness was given this step (rows x "
        "generations; validation's are not counted here)",
        "rollouts/external_model_calls": "model calls the server recorded under those episodes' "
        "rollout ids",
        "rollouts/external_failed": "episodes masked as failed: the harness reported an error, "
        "no result or no finite reward, made no model call, or more than "
        "`grpo.external_harness.max_calls_per_episode`",
        "rollouts/external_noncontiguous": "episodes masked because a call's prompt did not "
        "extend the previous call's prompt + generation (the harness rewrote or forked the "
        "history)",
        "rollouts/external_mixed_weight_versions": "episodes masked because their tokens came "
        "from more than one weight version",
        "rollouts/external_ids_attached": "assistant messages the harness sent back without token "
        "ids that the server gave their recorded ids (so the splice stayed on-policy)",
    },
    "Resources, per role (controller, policy, generation, environment)": {
        "resources/<role>/cpu_cores": "CPU cores the role kept busy over the step",
        "resources/<role>/peak_rss_gb": "peak resident memory of the role's processes, GB",
        "resources/<role>/threads": "torch threads the role's workers ran with",
        "resources/<role>/thread_changes": "times the thread governor changed them (CPU)",
        "resources/<role>/peak_gpu_mem_gb": "peak GPU memory, GB (where CUDA is in use)",
        "resources/<role>/gpu_util": "GPU utilisation, percent (NVML, where CUDA is in use)",
    },
}


def _regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"<[a-z]+>", pattern)
    return re.compile("[^/]+".join(re.escape(p) for p in parts) + r"\Z")


_PATTERNS = [(key, _regex(key)) for entries in METRICS.values() for key in entries]


_CATCH_ALL = re.compile(r"[a-z_]+/<[a-z]+>")


def documented_as(key: str, catch_all: bool = True) -> str | None:
    """The entry that documents `key` (itself, or the first pattern it matches), else None.
    ``catch_all=False`` ignores the entries that stand for a whole prefix (``train/<name>``),
    so a key must be listed for what it is."""
    if any(entry == key for entry, _ in _PATTERNS):
        return key
    patterns = (p for p in _PATTERNS if catch_all or not _CATCH_ALL.fullmatch(p[0]))
    return next((entry for entry, regex in patterns if regex.match(key)), None)


# Prefixes whose keys mirror `train/`'s: `val/<name>` and `critic/<name>` say so above.
_MIRRORS = ("val/", "critic/")


def undocumented(keys) -> list[str]:
    """The keys among `keys` (a run's metrics.jsonl records' keys) no specific entry documents,
    a ``val/x`` or ``critic/x`` counting as documented when ``train/x`` is."""

    def known(key: str) -> bool:
        if documented_as(key, catch_all=False):
            return True
        mirror = next((p for p in _MIRRORS if key.startswith(p)), None)
        return bool(mirror) and documented_as("train/" + key[len(mirror) :], False) is not None

    return sorted({k for k in keys if not known(k)})
