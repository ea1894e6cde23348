"""`start_generation`: the generator takes the policy's weights once, as the version the run
starts at (fast tier). Before, split workers took the model files' weights as version 0 as
they were built and a resumed run then refitted them again with the checkpoint's: two full
weight transfers per resume.

And how a GRPO run starts its generator: split workers at the same time as the policy's
(`common.build_beside`), with a failed start of either leaving nothing of the other behind.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from tempering.algorithms.common import build_beside
from tempering.models.generation.builders import (
    ColocatedGeneration,
    SplitGeneration,
    needs_policy_workers,
    start_generation,
)


class _Chat:
    """The chat service's refit contract: run ``load_weights``, then keep ``version``."""

    def __init__(self) -> None:
        self.weight_version = None

    def refit(self, load_weights, version=None):
        load_weights()
        self.weight_version = version


def _generation(cls):
    gen = cls.__new__(cls)  # no workers: only `refit` is called, and recorded
    gen.refits = []
    gen.refit = lambda policy, version=None: gen.refits.append((policy, version))
    return gen


@pytest.mark.parametrize("step", [0, 6])
def test_split_workers_take_the_policy_weights_once_as_the_start_version(step):
    chat, gen, policy = _Chat(), _generation(SplitGeneration), object()
    start_generation(chat, gen, policy, step)
    assert gen.refits == [(policy, step)] and chat.weight_version == step


def test_colocated_engines_refit_only_on_resume():
    chat, gen, policy = _Chat(), _generation(ColocatedGeneration), object()
    start_generation(chat, gen, policy, 0)  # built as copies of the policy's own weights
    assert gen.refits == [] and chat.weight_version is None
    start_generation(chat, gen, policy, 4)  # the checkpoint's weights reached the policy only
    assert gen.refits == [(policy, 4)] and chat.weight_version == 4


def test_building_a_generator_moves_no_weights():
    import inspect

    from tempering.models.generation import builders

    # the refit belongs to `start_generation`, after the checkpoint is loaded
    assert ".refit(" not in inspect.getsource(builders.build_generation)


@pytest.mark.parametrize(
    "backend,colocated,on_policy_gpus,needs",
    [("torch", True, None, True), ("torch", False, None, False),
     ("vllm", True, "policy", True), ("vllm", False, None, False)],
)  # fmt: skip
def test_only_generators_in_the_policys_workers_wait_for_them(
    backend, colocated, on_policy_gpus, needs
):
    gen = SimpleNamespace(backend=backend, colocated=SimpleNamespace(enabled=colocated))
    plan = SimpleNamespace(generation=SimpleNamespace(colocated_with=on_policy_gpus))
    assert needs_policy_workers(SimpleNamespace(generation=gen), plan) is needs


def test_the_two_builds_run_at_the_same_time():
    started = threading.Event()

    def here():  # returns only once the other build has started
        assert started.wait(timeout=30), "the second build did not start beside the first"
        return "policy"

    assert build_beside(here, lambda: started.set() or "generation") == ("policy", "generation")


class _Group:
    def __init__(self, name: str) -> None:
        self.name, self.shut = name, False

    def shutdown(self) -> None:
        self.shut = True


@pytest.mark.parametrize("failing", ["here", "beside"])
def test_a_failed_start_shuts_down_what_the_other_built(failing):
    policy, generation = _Group("policy"), _Group("generation")

    def build(group):
        def run():
            if group.name == ("policy" if failing == "here" else "generation"):
                raise RuntimeError(f"{group.name} failed to start")
            return (group, None) if group is policy else group  # (policy, no critic)

        return run

    with pytest.raises(RuntimeError, match="failed to start"):
        build_beside(build(policy), build(generation))
    survivor = generation if failing == "here" else policy
    assert survivor.shut, f"{survivor.name} left running after the other failed"
