"""The config sections of GRPO alone: the loop (``grpo``, ``grpo.async_grpo``), the loss
(``loss_fn``), the environments (``env``) and ``fault_tolerance``. `tempering.config.schemas`
holds the rest and the master configs, and re-exports these."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from tempering.config import loop_keys
from tempering.config.external_sections import ExternalHarnessConfig
from tempering.config.section import Section


class AsyncGRPOConfig(Section):
    """Asynchronous GRPO (NeMo RL's key names): a collector thread generates the batches of
    coming steps on the generation workers while the policy trains (docs/async_grpo.md)."""

    enabled: bool = Field(False, description="overlap generation with training")
    max_trajectory_age_steps: int = Field(
        1,
        ge=0,
        description="a step trains on groups generated at most this many weight versions ago "
        "(0 = on-policy, the synchronous schedule)",
    )
    in_flight_weight_updates: bool = Field(
        False,
        description="the refit reaches generation workers mid-batch: new weights load between "
        "decode steps and every token records its weight version (torch engine)",
    )
    max_generation_failures: int = Field(
        0,
        ge=0,
        description="a batch whose generation raises (not a dead worker) is retried; more "
        "failures than this in the run stop it",
    )
    starvation_timeout_s: float = Field(
        600.0,
        gt=0,
        description="the trainer waits this long at most for the collector's next batch (or "
        "for its drain before a refit); then a named error with the collector's stack",
    )
    group_timeout_s: float | None = Field(
        None,
        gt=0,
        description="a batch's rollouts start no turn after this many seconds; episodes still "
        "running end there, truncated and counted (train/deadline_cut_episodes). Not with "
        "NeMo Gym, whose episodes nemo_gym.request_timeout_s bounds",
    )


def _refuse_unread_when_off(section: Section, where: str) -> None:
    """A key of a section that is off is never read: refused unless left at its default."""
    set_keys = [k for k, f in type(section).model_fields.items()
                if k != "enabled" and getattr(section, k) != f.default]  # fmt: skip
    if set_keys:
        raise ValueError(
            f"{where}.{set_keys[0]}={getattr(section, set_keys[0])!r} is read only with "
            f"{where}.enabled=true: set enabled=true, or remove the key"
        )


class RewardScalingConfig(Section):
    """A linear map of each episode's reward before advantages (NeMo RL's keys): clamped to
    [source_min, source_max] (clamped rewards counted: train/rewards_clamped), then mapped onto
    [target_min, target_max]."""

    enabled: bool = Field(False, description="map each reward linearly before advantages")
    source_min: float = Field(0.0, description="rewards below are clamped to this first")
    source_max: float = Field(1.0, description="rewards above are clamped to this first")
    target_min: float = Field(0.0, description="what source_min maps to")
    target_max: float = Field(1.0, description="what source_max maps to")

    @model_validator(mode="after")
    def _range(self) -> RewardScalingConfig:
        if not self.enabled:
            _refuse_unread_when_off(self, "grpo.reward_scaling")
        elif self.source_max <= self.source_min:
            raise ValueError(
                f"grpo.reward_scaling.source_max={self.source_max} must be greater than "
                f"source_min={self.source_min} (the rewards' range before the map)"
            )
        return self


class RewardShapingConfig(Section):
    """Length penalties added to the reward before advantages (NeMo RL's keys; DAPO's soft
    overlong punishment): an episode whose generated tokens L pass
    ``max_response_length - overlong_buffer_length`` loses ``overlong_buffer_penalty`` times
    the share of the buffer it used, ``-(L - (max - buffer)) / buffer * penalty``; or, with
    ``stop_properly_penalty_coef``, a truncated episode's reward is multiplied by it. The
    environment's own rewards stay in train/reward_mean, accuracy and dynamic sampling."""

    enabled: bool = Field(False, description="apply one length penalty (the keys below)")
    overlong_buffer_length: int | None = Field(
        None, ge=1, description="tokens before max_response_length where the penalty grows"
    )
    overlong_buffer_penalty: float = Field(1.0, ge=0, description="the penalty at the limit")
    max_response_length: int | None = Field(
        None,
        ge=1,
        description="generated tokens per episode the penalty ends at (null: "
        "policy.generation.max_new_tokens, single-turn only)",
    )
    stop_properly_penalty_coef: float | None = Field(
        None, ge=0, le=1, description="instead: a truncated episode's reward times this"
    )

    @model_validator(mode="after")
    def _one_kind(self) -> RewardShapingConfig:
        if not self.enabled:
            _refuse_unread_when_off(self, "grpo.reward_shaping")
            return self
        overlong = self.overlong_buffer_length is not None
        if overlong == (self.stop_properly_penalty_coef is not None):
            raise ValueError(
                "grpo.reward_shaping.enabled=true needs exactly one of overlong_buffer_length "
                "(DAPO's overlong penalty) and stop_properly_penalty_coef (scale truncated "
                f"episodes' rewards); got overlong_buffer_length={self.overlong_buffer_length}, "
                f"stop_properly_penalty_coef={self.stop_properly_penalty_coef}"
            )
        if not overlong and (self.max_response_length is not None
                             or self.overlong_buffer_penalty != 1.0):  # fmt: skip
            raise ValueError(
                "grpo.reward_shaping.max_response_length and overlong_buffer_penalty are read "
                "only with overlong_buffer_length; stop_properly_penalty_coef needs neither"
            )
        limit = self.max_response_length
        if overlong and limit is not None and self.overlong_buffer_length > limit:
            raise ValueError(
                f"grpo.reward_shaping.overlong_buffer_length={self.overlong_buffer_length} is "
                f"longer than max_response_length={limit}: the buffer is the last "
                "overlong_buffer_length tokens before the limit"
            )
        return self


class GRPOConfig(Section):
    num_prompts_per_step: loop_keys.NumPromptsPerStep = 16
    num_generations_per_prompt: loop_keys.NumGenerationsPerPrompt = 8
    max_num_steps: loop_keys.MaxNumSteps = 60
    max_num_epochs: loop_keys.MaxNumEpochs = 100
    max_rollout_turns: loop_keys.MaxRolloutTurns = 1
    rollout_transport: Literal["in_process", "http", "external"] = Field(
        "in_process",
        description="rollouts call the chat service directly, or over HTTP through "
        "policy.generation.http_server (which must be enabled), or come from an external "
        "harness that calls that server itself (grpo.external_harness)",
    )
    normalize_rewards: bool = Field(
        True, description="divide advantages by the group std (with critic.enabled: whiten "
        "them over the batch's generated tokens)",
    )  # fmt: skip
    use_leave_one_out_baseline: bool = Field(
        True, description="each sample's baseline is the mean of its group's others (false: "
        "the whole group's mean)"
    )  # fmt: skip
    num_iterations: int = Field(
        1, ge=1, description="passes over each step's batch (the GRPO paper's mu, TRL's "
        "num_iterations, verl's ppo_epochs), each in train_global_batch_size mini-batches; "
        "after the first, the policy trains off its sampler, clipped against the log-probs it "
        "had before the step (a critic takes as many passes)",
    )  # fmt: skip
    val_period: loop_keys.ValPeriod = 10
    val_at_start: loop_keys.ValAtStart = True
    max_val_samples: loop_keys.MaxValSamples = 256
    val_batch_size: loop_keys.ValBatchSize = 256
    val_pass_at_k: int = Field(0, ge=0, description="k samples per val prompt for pass@k; 0 = off")
    use_dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal and generate more "
        "until num_prompts_per_step groups remain (dynamic_sampling/*)"
    )  # fmt: skip
    dynamic_sampling_max_gen_batches: int = Field(
        4, ge=1, description="generation rounds per step at most; a shortfall is counted "
        "(dynamic_sampling/shortfall)"
    )  # fmt: skip
    overlong_filtering: bool = Field(
        False, description="DAPO: leave samples cut at the length limit out of the loss "
        "(train/overlong_masked)"
    )  # fmt: skip
    max_wall_time_s: float | None = Field(None, description="stop after this many seconds")
    seed: int = Field(
        42, description="seed of the prompt order, each step's sampling and the workers' torch"
    )
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()
    reward_scaling: RewardScalingConfig = RewardScalingConfig()
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    external_harness: ExternalHarnessConfig = ExternalHarnessConfig()


class CriticConfig(Section):
    """PPO with a learned critic (verl's and OpenRLHF's PPO): a value model, built from the
    policy's (or ``model_name``'s) body with a new value head, gives each generated token's
    advantage by GAE in place of the group baseline; it trains on the returns each step
    beside the policy, on the policy's bundles, with the policy's batch sizes, precision,
    optimizer and schedule (its own learning rate)."""

    enabled: bool = Field(
        False, description="PPO: GAE advantages from a learned value model instead of the "
        "group baseline"
    )  # fmt: skip
    model_name: str | None = Field(
        None, description="the critic's starting model (its body; the value head is new); "
        "null: the policy's",
    )  # fmt: skip
    learning_rate: float = Field(1e-5, gt=0, description="the critic's optimizer learning rate")
    train_global_batch_size: int | None = Field(
        None, ge=1, description="samples per critic optimizer step (a step's samples are split "
        "into several: more value updates per rollout); null: the policy's",
    )  # fmt: skip
    value_clip: float | None = Field(
        0.2, gt=0, description="clip each value's move from the one the advantages used "
        "(PPO's clipped value loss); null: unclipped",
    )  # fmt: skip
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's lambda")
    reward_kl_coef: float = Field(
        0.0, ge=0, description="PPO-RLHF's KL penalty in the reward: each generated token's "
        "reward less this x (its log-prob - the reference's), as TRL's kl_coef and verl's "
        "use_kl_in_reward (0: off; loss_fn.reference_policy_kl_penalty puts KL in the loss)",
    )  # fmt: skip
    warmup_steps: int = Field(
        0, ge=0, description="the run's first N steps train the critic only: the policy (and "
        "so the generator) waits until the values mean something (verl's trainer.critic_warmup)",
    )  # fmt: skip


def critic_problems(cfg: Any) -> list[str]:
    """What a run with ``critic.enabled`` cannot do (a GRPO master config), each with its fix."""
    c, g = cfg.critic, cfg.grpo
    if not c.enabled:
        fields = type(c).model_fields
        unread = [k for k in fields if k != "enabled" and getattr(c, k) != fields[k].default]
        return [
            f"critic.{unread[0]} is read only by PPO: set critic.enabled=true, or remove "
            f"critic.{', critic.'.join(unread)}"
        ] if unread else []  # fmt: skip
    problems = []
    if g.use_leave_one_out_baseline:
        problems.append(
            "critic.enabled=true: the critic's values are the baseline, so "
            "grpo.use_leave_one_out_baseline=true would not be read: set it to false"
        )
    if g.use_dynamic_sampling:
        problems.append(
            "critic.enabled=true is not supported with grpo.use_dynamic_sampling (it refills "
            "groups of equal rewards, which a critic's advantages do not need): set it false"
        )
    if c.warmup_steps >= g.max_num_steps:
        problems.append(
            f"critic.warmup_steps={c.warmup_steps} leaves no step of grpo.max_num_steps="
            f"{g.max_num_steps} to train the policy: use fewer warm-up steps"
        )
    n, gbs = g.num_prompts_per_step * g.num_generations_per_prompt, c.train_global_batch_size
    if gbs is not None and n % gbs:
        problems.append(
            f"critic.train_global_batch_size={gbs} does not divide a step's {n} samples "
            "(grpo.num_prompts_per_step x num_generations_per_prompt): use a divisor of it"
        )
    return problems


TRUNCATED_IS_TYPES = ("tis", "icepop", "seq-mask-tis")


def off_policy_loss_problems(
    *,
    use_importance_sampling_correction: bool,
    truncated_importance_sampling_type: str | None,
    truncated_importance_sampling_ratio: float | None,
    truncated_importance_sampling_ratio_min: float | None,
    sequence_level_importance_ratios: bool,
    token_level_loss: bool,
    length_normalizer: int | None = None,
) -> list[str]:
    """What is wrong with a combination of the GRPO loss's off-policy options (NeMo RL's rules).

    Shared by `LossFnConfig` (at load) and `tempering.losses.ClippedPGLoss` (at construction),
    so a config and a directly built loss refuse the same things with the same words. Plain
    arguments in, one message per problem out (empty: the combination is valid).
    """
    kind = truncated_importance_sampling_type
    hi, lo = truncated_importance_sampling_ratio, truncated_importance_sampling_ratio_min
    out: list[str] = []
    if kind is None:
        for name, value in (("truncated_importance_sampling_ratio", hi),
                            ("truncated_importance_sampling_ratio_min", lo)):  # fmt: skip
            if value is not None:
                out.append(
                    f"{name}={value} is read only with a truncated_importance_sampling_type: set "
                    f"the type to 'tis' (clamp the weights to [min, max]), 'icepop' (zero "
                    f"tokens outside the band) or 'seq-mask-tis' (drop sequences outside it), "
                    f"or set {name}=null"
                )
    elif kind not in TRUNCATED_IS_TYPES:
        out.append(
            f"truncated_importance_sampling_type={kind!r} is unknown; use one of "
            f"{', '.join(TRUNCATED_IS_TYPES)} or null"
        )
    else:
        if not use_importance_sampling_correction:
            out.append(
                f"truncated_importance_sampling_type={kind!r} shapes the importance weights, "
                f"which apply only with use_importance_sampling_correction=true: set it true, "
                f"or the type to null"
            )
        if hi is None or hi <= 0:
            out.append(
                f"truncated_importance_sampling_type={kind!r} needs "
                f"truncated_importance_sampling_ratio > 0 (the band's upper bound); got {hi}"
            )
        if lo is None and kind != "tis":
            out.append(
                f"truncated_importance_sampling_type={kind!r} needs "
                f"truncated_importance_sampling_ratio_min (the band's lower bound; NeMo RL's "
                f"reference bands: icepop 0.5, seq-mask-tis 0.999)"
            )
        if lo is not None and (lo < 0 or (hi is not None and lo > hi)):
            out.append(
                f"truncated_importance_sampling_ratio_min={lo} must be >= 0 and <= "
                f"truncated_importance_sampling_ratio={hi}"
            )
        if kind == "seq-mask-tis" and sequence_level_importance_ratios:
            out.append(
                "truncated_importance_sampling_type='seq-mask-tis' masks sequences but keeps "
                "per-token weights, which sequence_level_importance_ratios=true replaces by one "
                "weight per sequence: use 'tis' or 'icepop' with it, or set it false"
            )
    if sequence_level_importance_ratios and token_level_loss:
        out.append(
            "sequence_level_importance_ratios=true (GSPO) needs the sequence-level loss: set "
            "token_level_loss=false"
        )
    if length_normalizer is not None and length_normalizer < 1:
        out.append(f"length_normalizer={length_normalizer} must be >= 1 (tokens)")
    if length_normalizer is not None and token_level_loss:
        out.append(
            f"length_normalizer={length_normalizer} (Dr. GRPO) divides each sequence's token sum "
            "in the sequence-level loss: set token_level_loss=false"
        )
    return out


KL_CLAMPS = (20.0, 10.0)  # NeMo RL's kl_input_clamp_value, kl_output_clamp_value defaults


def loss_fn_problems(keys: Mapping[str, Any]) -> list[str]:
    """`off_policy_loss_problems` and `kl_penalty_problems` over a mapping that holds their
    arguments by name, among others: a `LossFnConfig`'s dump, or `ClippedPGLoss`'s arguments."""

    def args(rules: Callable[..., list[str]]) -> dict[str, Any]:
        return {n: keys[n] for n in inspect.signature(rules).parameters if n in keys}

    return off_policy_loss_problems(**args(off_policy_loss_problems)) + kl_penalty_problems(
        **args(kl_penalty_problems)
    )


def kl_penalty_problems(
    *,
    reference_policy_kl_penalty: float,
    use_on_policy_kl_approximation: bool,
    kl_input_clamp_value: float | None,
    kl_output_clamp_value: float | None,
) -> list[str]:
    """What is wrong with the GRPO loss's KL-penalty options: each is read only with a penalty,
    and a clamp must be positive. Shared by `LossFnConfig` and `ClippedPGLoss`, like
    `off_policy_loss_problems`."""
    out = [
        f"{name}={value} must be > 0 (or null: no clamp)"
        for name, value in (("kl_input_clamp_value", kl_input_clamp_value),
                            ("kl_output_clamp_value", kl_output_clamp_value))
        if value is not None and value <= 0
    ]  # fmt: skip
    if reference_policy_kl_penalty == 0:
        defaults = (False, *KL_CLAMPS)
        given = (use_on_policy_kl_approximation, kl_input_clamp_value, kl_output_clamp_value)
        names = ("use_on_policy_kl_approximation", "kl_input_clamp_value", "kl_output_clamp_value")
        out += [
            f"{name}={value} is read only with a KL penalty: set reference_policy_kl_penalty "
            f"> 0, or remove {name}"
            for name, value, default in zip(names, given, defaults, strict=True)
            if value != default
        ]
    return out


class LossFnConfig(Section):
    """GRPO's `ClippedPGLoss` (tempering/losses.py), NeMo RL's key names and rules."""

    reference_policy_kl_penalty: float = Field(
        0.0, ge=0, description="weight of the KL(policy || reference) term in the loss; 0: off "
        "(no reference model is loaded)"
    )  # fmt: skip
    kl_type: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Schulman's KL estimator, r = pi / pi_ref at the sampled token: k1 "
        "log r, k2 (log r)^2 / 2, k3 1/r - 1 + log r (unbiased, >= 0)"
    )  # fmt: skip
    use_on_policy_kl_approximation: bool = Field(
        False,
        description="weight each token's KL term by pi_theta / pi_generator (detached), so the "
        "penalty estimates KL(pi_theta || pi_ref) rather than the sampler's (NeMo RL's key)",
    )
    kl_input_clamp_value: float | None = Field(
        KL_CLAMPS[0], description="the KL estimator's log-ratio clamped to +-this (null: none)"
    )
    kl_output_clamp_value: float | None = Field(
        KL_CLAMPS[1], description="each token's KL estimate clamped to +-this (null: none)"
    )
    ratio_clip_min: float = Field(
        0.2, ge=0, description="PPO clip: the ratio's lower bound is 1 - this"
    )
    ratio_clip_max: float = Field(0.2, ge=0, description="> ratio_clip_min = DAPO clip-higher")
    ratio_clip_c: float | None = Field(None, gt=1, description="dual-clip constant (> 1)")
    token_level_loss: bool = Field(
        True, description="average over the batch's tokens (false: each sequence's mean, "
        "then over sequences)"
    )  # fmt: skip
    length_normalizer: int | None = Field(
        None,
        ge=1,
        description="Dr. GRPO (TRL's loss_type='dr_grpo', verl's seq-mean-token-sum-norm): "
        "each sequence's token terms summed and divided by this constant (TRL: "
        "max_completion_length) instead of averaged over its own length, so a token weighs "
        "the same in a long answer as in a short one (needs token_level_loss=false)",
    )
    use_importance_sampling_correction: bool = Field(
        False, description="weight each token by pi_trainer_old / pi_generator (off-policy data)"
    )
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = Field(
        None,
        description="tis: clamp the weights to [min, max]; icepop: zero tokens whose weight is "
        "outside; seq-mask-tis: drop sequences whose geometric-mean weight is outside",
    )
    truncated_importance_sampling_ratio: float | None = Field(
        None, description="upper bound of the band (needs a truncated_importance_sampling_type)"
    )
    truncated_importance_sampling_ratio_min: float | None = Field(
        None, description="lower bound of the band (tis: default 0; icepop/seq-mask-tis: needed)"
    )
    sequence_level_importance_ratios: bool = Field(
        False,
        description="GSPO: the PPO ratio is each sequence's geometric mean (needs "
        "token_level_loss=false)",
    )
    entropy_coeff: float = Field(
        0.0,
        ge=0,
        description="verl's entropy bonus: the loss subtracts this x the policy's mean entropy "
        "at the generated tokens (0: off)",
    )

    @model_validator(mode="after")
    def _off_policy(self) -> LossFnConfig:
        problems = loss_fn_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(problems))
        return self


class MathEnvConfig(Section):
    num_workers: int = Field(
        2, ge=1, description="sandboxed verifier processes checking answers in parallel"
    )
    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit per answer checked")
    memory_limit_mb: int = Field(
        1024, ge=64, description="address space of each sandboxed verifier process"
    )
    cpu_limit_s: int = Field(
        300, ge=1, description="CPU seconds a verifier process may use before it is replaced"
    )
    max_error_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="stop the run when more of one step's answers than this make the verifier "
        "raise (a broken verifier scores everything 0); model text that attacks the verifier "
        "counts too",
    )


class ArithmeticRetryEnvConfig(Section):
    max_attempts: int = Field(3, ge=1, description="answers per episode before it fails")
    discount: float = Field(0.5, gt=0, le=1, description="a correct attempt n earns discount^(n-1)")


class CalculatorEnvConfig(Section):
    max_tool_calls: int = Field(4, ge=0, description="calls per episode before it ends unscored")


class NemoGymShardConfig(Section):
    """One shard of a launched Gym (tempering/environments/nemo_gym_shards.py)."""

    name: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the shard's name, in metrics (gym/shard/<name>/...) and messages",
    )
    entries: list[str] = Field(
        min_length=1,
        description="the Gym entries (instance names in env.nemo_gym.config_paths) this shard "
        "hosts: the agents or environment servers rows name, or resources servers; each "
        "belongs to one shard. What they reference (resources server, policy model) and the "
        "environment servers in front of their agents come along",
    )
    replicas: int = Field(
        1, ge=1, description="identical copies of this shard; prompt groups go round-robin"
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="this shard's keys for Gym's global config, merged over "
        "env.nemo_gym.extra_config",
    )


SHARD_RESTARTS = 2  # env.nemo_gym.shard_restarts's default


class NemoGymConfig(Section):
    """NeMo Gym (tempering/environments/nemo_gym.py): attach to a running Gym, or launch one."""

    head_server_url: str | None = Field(
        None, description="attach mode: a running Gym head server, e.g. http://127.0.0.1:11000"
    )
    config_paths: list[str] = Field(
        default_factory=list,
        description="launch mode: Gym config files (e.g. resources_servers/math_with_judge/"
        "configs/math_with_judge.yaml); tempering starts Gym in its own venv, pointed at the "
        "trainer's generation server",
    )
    head_server_port: int = Field(11000, ge=1, le=65535, description="launch mode: Gym's head port")
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="launch mode: more keys for Gym's global config (dotted keys are not split)",
    )
    prebuilt_server_venvs: bool = Field(
        True,
        description="launch mode: every Gym server runs in the one Gym venv tempering builds "
        "(false: Gym builds a venv per server with uv, its supported route on Python 3.13)",
    )
    default_route: str | None = Field(
        None, description="agent or environment-server instance for rows without routing fields"
    )
    concurrency: int = Field(64, ge=1, description="/run requests in flight at most")
    request_timeout_s: float = Field(600.0, gt=0, description="per /run request")
    max_retries: int = Field(3, ge=0, description="retries on connection errors, timeouts, 5xx")
    retry_backoff_s: float = Field(0.5, ge=0, description="first retry delay (then doubled)")
    startup_timeout_s: float = Field(600.0, gt=0, description="launch mode: Gym start-up limit")
    on_noncontiguous: Literal["error", "truncate"] = Field(
        "error", description="a rollout whose model calls do not extend each other"
    )
    shards: list[NemoGymShardConfig] = Field(
        default_factory=list,
        description="launch mode: split the Gym config over several Ray actors, each hosting "
        "the entries it claims (empty: one Gym runs every entry); instance k listens on "
        "head_server_port + k",
    )
    shard_restarts: int = Field(
        SHARD_RESTARTS, ge=0, description="with shards: restarts of a shard instance that dies "
        "mid-step a run allows, each retrying that instance's in-flight groups once (counted: "
        "gym/shard/<name>/restarts); 0: a dead instance fails the step",
    )  # fmt: skip

    @model_validator(mode="after")
    def _shards(self) -> NemoGymConfig:
        if not self.shards:
            if self.shard_restarts != SHARD_RESTARTS:
                raise ValueError(
                    f"env.nemo_gym.shard_restarts={self.shard_restarts} is read only with "
                    "env.nemo_gym.shards (one Gym without shards is not restarted): remove "
                    "it, or split Gym into shards"
                )
            return self
        from tempering.utils.gym_shards import claims, instance_names

        if self.head_server_url:
            raise ValueError(
                "env.nemo_gym.shards splits a Gym tempering launches, and head_server_url "
                "attaches to one you run: use config_paths with shards, or drop shards"
            )
        claims(gym_shards(self))
        last = self.head_server_port + len(instance_names(gym_shards(self))) - 1
        if last > 65535:
            raise ValueError(
                f"env.nemo_gym.shards: instance k listens on head_server_port + k, and the "
                f"last would be {last} > 65535: lower env.nemo_gym.head_server_port"
            )
        return self


def gym_shards(gym: NemoGymConfig) -> list[Any]:
    """`env.nemo_gym.shards` as `GymShard`s (plain values for the environment's builder)."""
    from tempering.utils.gym_shards import GymShard

    return [
        GymShard(s.name, tuple(s.entries), s.replicas, dict(s.extra_config)) for s in gym.shards
    ]


class EnvConfig(Section):
    task_name: str | None = Field(
        None,
        description="score every problem with this environment (e.g. arithmetic_retry, "
        "calculator) instead of the dataset's own (arithmetic, math)",
    )
    math: MathEnvConfig = MathEnvConfig()
    arithmetic_retry: ArithmeticRetryEnvConfig = ArithmeticRetryEnvConfig()
    calculator: CalculatorEnvConfig = CalculatorEnvConfig()
    nemo_gym: NemoGymConfig = NemoGymConfig()
    reward_fn: str | list[str] | None = Field(
        None,
        description="dotted path 'pkg.mod:fn' to a custom reward, or a list of them whose "
        "rewards are summed (weighted by reward_weights)",
    )
    reward_weights: list[float] | None = Field(
        None, description="one weight per env.reward_fn entry (null: 1.0 each)"
    )
    reward_model_path: str | None = Field(
        None, description="a trained RM folder (task reward_model)"
    )

    @model_validator(mode="after")
    def _weights(self) -> EnvConfig:
        fns = [self.reward_fn] if isinstance(self.reward_fn, str) else self.reward_fn or []
        if isinstance(self.reward_fn, list) and not fns:
            raise ValueError("env.reward_fn=[] names no function: give one or more, or null")
        if self.reward_weights is not None and len(self.reward_weights) != len(fns):
            raise ValueError(
                f"env.reward_weights={self.reward_weights} has {len(self.reward_weights)} "
                f"weights for {len(fns)} env.reward_fn entries: give one weight per function"
            )
        return self


class FaultToleranceConfig(Section):
    max_restarts: int = Field(
        0,
        ge=0,
        description="restart the worker groups and resume from the last checkpoint in the same "
        "process after a dead worker or an expired deadline, this many times (needs "
        "checkpointing.enabled)",
    )
