"""`start_generation`: the generator takes the policy's weights once, as the version the run
starts at (fast tier). Before, split workers took the model files' weights as version 0 as
they were built and a resumed run then refitted them again with the checkpoint's: two full
weight transfers per resume."""

from __future__ import annotations

import pytest

from tempering.models.generation.builders import (
    ColocatedGeneration,
    SplitGeneration,
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
