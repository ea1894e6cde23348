"""In-flight weight updates (async GRPO's ``in_flight_weight_updates``) across Ray: a refit
reaches a torch generation worker while it generates, the new weights load between two
decode steps, and every token of the running batch records the version that produced it.

The worker is the real `TorchGenerationWorker` in a real worker group (two calls at a time);
the refit is `SplitGeneration.refit` streaming buckets through the object store. The policy
side is a stand-in holding a state dict (the FSDP2 policy's `refit.buckets`/`refit.bucket`
are tested in test_lm_policy.py), so no policy workers start.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models import tiny_arith

pytestmark = pytest.mark.timeout(300)

ROWS, NEW_TOKENS = 48, 100  # an untrained model rarely stops: ~100 decode steps per call


class _StateDictRefit:
    """The policy's refit handle (`RefittablePolicy.refit`) over a plain state dict."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def buckets(self, limit_bytes: int) -> list[list[str]]:
        names = list(self.state)
        return [names[: len(names) // 2], names[len(names) // 2 :]]  # two buckets

    def bucket(self, names: list[str], dtype: str | None) -> tuple[object, int]:
        import ray

        part = {n: self.state[n] for n in names}
        return ray.put(part), sum(t.numel() * t.element_size() for t in part.values())


def _policy(seed: int, path) -> SimpleNamespace:
    from transformers import LlamaForCausalLM

    tiny_arith.build_untrained(path, seed=seed)
    return SimpleNamespace(
        refit=_StateDictRefit(LlamaForCausalLM.from_pretrained(path).state_dict())
    )


@pytest.fixture(scope="module")
def generation(ray_session, tmp_path_factory):
    from tempering.distributed.virtual_cluster import RayVirtualCluster
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
    from tempering.models.generation.builders import TORCH_WORKER_FQN, SplitGeneration

    path = tiny_arith.build_untrained(tmp_path_factory.mktemp("gen_model"), seed=0)
    sampling = {"temperature": 1.0, "max_new_tokens": NEW_TOKENS, "seed": 0}
    builder = RayWorkerBuilder(TORCH_WORKER_FQN, str(path), sampling, num_threads=1, in_flight=True)
    cluster = RayVirtualCluster([1], num_cpus_per_bundle=1, name="in_flight_test")
    group = RayWorkerGroup(cluster, builder, name_prefix="gen-inflight", max_concurrency=2)
    gen = SplitGeneration(group, cluster, in_flight=True)
    yield gen
    gen.shutdown()


def _prompts() -> BatchedDataDict:
    tok = tiny_arith.build_tokenizer()
    ids = tok("Q: 12+34=? A:", add_special_tokens=False, return_tensors="pt")["input_ids"]
    return BatchedDataDict(
        input_ids=ids.repeat(ROWS, 1), input_lengths=torch.full((ROWS,), ids.shape[1])
    )


def _generated_versions(out: BatchedDataDict) -> list[list[int]]:
    v = out["token_weight_versions"]
    return [row[row >= 0].tolist() for row in v]


def test_a_refit_lands_between_decode_steps_of_a_running_batch(generation, tmp_path):
    group = generation.worker_group
    new_weights = _policy(seed=1, path=tmp_path / "new")
    data = _prompts()
    # Idle: the refit loads at once, and every token of the next call carries its version.
    generation.refit(new_weights, version=1)
    out = generation.generate(data)
    assert {v for row in _generated_versions(out) for v in row} == {1}

    mixed = []
    for version in range(2, 5):  # a generation may (rarely) end before the refit arrives
        result: list[BatchedDataDict] = []
        call = threading.Thread(target=lambda out=result: out.append(generation.generate(data)))
        call.start()
        deadline = time.monotonic() + 60
        while not group.get_all_worker_results([group.run_single_worker(0, "is_generating")])[0]:
            assert call.is_alive() and time.monotonic() < deadline, "generate never started"
        generation.refit(new_weights, version=version)  # while the batch decodes
        call.join(120)
        rows = _generated_versions(result[0])
        for row in rows:  # each row: old version, then the new one from one step on
            assert row == sorted(row) and set(row) <= {version - 1, version}, row
        if any(version - 1 in row and version in row for row in rows):
            mixed.append(version)
            break
    assert mixed, "no refit landed inside a running generation in 3 tries"
