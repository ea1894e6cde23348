"""Worker groups: N Ray actors of one worker class, one per bundle of a virtual cluster.

A worker class is named by its fully qualified name and is imported only inside the
worker's own interpreter: every worker is an :class:`IsolatedWorkerInitializer` actor that,
started under the class's Python environment (``actor_environments.py``), imports the class,
builds it, and runs the methods the controller names. The driver never imports the class.

    cluster = RayVirtualCluster([2], num_cpus_per_bundle=1)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("pkg.mod.MyWorker", lr=1e-3))
    refs = group.run_all_workers_sharded_data("train", batch)   # one shard per DP rank
    results = group.get_all_worker_results(refs)                # rank order
    group.shutdown()

Each worker sees RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and
MASTER_PORT, and ``TEMPERING_DIST_INIT_METHOD``, the ``init_method`` for
``torch.distributed.init_process_group``: when every worker is on the controller's node, a
``file://`` store in a private folder with gloo/NCCL sockets on the loopback interface, so the
process group listens on no network address; across nodes, ``tcp://MASTER_ADDR:MASTER_PORT``
(rank 0's store listens on MASTER_ADDR only, without authentication: keep the nodes on a
private network; docs/cluster.md). An exception in a worker
reaches the controller as :class:`WorkerError` naming the rank, node and method with the
worker's traceback; a worker that dies surfaces as :class:`WorkerDiedError`; every wait has
a deadline (by phase, see ``deadlines.py``): on expiry the workers that did not answer dump
their Python stacks to files and :class:`~tempering.distributed.deadlines.DeadlineExceeded`
names the phase, ranks, methods and those files.
"""

from __future__ import annotations

import importlib
import logging
import operator
import os
import re
import shutil
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# isort: off
# virtual_cluster first: it sets Ray's environment defaults before Ray is imported.
from tempering.distributed.virtual_cluster import RayVirtualCluster
import ray

# isort: on
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tempering import OPENMP_ENV
from tempering.distributed import deadlines
from tempering.distributed.actor_environments import get_actor_executable, resolve_python
from tempering.utils.allocator import check_allocator
from tempering.utils.threads import ThreadGovernor

if TYPE_CHECKING:
    from tempering.distributed.batched_data_dict import BatchedDataDict

logger = logging.getLogger(__name__)

# The process group's init_method for the workers (read by FSDP2PolicyWorker).
DIST_INIT_ENV = "TEMPERING_DIST_INIT_METHOD"


class WorkerError(RuntimeError):
    """A worker raised: names the group, rank, node and method, with the worker's traceback."""

    def __init__(
        self,
        message: str,
        *,
        group: str,
        rank: int,
        node_ip: str,
        node_id: str,
        method: str,
        worker_traceback: str,
    ) -> None:
        super().__init__(message)
        self.group = group
        self.rank = rank
        self.node_ip = node_ip
        self.node_id = node_id
        self.method = method
        self.worker_traceback = worker_traceback


class WorkerDiedError(WorkerError):
    """A worker process died (killed, out of memory, ``os._exit``) or failed to start."""


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _wait_for_dumps(
    paths: Sequence[Path], before: Sequence[int], wait_s: float, settle_s: float = 0.3
) -> list[Path]:
    """Wait up to ``wait_s`` for every file to grow past its size ``before`` the signal and
    hold a whole dump; return those that grew.

    faulthandler writes a dump in many small writes from a signal handler, and a worker
    descheduled on a busy machine can pause mid-dump (a dump read too early ended inside its
    first thread's first frame): a dump counts as whole once its file's size has stayed the
    same for ``settle_s``."""
    end = time.monotonic() + wait_s
    sizes = [_size(p) for p in paths]
    stable_since = time.monotonic()
    while paths and time.monotonic() < end:
        time.sleep(0.05)
        now = [_size(p) for p in paths]
        if now != sizes:
            sizes, stable_since = now, time.monotonic()
            continue
        grown = all(s > b for s, b in zip(sizes, before, strict=True))
        if grown and time.monotonic() - stable_since >= settle_s:
            break
    return [p for p, b in zip(paths, before, strict=True) if _size(p) > b]


def _signal_on_node(node_id: str) -> Any:
    """A Ray task pinned to ``node_id`` that sends the stack-dump signal to a pid there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def send(pid: int) -> None:
        os.kill(pid, deadlines.STACK_DUMP_SIGNAL)

    return ray.remote(num_cpus=0, max_retries=0)(send).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )


def bundle_of_this_actor() -> str | None:
    """``<placement group id>/<bundle index>`` this actor's resources came from, for
    diagnostics (Ray's public API does not say; its core worker names the resources
    ``bundle_group_<index>_<pg id>``); None outside a placement group or if Ray changes."""
    import re

    try:
        names = ray._private.worker.global_worker.core_worker.resource_ids()
    except Exception:
        return None
    for name in names:
        found = re.fullmatch(r"bundle_group_(\d+)_([0-9a-f]+)", name)
        if found:
            return f"{found.group(2)}/{found.group(1)}"
    return None


class RayWorkerBuilder:
    """What to build: worker class ``fqn`` with constructor arguments.

    ``py_executable`` overrides ``ACTOR_ENVIRONMENT_REGISTRY[fqn]`` for this builder only.
    """

    def __init__(self, fqn: str, *args: Any, py_executable: str | None = None, **kwargs: Any):
        if "." not in fqn:
            raise ValueError(f"worker class {fqn!r} must be a fully qualified name ('pkg.mod.Cls')")
        self.fqn = fqn
        self.args = args
        self.kwargs = kwargs
        self.py_executable = py_executable

    @property
    def executable(self) -> str:
        """The executable this builder's workers run under."""
        return self.py_executable or get_actor_executable(self.fqn)


class IsolatedWorkerInitializer:
    """The Ray actor every worker is: imports and builds the worker class in its own interpreter.

    Controller calls arrive as ``execute(method_name, *args, **kwargs)``; ``method_name`` may
    be dotted (``"component.method"``, see `execute`).
    """

    def __init__(self, fqn: str, args: tuple, kwargs: dict) -> None:
        self._stack_file = deadlines.install_stack_dump_handler(int(os.environ.get("RANK", 0)))
        module_name, _, class_name = fqn.rpartition(".")
        module = importlib.import_module(module_name)
        try:
            worker_class = getattr(module, class_name)
        except AttributeError:
            raise ImportError(
                f"module {module_name!r} has no worker class {class_name!r}"
            ) from None
        self._fqn = fqn
        self._worker = worker_class(*args, **kwargs)
        # torch threads follow the cores other processes leave free (utils/threads.py)
        self._threads = ThreadGovernor.for_this_process()

    def describe(self) -> dict[str, Any]:
        """Where this worker runs."""
        ctx = ray.get_runtime_context()
        return {
            "rank": int(os.environ["RANK"]),
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "python": sys.executable,
            "gpu_ids": [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])],
            "bundle": bundle_of_this_actor(),
            "allocator": check_allocator(),  # mimalloc or system (utils/allocator.py)
        }

    def execute(self, _method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``worker.<_method_name>(*args, **kwargs)``.

        A dotted name reaches a method of one of the worker's components: ``"refit.bucket"``
        runs ``worker.refit.bucket`` (`operator.attrgetter`). A worker with many duties keeps
        a small class that way (`FSDP2PolicyWorker`'s ``checkpoint``, ``refit`` and
        ``generation``), while every remote call still names its target in full, greppable
        at the call site."""
        try:
            method = operator.attrgetter(_method_name)(self._worker)
        except AttributeError:
            method = None
        if method is None or not callable(method):
            raise AttributeError(f"worker class {self._fqn} has no method {_method_name!r}")
        if self._threads is None:
            return method(*args, **kwargs)
        self._threads.enter()
        try:
            return method(*args, **kwargs)
        finally:
            self._threads.leave()

    def call(self, request: tuple[str, tuple, dict]) -> Any:
        """`execute` with the method name and all its arguments as one Ray argument. Ray
        serialises each argument of a remote call on its own: a train call (a batch and seven
        keywords) measured ~1 ms slower on the 2-core machine than one tuple of them, 1.5% of a
        tiny SFT step. The worker group uses `execute` where an argument is an ``ObjectRef``
        (Ray resolves those only at the top level)."""
        method, args, kwargs = request
        return self.execute(method, *args, **kwargs)

    def resource_usage(self, reset_peak: bool = False) -> dict[str, float]:
        """This process's CPU time, peak memory and GPU use (``tempering.utils.resources``);
        ``reset_peak`` then restarts its ``rss_hwm_gb`` high-water mark."""
        from tempering.utils.resources import process_usage, reset_peak_rss

        usage = process_usage()
        if reset_peak:
            reset_peak_rss()
        return usage

    def shutdown_worker(self) -> None:
        """Call the worker's own ``shutdown()`` when it has one."""
        shutdown = getattr(self._worker, "shutdown", None)
        if callable(shutdown):
            shutdown()
        deadlines.remove_if_empty(self._stack_file)


def _last_words(ray_detail: str, lines: int = 30) -> str:
    """The end of a dead worker's stderr (Ray's ``logs/worker-*-<pid>.err``), found by the
    pid in Ray's message, when its log is on this machine: a segfault's stack (Ray enables
    ``faulthandler`` in workers), a C++ abort or the OOM killer's absence show there, and the
    session folder may be gone by the time anyone looks."""
    found = re.search(r"\bpid: (\d+)", ray_detail)
    try:
        logs = Path(ray._private.worker._global_node.get_logs_dir_path())
        files = sorted(logs.glob(f"worker-*-{found.group(1)}.err")) if found else []
    except (AttributeError, OSError):  # no local node (a client) or no session folder
        files = []
    if not files:
        return "The worker's own log is under the Ray session's logs/ folder."
    text = files[-1].read_text(errors="replace").rstrip().splitlines()[-lines:]
    body = "\n".join(f"  | {line}" for line in text) if text else "  | (empty)"
    return f"The end of its stderr ({files[-1]}):\n{body}"


class RayWorkerGroup:
    """One worker per bundle of ``cluster``, addressed by rank.

    Args:
        cluster: where the workers go (one per bundle, in rank order).
        builder: which class to build, with which arguments and executable.
        name_prefix: names the group in logs and errors.
        env_vars: extra environment variables for every worker.
        num_cpus_per_worker / num_gpus_per_worker: resources each worker takes from its
            bundle (default: the whole bundle; use fractions to colocate two groups).
        start_timeout_s: how long the workers may take to start (default: the ``startup``
            phase's deadline, ``deadlines.startup_s``).
        call_timeout_s: a limit for every :meth:`get_all_worker_results` of this group;
            default None = each call's phase deadline (``deadlines.py``).
        tensor_parallel_size: workers per tensor-parallel group (consecutive ranks); they
            receive the same data shard (`dp_rank`) and return the same results.
        bundle_indices: put the workers on these bundles of ``cluster`` only (in rank
            order); default: one worker on every bundle.
        env_vars_per_rank: more environment variables, one dict per rank.
        max_concurrency: calls a worker runs at once (Ray threads; default 1: one at a
            time). Generation workers with in-flight weight updates take a refit's calls
            while a ``generate`` runs.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        builder: RayWorkerBuilder,
        name_prefix: str = "workers",
        *,
        env_vars: dict[str, str] | None = None,
        num_cpus_per_worker: float | None = None,
        num_gpus_per_worker: float | None = None,
        start_timeout_s: float | None = None,
        call_timeout_s: float | None = None,
        tensor_parallel_size: int = 1,
        bundle_indices: Sequence[int] | None = None,
        env_vars_per_rank: Sequence[dict[str, str]] | None = None,
        max_concurrency: int = 1,
    ) -> None:
        self.name = name_prefix
        self.tp_size = tensor_parallel_size
        self.fqn = builder.fqn
        self.call_timeout_s = call_timeout_s
        self._ref_info: dict[str, tuple[int, str]] = {}  # ObjectRef hex -> (rank, method)
        locations = cluster.bundle_locations()
        if bundle_indices is not None:  # a subset, e.g. one vLLM engine per TP group of GPUs
            locations = [locations[i] for i in bundle_indices]
        self._node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        self._bundle_nodes = [loc.node_id for loc in locations]

        start = time.perf_counter()
        python = resolve_python(builder.fqn, builder.executable, sorted(set(self._bundle_nodes)))
        venv_s = time.perf_counter() - start
        self._store_dir: str | None = None
        actor_class = ray.remote(IsolatedWorkerInitializer)
        envs = self._worker_envs(cluster, locations, env_vars, env_vars_per_rank)
        num_cpus = (
            cluster.num_cpus_per_bundle if num_cpus_per_worker is None else num_cpus_per_worker
        )
        num_gpus = (
            cluster.num_gpus_per_bundle if num_gpus_per_worker is None else num_gpus_per_worker
        )
        self.workers: list[ray.actor.ActorHandle] = [
            actor_class.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    loc.placement_group, placement_group_bundle_index=loc.bundle_index
                ),
                runtime_env={"py_executable": python, "env_vars": env},
                max_restarts=0,
                max_concurrency=max_concurrency,
            ).remote(builder.fqn, builder.args, builder.kwargs)
            for loc, env in zip(locations, envs, strict=True)
        ]
        self.worker_info: list[dict[str, Any]] = self._await_start(start_timeout_s)
        logger.info(
            "worker group %s: %d x %s up in %.1f s (venv %.1f s) under %s",
            self.name,
            len(self.workers),
            self.fqn,
            time.perf_counter() - start,
            venv_s,
            python,
        )

    def _worker_envs(
        self,
        cluster: RayVirtualCluster,
        locations: list[Any],
        env_vars: dict[str, str] | None,
        env_vars_per_rank: Sequence[dict[str, str]] | None,
    ) -> list[dict[str, str]]:
        """Each rank's environment: the caller's variables, then rank, world and rendezvous."""
        master_addr, master_port = cluster.get_master_address_and_port()
        dist_env = self._dist_init_env(master_addr, master_port)
        stack_dir = {k: os.environ[k] for k in (deadlines.STACK_DUMP_DIR_ENV,) if k in os.environ}
        # The driver's OpenMP waiting (tempering.OPENMP_DEFAULTS), also for workers on nodes
        # whose Ray this process did not start; the caller's env_vars may override it.
        openmp = {k: os.environ[k] for k in OPENMP_ENV if k in os.environ}
        return [
            {
                **openmp,
                **(env_vars or {}),
                **(env_vars_per_rank[rank] if env_vars_per_rank else {}),
                deadlines.GROUP_NAME_ENV: self.name,
                **stack_dir,
                "RANK": str(rank),
                "WORLD_SIZE": str(len(locations)),
                "LOCAL_RANK": str(loc.bundle_index),
                "LOCAL_WORLD_SIZE": str(cluster.bundle_ct_per_node_list[loc.node_index]),
                "NODE_RANK": str(loc.node_index),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                **dist_env,
            }
            for rank, loc in enumerate(locations)
        ]

    def _await_start(self, start_timeout_s: float | None) -> list[dict[str, Any]]:
        """Every worker's `describe()` once it is up, within the startup deadline; on any
        failure every worker is killed before the error propagates."""
        n = len(self.workers)
        try:
            return self._gather(
                [w.describe.remote() for w in self.workers],
                ["__init__"] * n,
                list(range(n)),
                start_timeout_s or deadlines.deadline_s("startup"),
                "startup",
            )
        except BaseException:
            self._kill(self.workers)
            self._remove_store()
            raise

    def _remove_store(self) -> None:
        """Delete the process group's rendezvous folder (single-node groups have one)."""
        if self._store_dir is not None:
            self._store_finalizer()
            self._store_dir = None

    def _dist_init_env(self, master_addr: str, master_port: int) -> dict[str, str]:
        """How the workers form their process group (see the module docstring)."""
        if set(self._bundle_nodes) != {ray.get_runtime_context().get_node_id()}:
            return {DIST_INIT_ENV: f"tcp://{master_addr}:{master_port}"}
        import tempfile

        self._store_dir = tempfile.mkdtemp(prefix=f"tempering-{self.name}-")  # mode 0700
        # removed at shutdown, at a failed start, or when the driver exits without either
        self._store_finalizer = weakref.finalize(
            self, shutil.rmtree, self._store_dir, ignore_errors=True
        )
        return {
            DIST_INIT_ENV: f"file://{self._store_dir}/store",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),  # not yet run on GPUs
        }

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self.workers)

    @property
    def dp_size(self) -> int:
        """Data-parallel size: workers / tensor_parallel_size."""
        return self.world_size // self.tp_size

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of worker ``rank`` (ranks sharing it receive the same shard)."""
        return rank // self.tp_size

    def get_dp_results(self, futures: Sequence[ray.ObjectRef]) -> list[Any]:
        """Results of a ``run_all_workers_sharded_data`` call, one per data-parallel rank (the
        first worker of each tensor-parallel group: its peers return the same)."""
        return self.get_all_worker_results(futures)[:: self.tp_size]

    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
        worker = self.workers[rank]
        if any(isinstance(a, ray.ObjectRef) for a in (*args, *kwargs.values())):
            ref = worker.execute.remote(method, *args, **kwargs)  # Ray resolves the refs
        else:
            ref = worker.call.remote((method, args, kwargs))
        self._ref_info[ref.hex()] = (rank, method)
        return ref

    def run_all_workers_single_data(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method(*args, **kwargs)`` on every worker; futures in rank order."""
        return [self._submit(rank, method, args, kwargs) for rank in range(self.world_size)]

    def run_all_workers_sharded_data(
        self,
        method: str,
        data: BatchedDataDict,
        *,
        batch_size: int | None = None,
        **replicated_kwargs: Any,
    ) -> list:
        """Call ``method(shard, **replicated_kwargs)`` on every worker; futures in rank order.

        ``data`` is split with ``data.shard_by_batch_size(dp_size, batch_size)``; worker ``r``
        gets shard ``dp_rank(r)``. ``replicated_kwargs`` go to every worker unchanged.
        """
        shards = data.shard_by_batch_size(self.dp_size, batch_size=batch_size)
        if len(shards) != self.dp_size:
            raise ValueError(
                f"worker group {self.name!r}: shard_by_batch_size returned {len(shards)} shards "
                f"for dp_size {self.dp_size}"
            )
        return [
            self._submit(rank, method, (shards[self.dp_rank(rank)],), replicated_kwargs)
            for rank in range(self.world_size)
        ]

    def run_single_worker(self, rank: int, method: str, *args: Any, **kwargs: Any):
        """Call ``method`` on worker ``rank`` only; one future."""
        if not 0 <= rank < self.world_size:
            raise IndexError(
                f"worker group {self.name!r} has ranks 0..{self.world_size - 1}, not {rank}"
            )
        return self._submit(rank, method, args, kwargs)

    def get_all_worker_results(
        self, futures: Sequence[ray.ObjectRef], timeout_s: float | None = None
    ) -> list[Any]:
        """Results of ``futures`` in the order given (rank order for ``run_all_workers_*``).

        Raises the first :class:`WorkerError` / :class:`WorkerDiedError` as soon as any worker
        fails (without waiting for the others), and
        :class:`~tempering.distributed.deadlines.DeadlineExceeded` (a ``TimeoutError``) naming
        the phase, ranks and methods still running after ``timeout_s`` (default: the group's
        ``call_timeout_s``, else the deadline of the methods' phase), with their stack dumps.
        """
        futures = list(futures)
        info = [self._ref_info.pop(ref.hex(), (i, "?")) for i, ref in enumerate(futures)]
        methods = [m for _, m in info]
        phase, limit = deadlines.deadline_for_methods(methods)
        if timeout_s is not None:
            limit = timeout_s
        elif self.call_timeout_s is not None:
            limit = self.call_timeout_s
        try:
            return self._gather(futures, methods, [r for r, _ in info], limit, phase)
        finally:
            for ref in futures:
                self._ref_info.pop(ref.hex(), None)

    def _gather(
        self,
        futures: list,
        methods: list[str],
        ranks: list[int],
        timeout_s: float,
        phase: str = "startup",
    ) -> list[Any]:
        position = {ref: i for i, ref in enumerate(futures)}
        results: list[Any] = [None] * len(futures)
        pending = list(futures)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(remaining, 0))
            if not ready:
                waiting = sorted((ranks[position[r]], methods[position[r]]) for r in pending)
                late = sorted({r for r, _ in waiting})
                files = self.dump_stacks(late)
                stacks = (
                    "Python stacks of those workers: " + ", ".join(files)
                    if files
                    else "no stack dump (workers still starting, or no dump folder configured)"
                )
                raise deadlines.DeadlineExceeded(
                    f"phase {phase!r}: worker group {self.name!r} ({self.fqn}) ranks {late} did "
                    f"not finish {sorted({m for _, m in waiting})} within {timeout_s:g} s. "
                    f"{stacks}. If the phase is only slow, raise deadlines.{phase}_s; otherwise "
                    "look for a hung worker (the stacks show where each one waits).",
                    phase=phase,
                    ranks=late,
                    stack_files=files,
                )
            for ref in ready:
                i = position[ref]
                results[i] = self._get_ready(ref, ranks[i], methods[i])
        return results

    def _get_ready(self, ref: ray.ObjectRef, rank: int, method: str) -> Any:
        node_id = self._bundle_nodes[rank]
        where = f"rank {rank} on node {self._node_ips.get(node_id, '?')} (id {node_id[:12]})"
        context = dict(
            group=self.name,
            rank=rank,
            node_ip=self._node_ips.get(node_id, "?"),
            node_id=node_id,
            method=method,
        )
        try:
            return ray.get(ref, timeout=60)
        except ray.exceptions.RayTaskError as exc:
            tb = str(exc)  # Ray's text: the worker's traceback, pid and ip
            raise WorkerError(
                f"worker group {self.name!r} ({self.fqn}) {where} raised in {method!r}:\n{tb}",
                worker_traceback=tb,
                **context,
            ) from None
        except ray.exceptions.RayActorError as exc:
            detail = str(exc)
            what = "failed to start" if exc.actor_init_failed else "died"
            raise WorkerDiedError(
                f"worker group {self.name!r} ({self.fqn}) {where} {what} during {method!r} "
                f"(an exception in __init__, a kill, out of memory, or os._exit); Ray says:\n"
                f"{detail}\n{_last_words(detail)}",
                worker_traceback=detail,
                **context,
            ) from None

    def resource_usage(self, reset_peak: bool = False) -> list[dict[str, float]]:
        """Every worker's `process_usage`, in rank order (for `ResourceMonitor`);
        ``reset_peak`` restarts each one's ``rss_hwm_gb`` after reading it."""
        refs = [w.resource_usage.remote(reset_peak) for w in self.workers]
        n = len(refs)
        return self._gather(refs, ["resource_usage"] * n, list(range(n)),
                            deadlines.deadline_s("call"), "call")  # fmt: skip

    def dump_stacks(self, ranks: Sequence[int], wait_s: float = 3.0) -> list[str]:
        """Ask workers ``ranks`` to write their Python stacks (``SIGUSR1``); return the files
        that received a dump within ``wait_s`` (workers write to
        ``$TEMPERING_STACK_DUMP_DIR``, or to their stderr in Ray's logs when it is unset)."""
        folder = os.environ.get(deadlines.STACK_DUMP_DIR_ENV)
        here = ray.get_runtime_context().get_node_id()
        expected, before = [], []
        for rank in ranks:
            found = self._pid_and_node(rank, folder)
            if found is None:
                continue
            pid, node = found
            path = Path(folder) / f"{self.name}-rank{rank}-pid{pid}.txt" if folder else None
            size = _size(path) if path else 0  # an earlier dump in the file is not this one
            try:
                if node == here:
                    os.kill(pid, deadlines.STACK_DUMP_SIGNAL)
                else:
                    ray.get(_signal_on_node(node).remote(pid), timeout=wait_s)
            except (OSError, ray.exceptions.RayError) as exc:
                logger.warning(
                    "could not signal %s rank %d (pid %d): %s", self.name, rank, pid, exc
                )
                continue
            if path is not None:
                expected.append(path)
                before.append(size)
        return [str(p) for p in _wait_for_dumps(expected, before, wait_s)]

    def _pid_and_node(self, rank: int, folder: str | None) -> tuple[int, str] | None:
        """Worker ``rank``'s pid and node: from its description, or -- still starting, so
        not described yet -- from the stack file it created first thing (this node only)."""
        info = getattr(self, "worker_info", None)
        if info is not None:
            return int(info[rank]["pid"]), info[rank]["node_id"]
        if not folder:
            return None
        files = sorted(Path(folder).glob(f"{self.name}-rank{rank}-pid*.txt"),
                       key=lambda f: f.stat().st_mtime)  # fmt: skip
        if not files:
            return None
        return int(files[-1].stem.rsplit("pid", 1)[1]), self._bundle_nodes[rank]

    def _kill(self, workers: list[ray.actor.ActorHandle]) -> None:
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception as exc:  # already dead, or Ray shut down
                logger.debug("killing worker of %s: %s", self.name, exc)

    def shutdown(self, graceful_timeout_s: float = 10.0) -> None:
        """Call each worker's ``shutdown()`` (when it has one), then end every worker.

        Returns once the workers are gone: ``ray.kill`` alone only *asks* for the kill, so a
        call made right after it could still be served. Each worker is ended by an actor call
        (``__ray_terminate__``), ordered after everything this process already sent it, and
        that call's result is awaited; a worker that does not answer in time is killed.
        """
        if not self.workers:
            return
        done = {w.shutdown_worker.remote(): w for w in self.workers}
        _, pending = ray.wait(list(done), num_returns=len(done), timeout=graceful_timeout_s)
        hung = [done.pop(ref) for ref in pending]  # a terminate call would queue behind them
        if hung:
            logger.warning(
                "worker group %s: %d workers did not shut down within %g s; killing them",
                self.name,
                len(hung),
                graceful_timeout_s,
            )
        ends = {w.__ray_terminate__.remote(): w for w in done.values()}
        stuck: list = []
        if ends:
            _, stuck = ray.wait(list(ends), num_returns=len(ends), timeout=graceful_timeout_s)
        self._kill(hung + [ends[ref] for ref in stuck])
        self.workers = []
        self._remove_store()
