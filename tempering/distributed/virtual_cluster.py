"""Ray start-up and the virtual cluster: resource bundles grouped into per-node placement groups.

``init_ray()`` starts a quiet local Ray (no dashboard, no usage stats, logs kept out of the
driver, a short private temp dir) or joins the cluster named by ``RAY_ADDRESS``.
``RayVirtualCluster`` reserves ``bundle_ct_per_node_list[i]`` bundles on node ``i`` -- one
placement group per node, strategy ``STRICT_PACK`` so a node's bundles never straddle two
machines -- waits for them with a timeout, and names the missing resources when the cluster
is too small. Worker groups place one worker per bundle (see ``worker_groups.py``).

Ray's own TLS (docs/cluster.md, docs/security.md): with ``RAY_USE_TLS=1`` every Ray process
speaks mutual TLS on its gRPC ports, presenting ``RAY_TLS_SERVER_CERT``/``RAY_TLS_SERVER_KEY``
and trusting ``RAY_TLS_CA_CERT``. Ray reads them when it starts, so they must be set in the
environment of every ``ray start`` and of the driver; ``init_ray`` checks them (set, files
readable, certificate and key a pair, certificate signed by the CA) before starting Ray.

Run as a module to check a cluster: ``uv run python -m tempering.distributed.virtual_cluster``.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 is set by tempering/distributed/__init__.py, which always
# runs before this module (set it to 1 to opt back in to Ray's `uv run` relaunch).
import ray  # noqa: E402
from ray.util.placement_group import (  # noqa: E402
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

# Re-exported here because DESIGN.md places them beside the cluster.
from tempering.distributed.actor_environments import PY_EXECUTABLES  # noqa: E402, F401
from tempering.utils.stopping import reclaim_signals  # noqa: E402

logger = logging.getLogger(__name__)


def init_ray(
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    address: str | None = None,
    temp_dir: str | None = None,
    log_to_driver: bool = False,
    start_attempts: int = 3,
) -> dict[str, float]:
    """Start a local Ray, or join ``address`` / ``$RAY_ADDRESS``; return the cluster resources.

    A local Ray gets ``num_cpus`` logical CPUs (default: twice the machine's, at least 8, so
    placement groups do not starve controller-side actors on a small box). Does nothing but
    return the resources when Ray is already initialised.
    """
    if ray.is_initialized():
        return ray.cluster_resources()
    check_ray_tls_env()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=log_to_driver, logging_level=logging.WARNING)
    else:
        # Ray's listeners bind every interface (it maps 127.0.0.1 to the node's IP); with
        # token authentication, Ray's default for local clusters since 2.59 (RAY_AUTH_MODE is
        # read when ray is imported, so it is left to Ray here), none serves a peer without
        # the token. _private_token_file() makes the token file readable by this user only.
        if num_cpus is None:
            num_cpus = max(8, 2 * (os.cpu_count() or 1))
        temp_dir = temp_dir or tempfile.mkdtemp(prefix="ray_", dir="/tmp")
        for attempt in range(1, start_attempts + 1):
            try:
                ray.init(
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    include_dashboard=False,
                    log_to_driver=log_to_driver,
                    logging_level=logging.WARNING,
                    _temp_dir=temp_dir,
                )
                _private_token_file()
                break
            except Exception as exc:
                # On an overloaded machine Ray's raylet gives up waiting for its own agents
                # (a fixed 15-30 s); a second start usually succeeds.
                ray.shutdown()
                if attempt == start_attempts or "timed out during startup" not in str(exc):
                    raise
                logger.warning("Ray start attempt %d failed (%s); retrying", attempt, exc)
    reclaim_signals()  # ray.init() set its own SIGTERM handler in the driver
    return ray.cluster_resources()


RAY_TLS_VARS = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def check_ray_tls_env(env: dict[str, str] | None = None) -> bool:
    """With ``RAY_USE_TLS`` on: the three ``RAY_TLS_*`` files are set and readable, the
    certificate and key are a pair and the certificate verifies against the CA -- else a
    ValueError naming the variable, the path and the fix (Ray's own failure is a gRPC
    connection error, or a hang). Returns whether Ray TLS is on."""
    from tempering.utils.serving import check_tls_files

    env = dict(os.environ) if env is None else env
    if env.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return False
    unset = [name for name in RAY_TLS_VARS if not env.get(name)]
    if unset:
        raise ValueError(
            f"RAY_USE_TLS={env['RAY_USE_TLS']} but {', '.join(unset)} unset: Ray's TLS needs "
            "RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY and RAY_TLS_CA_CERT (PEM paths, the same "
            "on every node; docs/cluster.md)"
        )
    cert, key, ca = (env[name] for name in RAY_TLS_VARS)
    check_tls_files(cert, key, RAY_TLS_VARS[:2])
    problem = _handshake_problem(cert, key, ca)
    if problem:
        raise ValueError(
            f"RAY_TLS_SERVER_CERT={cert!r} does not verify against RAY_TLS_CA_CERT={ca!r} "
            f"({problem}): every Ray process checks its peers' certificates against that CA; "
            "sign the certificate with it, or point RAY_TLS_CA_CERT at the CA that did"
        )
    return True


def _handshake_problem(cert: str, key: str, ca: str) -> str | None:
    """A TLS handshake in memory, a server presenting `cert` to a client trusting only `ca`
    (no hostname check: that is Ray's business): None when it succeeds, else why not."""
    import ssl

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    try:
        client.load_verify_locations(ca)
    except (ssl.SSLError, OSError) as err:
        return f"the CA file does not load as PEM: {err}"
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_side=False)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):  # TLS 1.3 needs two round trips
        for end, outgoing, peer_in in ((c, c_out, s_in), (s, s_out, c_in)):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as err:
                return getattr(err, "verify_message", None) or str(err)
            peer_in.write(outgoing.read())
        if c.version() and s.version():
            return None
    return "the handshake did not finish"


def _private_token_file() -> None:
    """Ray writes its auth token world-readable (0644); other local users must not read it."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        if path.is_file() and path.stat().st_uid == os.getuid():
            path.chmod(0o600)
    except OSError as exc:
        logger.warning("could not make Ray's token file %s private: %s", path, exc)


class ClusterTooSmallError(RuntimeError):
    """The Ray cluster cannot hold the requested bundles."""


@dataclass(frozen=True)
class BundleLocation:
    """Where one bundle (one worker slot) lives."""

    placement_group: PlacementGroup
    bundle_index: int  # index inside its placement group
    node_index: int  # index into bundle_ct_per_node_list
    node_id: str  # Ray node id


class RayVirtualCluster:
    """Per-node placement groups of equal resource bundles.

    Args:
        bundle_ct_per_node_list: bundles (worker slots) on each node, e.g. ``[2]`` or ``[8, 8]``.
        use_gpus: bundles hold ``num_gpus_per_bundle`` GPUs each (else CPU-only bundles).
        num_cpus_per_bundle: CPUs in each bundle.
        name: prefix for the placement-group names.
        num_gpus_per_bundle: GPUs in each bundle when ``use_gpus``.
        ready_timeout_s: how long to wait for the placement groups.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = False,
        num_cpus_per_bundle: float = 1,
        name: str = "tempering",
        *,
        num_gpus_per_bundle: float = 1,
        ready_timeout_s: float = 60.0,
    ) -> None:
        if not bundle_ct_per_node_list or any(n < 1 for n in bundle_ct_per_node_list):
            raise ValueError(
                f"bundle_ct_per_node_list={bundle_ct_per_node_list} must list at least one node "
                "with at least one bundle each"
            )
        if not ray.is_initialized():
            raise RuntimeError("Ray is not running: call init_ray() before RayVirtualCluster")
        self.bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.use_gpus = use_gpus
        self.num_cpus_per_bundle = num_cpus_per_bundle
        self.num_gpus_per_bundle = num_gpus_per_bundle if use_gpus else 0
        self.name = name
        self._placement_groups: list[PlacementGroup] = []
        self._locations: list[BundleLocation] = []
        self._create_placement_groups(ready_timeout_s)

    @property
    def bundle(self) -> dict[str, float]:
        """The resources of one bundle."""
        bundle = {"CPU": self.num_cpus_per_bundle}
        if self.num_gpus_per_bundle:
            bundle["GPU"] = self.num_gpus_per_bundle
        return bundle

    def world_size(self) -> int:
        """Total bundles (worker slots)."""
        return sum(self.bundle_ct_per_node_list)

    def node_count(self) -> int:
        """Number of nodes (placement groups)."""
        return len(self.bundle_ct_per_node_list)

    def get_placement_groups(self) -> list[PlacementGroup]:
        """One placement group per node, in node order."""
        return list(self._placement_groups)

    def bundle_locations(self) -> list[BundleLocation]:
        """Every bundle in rank order: node 0's bundles first, then node 1's, ..."""
        return list(self._locations)

    def _requested(self) -> dict[str, float]:
        total = self.world_size()
        return {k: v * total for k, v in self.bundle.items()}

    def _check_capacity(self) -> None:
        available = ray.cluster_resources()
        missing = {
            k: (need, available.get(k, 0.0))
            for k, need in self._requested().items()
            if available.get(k, 0.0) < need
        }
        if missing:
            detail = ", ".join(
                f"{k}: need {n:g}, cluster has {h:g}" for k, (n, h) in missing.items()
            )
            raise ClusterTooSmallError(
                f"virtual cluster {self.name!r} ({self.bundle_ct_per_node_list} bundles of "
                f"{self.bundle}) does not fit: {detail}. Lower cluster.num_nodes / "
                "cluster.gpus_per_node (or workers per node), or add nodes to the Ray cluster."
            )

    def _create_placement_groups(self, ready_timeout_s: float) -> None:
        self._check_capacity()
        start = time.perf_counter()
        for node_index, count in enumerate(self.bundle_ct_per_node_list):
            pg = placement_group(
                [dict(self.bundle) for _ in range(count)],
                strategy="STRICT_PACK",
                name=f"{self.name}-node{node_index}",
            )
            self._placement_groups.append(pg)
        _, pending = ray.wait(
            [pg.ready() for pg in self._placement_groups],
            num_returns=len(self._placement_groups),
            timeout=ready_timeout_s,
        )
        if pending:
            not_ready = [
                i
                for i, pg in enumerate(self._placement_groups)
                if ray.util.placement_group_table(pg)["state"] != "CREATED"
            ]
            self.shutdown()
            raise ClusterTooSmallError(
                f"virtual cluster {self.name!r}: placement groups for nodes {not_ready} were not "
                f"ready after {ready_timeout_s:.0f} s. Each needs "
                f"{[self.bundle_ct_per_node_list[i] for i in not_ready]} bundles of {self.bundle} "
                f"on ONE node; available per node: {_per_node_available()}. Use fewer workers "
                "per node or smaller bundles, or add nodes."
            )
        for node_index, pg in enumerate(self._placement_groups):
            table = ray.util.placement_group_table(pg)
            for bundle_index in range(self.bundle_ct_per_node_list[node_index]):
                node_id = table["bundles_to_node_id"][bundle_index]
                self._locations.append(BundleLocation(pg, bundle_index, node_index, node_id))
        logger.info(
            "virtual cluster %s: %s bundles ready in %.2f s",
            self.name,
            self.bundle_ct_per_node_list,
            time.perf_counter() - start,
        )

    def get_master_address_and_port(self, timeout_s: float = 60.0) -> tuple[str, int]:
        """IP of the rank-0 bundle's node and a free TCP port on it (for torch.distributed)."""
        first = self._locations[0]
        if first.node_id == ray.get_runtime_context().get_node_id():
            return _node_ip_and_free_port()
        ref = (
            ray.remote(num_cpus=0, max_retries=0)(_node_ip_and_free_port)
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    first.placement_group, placement_group_bundle_index=first.bundle_index
                )
            )
            .remote()
        )
        try:
            return tuple(ray.get(ref, timeout=timeout_s))  # type: ignore[return-value]
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"virtual cluster {self.name!r}: finding a free port on node {first.node_id} "
                f"took longer than {timeout_s:.0f} s"
            ) from None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Remove every placement group and wait until Ray reports them removed."""
        removing = []
        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
                removing.append(pg)
            except Exception as exc:  # already removed, or Ray shut down
                logger.debug("removing placement group %s: %s", pg.id, exc)
        self._placement_groups.clear()
        self._locations.clear()
        deadline = time.monotonic() + timeout_s
        while removing and ray.is_initialized():
            removing = [
                pg for pg in removing if ray.util.placement_group_table(pg)["state"] != "REMOVED"
            ]
            if removing and time.monotonic() > deadline:
                raise TimeoutError(
                    f"virtual cluster {self.name!r}: {len(removing)} placement groups not "
                    f"removed within {timeout_s:g} s"
                )
            if removing:
                time.sleep(0.05)


def _node_ip_and_free_port() -> tuple[str, int]:
    """The address Ray reports for this node and a port free on it (probed on that address,
    not on every interface: the rendezvous binds only there, see model_setup)."""
    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
        sock.bind((ip, 0))
        port = sock.getsockname()[1]
    return ip, port


def _per_node_available() -> dict[str, dict[str, float]]:
    return {
        node["NodeID"][:8]: {k: v for k, v in node["Resources"].items() if k in ("CPU", "GPU")}
        for node in ray.nodes()
        if node["Alive"]
    }


def cluster_from_config(
    num_nodes: int,
    gpus_per_node: int,
    *,
    workers_per_node: int = 1,
    cpus_per_worker: float = 1,
    name: str = "tempering",
    ready_timeout_s: float = 60.0,
) -> RayVirtualCluster:
    """Turn ``cluster.num_nodes`` / ``cluster.gpus_per_node`` into a virtual cluster.

    ``gpus_per_node > 0``: one one-GPU bundle per GPU. ``gpus_per_node == 0``: CPU workers,
    ``workers_per_node`` bundles of ``cpus_per_worker`` CPUs on each node.
    """
    if num_nodes < 1 or gpus_per_node < 0:
        raise ValueError(
            f"cluster.num_nodes={num_nodes} must be >= 1 and cluster.gpus_per_node="
            f"{gpus_per_node} must be >= 0"
        )
    per_node = gpus_per_node if gpus_per_node > 0 else workers_per_node
    return RayVirtualCluster(
        [per_node] * num_nodes,
        use_gpus=gpus_per_node > 0,
        num_cpus_per_bundle=cpus_per_worker,
        name=name,
        ready_timeout_s=ready_timeout_s,
    )


def cluster_for_group(group: Any, cpus_per_worker: float, name: str) -> RayVirtualCluster:
    """The virtual cluster of one group of a placement plan (`placement.GroupPlan`)."""
    return RayVirtualCluster(
        group.bundles_per_node,
        use_gpus=group.gpus_per_bundle > 0,
        num_cpus_per_bundle=cpus_per_worker,
        num_gpus_per_bundle=group.gpus_per_bundle or 1,
        name=name,
    )


if __name__ == "__main__":
    resources = init_ray()
    print(f"Ray resources: {resources}")
    cluster = cluster_from_config(1, 0, workers_per_node=2)
    print(
        f"bundles: {[(b.node_index, b.bundle_index, b.node_id[:8]) for b in cluster.bundle_locations()]}"
    )
    print(f"master: {cluster.get_master_address_and_port()}")
    cluster.shutdown()
