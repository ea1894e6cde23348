"""Every config key is read or rejected (house rule 4), checked per master config.

For each master config (SFT, DPO, RM, GRPO) the scan walks the section tree (``policy``,
``policy.generation.http_server``, ``data``, ``grpo``, ...) and asks, for every field, whether
the code that config reaches reads it: ``ALGORITHM_MODULES`` names the modules each algorithm
hands its config to, ``SECTION_MODULES`` the shared modules a section is handed on to. A read
is found with ``ast`` and a small type inference (parameter annotations, dataclass fields,
assignments, attribute chains through the schemas), so ``logger_cfg.tensorboard.log_dir`` is a
read of TensorboardConfig.log_dir while ``logger_cfg.log_dir`` is not. Where code holds a
section as ``Any`` (``UNTYPED``), the table says what it holds. A read with no known receiver
(``x.field``, or the string ``"field"``) counts only for a field name no other section of that
master has. ``.model_dump()`` or a section's own method reads the whole section.

A field is also answered when the master refuses it: a data key in the master's
``UNREAD_DATA_KEYS`` (each checked to be refused), or a NeMo RL key accepted only at the value
we implement (``REFUSED_UNLESS_DEFAULT``). The behaviour tests below check that the keys this
scan once missed do what they say.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest
from pydantic import BaseModel

from tempering.config import schemas
from tempering.config.loader import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
MASTERS = (
    schemas.SFTMasterConfig,
    schemas.DPOMasterConfig,
    schemas.KTOMasterConfig,
    schemas.RMMasterConfig,
    schemas.GRPOMasterConfig,
    schemas.DistillationMasterConfig,
)

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
SINGLE_VALUE = {"policy.sequence_packing.algorithm"}

_SHARED = ("tempering/algorithms/common.py", "tempering/distributed/placement.py")
_PREFERENCE = (
    *_SHARED,
    "tempering/algorithms/preference.py",
    "tempering/data/preference_datasets.py",
    "tempering/data/collate.py",
)
# The modules each algorithm hands its master config to (its own code path).
ALGORITHM_MODULES: dict[type, tuple[str, ...]] = {
    schemas.SFTMasterConfig: (
        *_SHARED,
        "tempering/algorithms/sft.py",
        "tempering/data/sft_datasets.py",
        "tempering/data/collate.py",
        "examples/run_sft.py",
    ),
    schemas.DPOMasterConfig: (
        *_PREFERENCE,
        "tempering/algorithms/dpo.py",
        "tempering/evaluation.py",
        "examples/run_dpo.py",
    ),
    schemas.KTOMasterConfig: (
        *_PREFERENCE,
        "tempering/algorithms/kto.py",
        "tempering/algorithms/dpo.py",  # its greedy accuracy
        "tempering/data/unpaired.py",
        "tempering/evaluation.py",
        "examples/run_kto.py",
    ),
    schemas.RMMasterConfig: (*_PREFERENCE, "tempering/algorithms/rm.py", "examples/run_rm.py"),
    schemas.GRPOMasterConfig: (
        *_SHARED,
        "tempering/algorithms/grpo.py",
        "tempering/algorithms/grpo_learning.py",
        "tempering/algorithms/async_grpo.py",
        "tempering/algorithms/launch.py",
        "tempering/algorithms/dynamic_sampling.py",
        "tempering/algorithms/advantages.py",
        "tempering/algorithms/ppo_critic.py",
        "tempering/experience/*.py",
        "tempering/data/problems.py",
        "tempering/data/grpo_problems.py",
        "tempering/data/prompts.py",
        "tempering/data/nemo_gym.py",
        "tempering/algorithms/grpo_scoring.py",
        "tempering/algorithms/grpo_blend.py",
        "tempering/data/blend.py",
        "examples/run_grpo_*.py",
    ),
}
# Distillation hands its rollouts to GRPO's code (through `as_grpo_config`), then its own.
ALGORITHM_MODULES[schemas.DistillationMasterConfig] = (
    *ALGORITHM_MODULES[schemas.GRPOMasterConfig],
    "tempering/config/distillation_sections.py",
    "tempering/algorithms/distillation.py",
)
# Shared code a section is handed on to, whichever algorithm hands it (nested sections inherit
# their parent's modules).
SECTION_MODULES: dict[str, tuple[str, ...]] = {
    "DeadlinesConfig": ("tempering/distributed/deadlines.py",),
    "ClusterConfig": ("tempering/distributed/virtual_cluster.py",),
    "LoggerConfig": ("tempering/utils/logger.py",),
    "GenerationConfig": ("tempering/models/generation/*.py",),
    "HttpServerConfig": ("tempering/models/generation/*.py", "tempering/utils/serving.py"),
    "LossFnConfig": ("tempering/losses.py", "tempering/algorithms/grpo.py"),
    "EnvConfig": ("tempering/environments/*.py",),
}
MASTER, ALGORITHM = "<master>", "<algorithm section>"
# What code holds as Any: (module glob, name) -> the section; MASTER is the master config
# being checked, ALGORITHM its own section (cfg.dpo for DPO). A name is a parameter or
# variable without a known type, or "Class.attribute".
UNTYPED: dict[tuple[str, str], str] = {
    ("tempering/distributed/placement.py", "cfg"): MASTER,
    ("tempering/distributed/placement.py", "gen_cfg"): "GenerationConfig",
    ("tempering/algorithms/common.py", "cfg"): MASTER,
    ("tempering/algorithms/launch.py", "cfg"): MASTER,
    ("tempering/algorithms/preference.py", "cfg"): MASTER,
    ("tempering/algorithms/preference.py", "PreferenceRun.cfg"): MASTER,
    ("tempering/algorithms/preference.py", "PreferenceRun.section"): ALGORITHM,
    ("tempering/algorithms/preference.py", "section"): ALGORITHM,
    ("tempering/environments/nemo_gym.py", "gym"): "NemoGymConfig",
    ("tempering/environments/nemo_gym_instances.py", "gym"): "NemoGymConfig",
}

SECTIONS: dict[str, type[BaseModel]] = {
    name: cls
    for name, cls in inspect.getmembers(schemas, inspect.isclass)
    if issubclass(cls, schemas.Section) and cls is not schemas.Section
}


def _section_of(annotation: object) -> str | None:
    return annotation.__name__ if annotation in SECTIONS.values() else None  # type: ignore


def section_tree(master: type[BaseModel]) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(dotted key, section class name, field, the section's chain of class names)."""
    out = []

    def walk(cls: type[BaseModel], prefix: str, chain: tuple[str, ...]) -> None:
        for field, info in cls.model_fields.items():
            sub = _section_of(info.annotation)
            if sub is not None:
                walk(SECTIONS[sub], f"{prefix}{field}.", (*chain, sub))
            else:
                out.append((f"{prefix}{field}", cls.__name__, field, chain))

    walk(master, "", (master.__name__,))
    return out


def read_sources() -> dict[str, str]:
    files = [*REPO.joinpath("tempering").rglob("*.py"), *REPO.joinpath("examples").glob("*.py")]
    return {str(p.relative_to(REPO)): p.read_text() for p in files}


def _matching(sources: dict[str, str], globs: tuple[str, ...]) -> list[str]:
    from fnmatch import fnmatch

    return sorted(p for p in sources if any(fnmatch(p, g) for g in globs))


class _Reads:
    """What one module reads: typed (section, field), whole sections, untyped names."""

    def __init__(self) -> None:
        self.typed: set[tuple[str, str]] = set()
        self.whole: set[str] = set()
        self.untyped: set[str] = set()


def _annotation_section(node: ast.AST | None, aliases: dict[str, str]) -> str | None:
    """The section (or this module's class, in ``aliases`` too) an annotation names."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _annotation_section(ast.parse(node.value, mode="eval").body, aliases)
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        return node.attr if node.attr in SECTIONS else None
    if isinstance(node, ast.BinOp):  # X | None
        return _annotation_section(node.left, aliases) or _annotation_section(node.right, aliases)
    if isinstance(node, ast.Subscript):  # Optional[X]
        return _annotation_section(node.slice, aliases)
    return None


@functools.lru_cache(maxsize=1024)
def module_reads(path: str, text: str, master: type[BaseModel]) -> _Reads:
    """The config reads in one module's source, with ``master`` as what UNTYPED's MASTER
    stands for."""
    from fnmatch import fnmatch

    tree = ast.parse(text)
    algo = next(
        _section_of(i.annotation)
        for f, i in master.model_fields.items()
        if f not in schemas._Master.model_fields and _section_of(i.annotation)
    )
    untyped = {
        name: {MASTER: master.__name__, ALGORITHM: algo}.get(kind, kind)
        for (glob, name), kind in UNTYPED.items()
        if fnmatch(path, glob)
    }
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tempering.config"):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in SECTIONS})
    for name, cls in inspect.getmembers(schemas, inspect.isclass):
        if cls in MASTERS or name in SECTIONS:
            aliases.setdefault(name, name)
    for node in ast.walk(tree):  # this module's classes (GRPORun.cfg, ...) are types too
        if isinstance(node, ast.ClassDef):
            aliases.setdefault(node.name, node.name)
    class_attrs: dict[str, dict[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            attrs = class_attrs.setdefault(node.name, {})
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = item.target.id
                    t = _annotation_section(item.annotation, aliases)
                    attrs[name] = t or untyped.get(f"{node.name}.{name}", "")
                elif isinstance(item, ast.FunctionDef):
                    attrs[item.name] = untyped.get(f"{node.name}.{item.name}", "")

    def typeof(node: ast.AST, env: dict[str, str]) -> str | None:
        if isinstance(node, ast.Name):
            return env.get(node.id) or untyped.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = typeof(node.value, env)
            if owner in SECTIONS:
                info = SECTIONS[owner].model_fields.get(node.attr)
                return _section_of(info.annotation) if info else None
            return class_attrs.get(owner or "", {}).get(node.attr) or None
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in aliases:
                return aliases[node.func.id]
            if isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
                owner = typeof(node.args[0], env)
                if owner == master.__name__ and not isinstance(node.args[1], ast.Constant):
                    return algo  # getattr(cfg, name): the algorithm's own section
            return None
        if isinstance(node, ast.BoolOp):
            return next((t for v in node.values if (t := typeof(v, env))), None)
        if isinstance(node, ast.IfExp):
            return typeof(node.body, env) or typeof(node.orelse, env)
        return None

    def bind(target: ast.AST, value: ast.AST, env: dict[str, str]) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts, strict=False):
                bind(t, v, env)
        elif isinstance(target, ast.Name) and (t := typeof(value, env)):
            env[target.id] = t

    reads = _Reads()

    def scan(scope: ast.AST, outer: dict[str, str]) -> None:
        env = dict(outer)
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = scope.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                t = _annotation_section(getattr(arg, "annotation", None), aliases)
                if t or arg.arg in untyped:
                    env[arg.arg] = t or untyped[arg.arg]
        body = [n for n in ast.walk(scope) if n is not scope]
        for _ in range(3):  # assignments, to a fixed point (flow-insensitive)
            for n in body:
                if isinstance(n, ast.Assign):
                    for target in n.targets:
                        bind(target, n.value, env)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    if t := _annotation_section(n.annotation, aliases):
                        env[n.target.id] = t
                elif isinstance(n, ast.NamedExpr):
                    bind(n.target, n.value, env)
        for n in body:
            if isinstance(n, ast.Attribute):
                owner = typeof(n.value, env)
                if owner in SECTIONS:
                    if n.attr in SECTIONS[owner].model_fields:
                        reads.typed.add((owner, n.attr))
                    elif n.attr == "model_dump" or hasattr(SECTIONS[owner], n.attr):
                        reads.whole.add(owner)  # its own method (as_phases) or a dump
                elif owner is None:
                    reads.untyped.add(n.attr)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                reads.untyped.add(n.value)

    for node in ast.walk(tree):  # every function with its own names, then the module
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            scan(node, {})
    scan(tree, {})
    return reads


def unread_fields(master: type[BaseModel], sources: dict[str, str]) -> list[str]:
    """The dotted keys of ``master`` that its code path neither reads nor refuses."""
    tree = section_tree(master)
    counts: dict[str, int] = {}
    for _key, _, field, _ in tree:
        counts[field] = counts.get(field, 0) + 1
    unread = []
    for key, section, field, chain in tree:
        if key in SINGLE_VALUE or key in REFUSED_UNLESS_DEFAULT:
            continue
        if key in getattr(master, "UNREAD_KEYS", {}):
            continue
        globs = ALGORITHM_MODULES[master] + sum(
            (SECTION_MODULES.get(s, ()) for s in (*chain, section)), ()
        )
        found = False
        for path in _matching(sources, globs):
            r = module_reads(path, sources[path], master)
            if (section, field) in r.typed or section in r.whole:
                found = True
            elif counts[field] == 1 and field in r.untyped:
                found = True
            if found:
                break
        if not found:
            unread.append(key)
    return unread


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return read_sources()


@pytest.mark.parametrize("master", MASTERS, ids=lambda m: m.__name__)
def test_every_field_is_read_or_refused_per_algorithm(master, sources):
    unread = unread_fields(master, sources)
    assert not unread, (
        f"{master.__name__} accepts keys its code path never reads (read them where this "
        f"algorithm uses the config, or refuse them): {unread}"
    )


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


ASYNC_SPLIT = ["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false"]


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["grpo.async_grpo.enabled=true"], "colocated.enabled=false"),
        ([*ASYNC_SPLIT, "grpo.use_dynamic_sampling=true"], "use_dynamic_sampling"),
        (["grpo.async_grpo.in_flight_weight_updates=true"], "grpo.async_grpo.enabled=true"),
        ([*ASYNC_SPLIT, "grpo.async_grpo.in_flight_weight_updates=true",
          "policy.generation.backend=vllm"], "backend='vllm'"),
    ],
)  # fmt: skip
def test_async_grpo_refuses_what_it_cannot_do_with_the_fix(overrides, names):
    config = REPO / "examples" / "configs" / "grpo_math_tiny.yaml"
    with pytest.raises(ConfigError, match=names.replace(".", r"\.").replace("[", r"\[")):
        load_config(config, overrides, schema=schemas.GRPOMasterConfig)


def test_in_flight_weight_updates_load_with_async_and_the_torch_engine():
    config = REPO / "examples" / "configs" / "grpo_math_tiny.yaml"
    cfg, _ = load_config(
        config, [*ASYNC_SPLIT, "grpo.async_grpo.in_flight_weight_updates=true"],
        schema=schemas.GRPOMasterConfig,
    )  # fmt: skip
    assert cfg.grpo.async_grpo.in_flight_weight_updates


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


def _mutated(sources: dict[str, str], path: str, read: str, replacement: str) -> dict[str, str]:
    assert read in sources[path], f"{path} no longer contains {read!r}: update this test"
    return {**sources, path: sources[path].replace(read, replacement)}


# (master, module, a real read in it, what replaces it, the key that then goes unread)
MUTATIONS = [
    (schemas.GRPOMasterConfig, "tempering/algorithms/grpo.py", "cfg.grpo.max_num_epochs", "100",
     "grpo.max_num_epochs"),
    (schemas.DPOMasterConfig, "tempering/algorithms/preference.py", "data_cfg.prompt_key",
     '"prompt"', "data.prompt_key"),
    (schemas.RMMasterConfig, "tempering/algorithms/preference.py", "data_cfg.prompt_key",
     '"prompt"', "data.prompt_key"),
    (schemas.SFTMasterConfig, "tempering/algorithms/sft.py", "data_cfg.prompt_key", '"prompt"',
     "data.prompt_key"),
    (schemas.SFTMasterConfig, "tempering/algorithms/common.py", "logger_cfg.tensorboard.log_dir",
     "logger_cfg.log_dir", "logger.tensorboard.log_dir"),
]  # fmt: skip


@pytest.mark.parametrize("master,path,read,replacement,key", MUTATIONS, ids=lambda x: str(x))
def test_the_scan_reports_a_deleted_read(master, path, read, replacement, key, sources):
    """The scan is not blind: delete one real read from the real sources and it names the key
    (and only for the algorithm whose read was deleted: SFT still reads its data.prompt_key
    when DPO's goes)."""
    assert key not in unread_fields(master, sources)
    assert key in unread_fields(master, _mutated(sources, path, read, replacement))


def test_a_read_by_another_algorithm_does_not_count(sources):
    """data.prompt_key read by SFT's code does not answer for DPO: with DPO/KTO/RM's read gone,
    DPO, KTO and RM report it while SFT and GRPO (which refuses it) do not."""
    mutated = _mutated(sources, "tempering/algorithms/preference.py", "data_cfg.prompt_key", "0")
    reported = {m: "data.prompt_key" in unread_fields(m, mutated) for m in MASTERS}
    assert reported == {schemas.SFTMasterConfig: False, schemas.DPOMasterConfig: True,
                        schemas.KTOMasterConfig: True, schemas.RMMasterConfig: True, schemas.GRPOMasterConfig: False,
                        schemas.DistillationMasterConfig: False}  # fmt: skip


EXAMPLE = {
    schemas.SFTMasterConfig: "sft.yaml",
    schemas.DPOMasterConfig: "dpo.yaml",
    schemas.KTOMasterConfig: "kto.yaml",
    schemas.RMMasterConfig: "rm.yaml",
    schemas.GRPOMasterConfig: "grpo_math_tiny.yaml",
    schemas.DistillationMasterConfig: "distillation_math_tiny.yaml",
}


def _other_value(master: type[BaseModel], key: str) -> object:
    section, field = key.split(".")
    default = getattr(master.model_fields[section].default, field)
    if isinstance(default, str):
        return f"{default}_x"
    if key == "data.blend":  # a list of entries (GRPO's weighted blend)
        return [{"dataset_name": "gsm8k"}]
    others = {bool: not default, int: (default or 0) + 1, list: ["basic_arithmetic"]}
    return others.get(type(default), "other_column")


@pytest.mark.parametrize(
    "master,key",
    [(m, k) for m in MASTERS for k in sorted(getattr(m, "UNREAD_KEYS", {}))],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_keys_an_algorithm_does_not_read_are_refused_by_name(master, key):
    import yaml

    value = _other_value(master, key)
    override = f"{key}={yaml.safe_dump(value, default_flow_style=True).splitlines()[0]}"
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "examples/configs" / EXAMPLE[master], [override], schema=master)
    said = f"{key}=[BlendEntryConfig(" if key == "data.blend" else f"{key}={value!r}"
    assert said in str(info.value) and "does not read it" in str(info.value)


@pytest.mark.parametrize(
    "master,dataset,key",
    [
        (schemas.SFTMasterConfig, "squad", "data.prompt_key"),
        (schemas.SFTMasterConfig, "messages", "data.response_key"),
        (schemas.DPOMasterConfig, "helpsteer3", "data.prompt_key"),
        (schemas.RMMasterConfig, "messages_preference", "data.prompt_key"),
        (schemas.GRPOMasterConfig, "arithmetic", "data.problem_key"),
        (schemas.SFTMasterConfig, "messages", "data.split_long_texts"),
    ],
)
def test_a_column_key_the_dataset_format_lacks_is_refused(master, dataset, key):
    path = [] if dataset == "arithmetic" else ["data.train_data_path=/some/file.jsonl"]
    overrides = [f"data.dataset_name={dataset}", *path]
    load_config(REPO / "examples/configs" / EXAMPLE[master], overrides, schema=master)  # fine
    value, shown, lacks = ("true", "True", "no plain text") if key.endswith("texts") else (
        "question", "'question'", "no such column")  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "examples/configs" / EXAMPLE[master], [*overrides, f"{key}={value}"],
                    schema=master)  # fmt: skip
    assert f"{key}={shown}" in str(info.value) and f"{dataset!r} has {lacks}" in str(info.value)


def test_column_keys_are_accepted_where_the_format_has_them():
    for master, dataset, keys in [
        (schemas.SFTMasterConfig, "prompt_response", ("prompt_key", "response_key")),
        (schemas.DPOMasterConfig, "preference", ("prompt_key",)),
        (schemas.RMMasterConfig, "preference", ("prompt_key",)),
        (schemas.GRPOMasterConfig, "problems", ("problem_key", "answer_key")),
    ]:
        overrides = [f"data.dataset_name={dataset}", "data.train_data_path=/some/file.jsonl"]
        cfg, _ = load_config(
            REPO / "examples/configs" / EXAMPLE[master],
            [*overrides, *(f"data.{k}=q" for k in keys)],
            schema=master,
        )
        assert all(getattr(cfg.data, k) == "q" for k in keys)


# ------------------------------------------------------------ the keys the old scan missed
def test_tensorboard_log_dir_receives_the_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tempering.algorithms.common import build_logger

    cfg = schemas.LoggerConfig(
        log_dir=str(tmp_path / "run"), tensorboard={"log_dir": str(tmp_path / "tb")}
    )
    with build_logger(cfg, {}) as logger:
        logger.log_metrics({"loss": 0.5}, step=1, prefix="train")
    assert not (tmp_path / "run" / "tensorboard").exists()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [0.5]


def test_preference_prompt_key_names_the_prompt_column(tmp_path):
    """DPO and RM read their pairs through load_preference_data: data.prompt_key names the
    prompt column of the `preference` format (NeMo RL's BinaryPreferenceDataset prompt_key)."""
    import json

    from tempering.algorithms.preference import load_preference_data

    rows = [{"question": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(4)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = schemas.DataConfig(
        dataset_name="preference", train_data_path=str(path), prompt_key="question",
        num_val_samples=1,
    )  # fmt: skip
    loaded = load_preference_data(data)
    prompts = sorted(p.prompt[0]["content"] for p in [*loaded.train, *loaded.val])
    assert prompts == ["q0", "q1", "q2", "q3"]


class _Recorder:
    """Stands in for the policy and logger of a loop: records what each step trains on."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def train(self, batch, loss_fn):
        self.batches.append(list(batch))
        return {"loss": 0.0}

    def log_metrics(self, metrics, step, prefix=""):
        return metrics


def _loader(n: int, batch: int):
    from tempering.data.dataloader import StatefulDataLoader

    return StatefulDataLoader(list(range(n)), batch, seed=0)


def test_grpo_stops_after_max_num_epochs(tmp_path, monkeypatch):
    """grpo.max_num_epochs=2 over 6 problems, 2 per step: 6 steps (each problem drawn twice)
    although max_num_steps allows 50, and the summary counts the passes."""
    from tempering.algorithms import common, grpo

    cfg = schemas.GRPOMasterConfig(
        grpo={"max_num_epochs": 2, "max_num_steps": 50, "val_period": 0,
              "num_prompts_per_step": 2, "num_generations_per_prompt": 16},
        logger={"log_dir": str(tmp_path), "monitor_gpus": False},
    )  # fmt: skip
    rec = _Recorder()
    monkeypatch.setattr(grpo, "grpo_step", lambda run, loss, step: {"n": rec.batches.append(
        run.dataloader.next_batch())})  # fmt: skip
    monkeypatch.setattr(common, "export_final_model", lambda policy, ckpt, lora: tmp_path / "final")
    run = grpo.GRPORun(cfg, {}, None, [], [], _loader(6, 2), None, None, None, {}, rec, None, 0,
                       None, None)  # fmt: skip
    summary = grpo.train(run)
    assert summary["steps"] == 6 and summary["epochs"] == 2
    assert sorted(x for b in rec.batches for x in b) == sorted(list(range(6)) * 2)


def test_sft_and_preference_stop_after_exactly_max_num_epochs(tmp_path, monkeypatch):
    """max_num_epochs=1 over 3 batches is 3 steps, not a 4th from the second pass."""
    from tempering.algorithms import common, preference, sft

    monkeypatch.setattr(common, "export_final_model", lambda policy, ckpt, lora: tmp_path / "final")
    loop = {"max_num_epochs": 1, "max_num_steps": 50, "val_period": 0}
    logger = {"log_dir": str(tmp_path), "monitor_gpus": False}
    rec = _Recorder()
    cfg = schemas.SFTMasterConfig(sft=loop, logger=logger)
    run = sft.SFTRun(cfg, {}, None, None, _loader(6, 2), rec, None, None, rec, None, 0)
    sft.train(run)
    assert run.final_step == 3 and sorted(x for b in rec.batches for x in b) == list(range(6))

    pref = preference.PreferenceRun(
        schemas.DPOMasterConfig(dpo=loop, logger=logger), {}, "dpo", None, None,
        _loader(6, 2), None, logger=rec,
    )  # fmt: skip
    seen: list = []
    step, _, _ = preference.train_loop(pref, lambda b: seen.append(b) or {}, None, ())
    assert step == 3 and sorted(x for b in seen for x in b) == list(range(6))


@pytest.mark.parametrize(
    "master,key",
    [
        (schemas.GRPOMasterConfig, "data.prompt_key"),
        (schemas.GRPOMasterConfig, "data.response_key"),
        (schemas.DPOMasterConfig, "data.response_key"),
        (schemas.RMMasterConfig, "data.response_key"),
    ],
)
def test_prompt_and_response_keys_are_refused_where_never_read(master, key):
    """The keys the old scan passed because SFT reads them: GRPO problems have problem/answer
    columns and preference rows chosen/rejected ones, so setting these is an error."""
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "examples/configs" / EXAMPLE[master], [f"{key}=question"],
                    schema=master)  # fmt: skip
    assert f"{key}='question'" in str(info.value) and "does not read it" in str(info.value)
