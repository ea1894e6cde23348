"""Every config key is read or rejected (house rule 4).

A static scan: each field of every schema section must be read somewhere in tempering/ or
examples/ (as ``.name`` or ``"name"``) -- or be one of the NeMo RL keys accepted only at the
value we implement, which must then refuse any other value with a message naming the key.
The scan cannot prove a read reaches the right place (the behaviour tests do that); it catches
a key added to a schema and never wired in.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tempering.config import schemas
from tempering.config.loader import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]

# key path -> a value that is not implemented (each must be refused).
REFUSED_UNLESS_DEFAULT = {
    "policy.dtensor_cfg.enabled": False,
    "policy.dtensor_cfg.cpu_offload": True,
    "policy.dtensor_cfg.sequence_parallel": True,
    "policy.dynamic_batching.sequence_length_round": 64,
    "policy.generation_batch_size": 32,
    "data.max_input_seq_length": 1024,
}
# Fields whose only allowed value is their default (a Literal of one), so nothing to read.
SINGLE_VALUE = {"SequencePackingConfig.algorithm"}
# Sections read whole (by a method beside the fields in schemas.py, which the scan skips);
# each has its own behavioural test below that every field reaches the code.
READ_WHOLE = {"DeadlinesConfig"}


def _sources() -> str:
    files = [*REPO.joinpath("tempering").rglob("*.py"), *REPO.joinpath("examples").rglob("*.py")]
    return "\n".join(p.read_text() for p in files if p.name != "schemas.py")


def test_every_field_is_read_or_refused():
    src = _sources()
    refused_names = {k.rsplit(".", 1)[1] for k in REFUSED_UNLESS_DEFAULT}
    unread = []
    for name, cls in inspect.getmembers(schemas, inspect.isclass):
        if not issubclass(cls, schemas.Section) or cls is schemas.Section or name in READ_WHOLE:
            continue
        for field in cls.model_fields:
            if f"{name}.{field}" in SINGLE_VALUE or field in refused_names:
                continue
            if not re.search(rf"\.{field}\b|[\"']{field}[\"']", src):
                unread.append(f"{name}.{field}")
    assert not unread, f"config fields no code reads (implement or refuse them): {unread}"


def test_every_deadline_key_sets_its_phase(monkeypatch):
    """DeadlinesConfig is read whole (as_phases): each field must be a phase the worker groups
    wait on, and a configured value must become that phase's deadline."""
    from tempering.distributed import deadlines

    monkeypatch.setattr(deadlines, "_deadlines", dict(deadlines._deadlines))
    fields = list(schemas.DeadlinesConfig.model_fields)
    assert sorted(f.removesuffix("_s") for f in fields) == sorted(deadlines.PHASES)
    cfg = schemas.DeadlinesConfig(**{f: 10.0 + i for i, f in enumerate(fields)})
    deadlines.configure(cfg.as_phases())
    for i, f in enumerate(fields):
        assert deadlines.deadline_s(f.removesuffix("_s")) == 10.0 + i, f


@pytest.mark.parametrize("key,value", sorted(REFUSED_UNLESS_DEFAULT.items()))
def test_unimplemented_values_are_refused_by_name(key, value):
    config = REPO / "examples" / "configs" / "grpo_math_tiny.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(config, [f"{key}={str(value).lower() if isinstance(value, bool) else value}"],
                    schema=schemas.GRPOMasterConfig)  # fmt: skip
    assert key in str(info.value) and "is not supported" in str(info.value)


class _RecordingGroup:
    """Stands in for a worker group to see which budget each call gets (the workers' own
    micro-batching under a budget is tested in test_fsdp2_worker / test_sequence_packing)."""

    dp_size = 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def run_all_workers_sharded_data(self, method, data, **kwargs):
        self.calls.append((method, kwargs))
        return [data]

    def get_all_worker_results(self, futures):
        return futures

    def get_dp_results(self, futures):
        return futures


def test_logprob_token_budget_reaches_logprob_calls_only():
    import torch

    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.models.policy.lm_policy import Policy

    group = _RecordingGroup()
    policy = Policy(
        group, train_global_batch_size=2, train_micro_batch_size=1,
        max_tokens_per_microbatch=64, logprob_max_tokens_per_microbatch=4096,
    )  # fmt: skip
    data = BatchedDataDict(
        {"input_ids": torch.ones(2, 3, dtype=torch.long), "input_lengths": torch.tensor([3, 2])}
    )
    policy.get_logprobs(data)
    policy.get_reference_policy_logprobs(data)
    assert [c[1]["max_tokens_per_microbatch"] for c in group.calls] == [4096, 4096]
    assert policy.max_tokens_per_microbatch == 64  # training keeps its own budget
