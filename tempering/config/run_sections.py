"""The run-wide sections every master config shares: the cluster, logging, per-phase
deadlines and checkpointing (part of `tempering.config.schemas`' namespace)."""

from __future__ import annotations

from pydantic import Field

from tempering.config.section import Section


class ClusterConfig(Section):
    num_nodes: int = Field(1, ge=1, description="Ray nodes the run's workers are spread over")
    gpus_per_node: int = Field(0, ge=0, description="0 = CPU workers")
    workers_per_node: int = Field(1, ge=1, description="workers per node when gpus_per_node=0")
    cpus_per_worker: int = Field(
        1, ge=1, description="CPUs each worker's placement-group bundle reserves"
    )
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="memory of one GPU, for the placement plan's fit check"
    )


class WandbConfig(Section):
    project: str = Field("tempering", description="the W&B project runs are logged to")
    name: str | None = Field(None, description="the W&B run name (null: W&B picks one)")


class TensorboardConfig(Section):
    log_dir: str | None = Field(
        None,
        description="where TensorBoard's event files go; default: <logger.log_dir>/tensorboard",
    )


class MlflowConfig(Section):
    experiment_name: str = Field("tempering", description="the MLflow experiment")
    tracking_uri: str | None = Field(
        None, description="the MLflow server or store (null: file:<logger.log_dir>/mlruns)"
    )


class LoggerConfig(Section):
    log_dir: str = Field(
        "logs/run", description="where metrics.jsonl, timeline.jsonl and samples are written"
    )
    wandb_enabled: bool = Field(False, description="also log to Weights & Biases (logger.wandb)")
    tensorboard_enabled: bool = Field(
        True, description="also write TensorBoard event files (logger.tensorboard)"
    )
    mlflow_enabled: bool = Field(False, description="also log to MLflow (logger.mlflow)")
    monitor_gpus: bool = Field(
        True, description="per-role CPU, memory and GPU use in metrics.jsonl (resources/*)"
    )
    num_val_samples_to_print: int = Field(
        3, ge=0, description="validation samples (prompt, response, reward) printed per validation"
    )
    wandb: WandbConfig = WandbConfig()
    tensorboard: TensorboardConfig = TensorboardConfig()
    mlflow: MlflowConfig = MlflowConfig()


class DeadlinesConfig(Section):
    """Seconds each phase may wait on its workers before the run stops with the phase, the
    ranks that did not answer and their Python stacks (tempering/distributed/deadlines.py)."""

    startup_s: float = Field(
        1800.0, gt=0, description="a worker group starting (imports, venv build, model load)"
    )
    generation_s: float = Field(1800.0, gt=0, description="a generation call")
    refit_s: float = Field(1800.0, gt=0, description="moving weights to the generator")
    train_s: float = Field(1800.0, gt=0, description="one training call (a whole step)")
    logprobs_s: float = Field(1800.0, gt=0, description="a log-prob pass (policy or reference)")
    environment_s: float = Field(1800.0, gt=0, description="an environment actor's step()")
    checkpoint_s: float = Field(1800.0, gt=0, description="saving/loading/exporting weights")
    call_s: float = Field(1800.0, gt=0, description="any other worker call")

    def as_phases(self) -> dict[str, float]:
        return {name.removesuffix("_s"): value for name, value in self.model_dump().items()}


class CheckpointingConfig(Section):
    enabled: bool = Field(True, description="save step_<N> checkpoints (false: none, no resume)")
    checkpoint_dir: str = Field(
        "results/run", description="where step_<N> and final_hf go; a rerun resumes from here"
    )
    metric_name: str | None = Field(None, description="e.g. val/accuracy; keep_top_k ranks by it")
    higher_is_better: bool = Field(True, description="metric_name's ranking direction")
    keep_top_k: int | None = Field(
        3, ge=1, description="checkpoints kept: the best by metric_name (else the newest), and "
        "always the newest; null keeps all"
    )  # fmt: skip
    save_period: int = Field(10, ge=1, description="save every this many steps (and the last)")
