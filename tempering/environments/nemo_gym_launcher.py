"""Start NeMo Gym for a training run (launch mode), inside Gym's own Python environment.

`NemoGymLauncher` is a Ray actor whose class is registered in `ACTOR_ENVIRONMENT_REGISTRY`
under ``PY_EXECUTABLES.NEMO_GYM`` (a venv of its own with ``nemo-gym``; see
`tempering.distributed.actor_environments`), exactly as the vLLM worker runs under the vLLM
extra. Only this module imports ``nemo_gym``, and only inside the actor.

`start` runs Gym's own launcher (``nemo_gym.cli.env.RunHelper``) with the user's config files
plus Gym's ``vllm_model_for_training.yaml`` policy-model config, pointed at the trainer's
generation server (``policy_base_url`` is the list of our server URLs, ``policy_model_name``,
``policy_api_key``), joined to the trainer's Ray cluster (``ray_head_node_address``: Gym's
environment servers are Ray clients, and a process where Ray is already initialised, like
this actor, would otherwise not pass an address on). With ``prebuilt_server_venvs`` every
Gym server runs in this same venv (``uv_venv_dir`` + ``skip_venv_if_present``: no uv or pip at
start-up); otherwise Gym builds one venv per server with uv, its supported route on Python
3.13. Gym writes ``results/`` and ``cache/`` into its working directory, the run's log
directory. `shutdown` stops every Gym server.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POLICY_MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"
SERVER_KINDS = ("resources_servers", "responses_api_agents", "responses_api_models",
                "environment_servers")  # fmt: skip


class NemoGymLauncher:
    def __init__(self, work_dir: str) -> None:
        if os.getpgrp() != os.getpid():  # a process group of its own: this actor and every
            os.setpgid(0, 0)  # Gym server it starts, which the trainer can kill as one
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        os.chdir(work_dir)  # Gym writes results/ and cache/ here
        self.work_dir = Path(work_dir)
        self._helper: Any = None

    def start(
        self,
        config_paths: list[str],
        policy_base_urls: list[str],
        policy_model_name: str,
        policy_api_key: str,
        ray_address: str,
        head_port: int,
        extra_config: dict[str, Any],
        prebuilt_server_venvs: bool,
        shard: str | None = None,
        entries: list[str] | None = None,
        port_range: tuple[int, int] | None = None,
        disallowed_ports: list[int] | None = None,
        on_node_address: bool = False,
    ) -> str:
        """Start Gym; returns the head server's URL once every server answers. A shard
        (`entries` given) runs only what they need (`nemo_gym_shards.hosted_entries`), its
        servers on ports in `port_range` and never on `disallowed_ports` (the other
        instances' head ports). `on_node_address`: the head and every server listen on this
        node's address, not loopback (shards spread over several nodes)."""
        from nemo_gym.cli.env import RunHelper
        from nemo_gym.global_config import GlobalConfigDictParserConfig
        from omegaconf import OmegaConf

        host = "127.0.0.1"
        if on_node_address:
            import ray

            host = ray.util.get_node_ip_address()
        initial: dict[str, Any] = {
            "config_paths": [POLICY_MODEL_CONFIG, *config_paths],
            "policy_base_url": list(policy_base_urls),
            "policy_model_name": policy_model_name,
            "policy_api_key": policy_api_key,
            "ray_head_node_address": ray_address,
            "head_server": {"host": host, "port": head_port},
            **extra_config,
        }
        if on_node_address:
            initial.setdefault("default_host", host)
        if prebuilt_server_venvs:
            initial["uv_venv_dir"] = str(self._link_server_venvs())
            initial["skip_venv_if_present"] = True
        if port_range is not None:
            initial.setdefault("port_range_low", port_range[0])
            initial.setdefault("port_range_high", port_range[1])
        if disallowed_ports:
            initial["disallowed_ports"] = sorted(
                {*disallowed_ports, *initial.get("disallowed_ports", [])} - {head_port}
            )
        if entries is not None:
            initial = self._only(initial, shard or "?", entries)
        self._helper = RunHelper()
        self._helper.start(
            GlobalConfigDictParserConfig(
                initial_global_config_dict=OmegaConf.create(initial),
                skip_load_from_cli=True,
                skip_load_from_dotenv=True,
            )
        )
        return f"http://{host}:{head_port}"

    @staticmethod
    def _only(initial: dict[str, Any], shard: str, entries: list[str]) -> dict[str, Any]:
        """Gym's merged config (read offline: no ports taken) with only the servers the
        shard hosts; their placeholder ports cleared so the real start assigns them, and
        ``config_paths`` dropped so it does not load the other entries again."""
        from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
        from omegaconf import OmegaConf

        from tempering.environments.nemo_gym_shards import hosted_entries, server_entries

        merged = GlobalConfigDictParser().parse(
            GlobalConfigDictParserConfig(
                initial_global_config_dict=OmegaConf.create(initial),
                skip_load_from_cli=True,
                skip_load_from_dotenv=True,
                offline=True,
            )
        )
        config = OmegaConf.to_container(merged, resolve=False)
        assert isinstance(config, dict)
        hosted = set(hosted_entries(config, entries, shard))
        for name, (_, conf) in server_entries(config).items():
            if name not in hosted:
                del config[name]
            elif conf.get("port") == -1:  # offline's placeholder
                conf["port"] = None
        config.pop("config_paths", None)
        log.info("shard %s runs %s", shard, sorted(hosted))
        return config

    def _link_server_venvs(self) -> Path:
        """``<work_dir>/venvs/<kind>/<server>/.venv`` -> this venv, for every bundled server."""
        root = self.work_dir / "venvs"
        site = Path(sysconfig.get_paths()["purelib"])
        for kind in SERVER_KINDS:
            for server in (site / kind).iterdir() if (site / kind).is_dir() else []:
                if server.is_dir() and not server.name.startswith("_"):
                    link = root / kind / server.name / ".venv"
                    link.parent.mkdir(parents=True, exist_ok=True)
                    if not link.exists():
                        link.symlink_to(sys.prefix, target_is_directory=True)
        return root

    def process(self) -> tuple[str, int]:
        """(Ray node id, process group) of this instance: the group `LaunchedGym.kill` ends."""
        import ray

        if os.getpgrp() != os.getpid():
            raise RuntimeError(f"the Gym launcher (pid {os.getpid()}) leads no process group")
        return ray.get_runtime_context().get_node_id(), os.getpgrp()

    def shutdown(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None
