"""The ``tempering`` command line.

    tempering plan CONFIG [dotted.key=value ...]
    tempering plot LOG_DIR [--out FILE.png] [--keys train/loss,val/accuracy]
    tempering gym-examples OUT.jsonl [--environments math_with_judge,example_single_tool_call]
    tempering export CKPT_DIR OUT_DIR [--dtype float32|bfloat16|float16] [--adapter]
    tempering eval MODEL [--baseline MODEL] --task NAME [--split test] [--samples N] [--pass-at-k K]
    tempering envs [--build] [FQN ...]
    tempering check-container
    tempering serve MODEL [--adapter DIR] [--backend torch|vllm] [--host H --port P --api-key K]

Each subcommand is a ``_run_<name>(args)`` function (called with the parsed namespace, returns
an exit code) whose docstring is its help: the first line in ``tempering --help``, the
paragraph below it in ``tempering <name> --help``; and one ``_add_<name>(subparsers)`` that
registers it with `_subcommand` and declares its arguments; list that in ``SUBCOMMANDS``.
Heavy imports happen inside ``_run_<name>`` so ``tempering --help`` stays fast.
Errors a user can fix (missing file, unknown key) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tempering.errors import UserInputError


def _subcommand(
    subparsers: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """Add ``tempering NAME``, which calls ``run``; its help is ``run``'s docstring: the first
    line the one-line help, the rest the description. Returns the parser, for the arguments."""
    if run.__doc__ is None:
        raise RuntimeError(f"tempering {name}: no help text (run without python -OO)")
    help_line, _, description = run.__doc__.strip().partition("\n\n")
    p = subparsers.add_parser(name, help=help_line, description=" ".join(description.split()))
    p.set_defaults(func=run)
    return p


def _run_plan(args: argparse.Namespace) -> int:
    """the placement plan of a config: groups, GPUs, DP/TP, memory per GPU

    Resolve CONFIG (with overrides) into the plan a run would start: nodes, bundles, which
    group holds which GPUs (colocated or split), data/tensor-parallel sizes and a per-GPU
    memory estimate. Exits 2, saying what is short, when the config does not fit the cluster
    it declares. Starts nothing.
    """
    from tempering.config.loader import load_config
    from tempering.config.schemas import MASTER_CONFIGS
    from tempering.distributed.placement import schema_for
    from tempering.models.shapes import plan_for

    cfg, _ = load_config(
        args.config, args.overrides, schema=MASTER_CONFIGS[schema_for(args.config)]
    )
    print(plan_for(cfg).table())
    return 0


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(subparsers, "plan", _run_plan)
    p.add_argument("config", metavar="CONFIG", help="a YAML under examples/configs/ or yours")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra-style overrides")


def _run_plot(args: argparse.Namespace) -> int:
    """draw metric curves from a run's metrics.jsonl

    Draw metric curves from LOG_DIR/metrics.jsonl into a PNG.
    """
    from tempering.utils.plot import plot_metrics, plot_timeline

    if args.timeline:
        if args.keys:
            raise SystemExit("tempering plot: --keys draws metrics; leave it out with --timeline")
        print(f"wrote {plot_timeline(args.log_dir, out=args.out)}")
        return 0
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    out = plot_metrics(args.log_dir, out=args.out, keys=keys)
    print(f"wrote {out}")
    return 0


def _add_plot(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(subparsers, "plot", _run_plot)
    p.add_argument("log_dir", metavar="LOG_DIR", help="the run's logger.log_dir")
    p.add_argument("--out", default=None, help="output PNG (default: LOG_DIR/metrics.png)")
    p.add_argument(
        "--keys",
        default=None,
        help="comma-separated metrics to draw, e.g. train/loss,val/accuracy (default: all)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="draw LOG_DIR/timeline.jsonl (async GRPO's phases per role) as a Gantt chart "
        "(default out: LOG_DIR/timeline.png)",
    )


# the targets `gym-examples --arithmetic` alternates: one Gym environment behind two entries
ARITHMETIC_ROUTES = ("lc_equivalence_rule_environment_server", "lc_equivalence_rule_simple_agent")


def _run_gym_examples(args: argparse.Namespace) -> int:
    """write NeMo Gym's bundled example rows as one GRPO JSONL file

    Copy the example.jsonl rows that NeMo Gym ships for each environment into OUT, routed to
    <environment>_simple_agent (builds Gym's venv on first use). With --arithmetic N, write N
    tiny-arith problems of --split instead, routed in turn to Gym's equivalence_rule environment
    server and its agent (examples/configs/grpo_nemo_gym_shards_tiny.yaml's two shards).
    """
    from tempering.environments.nemo_gym import write_gym_examples

    if args.arithmetic:
        import json

        from tempering.data.nemo_gym import arithmetic_rows
        from tempering.utils.atomic import atomic_write_text

        rows = arithmetic_rows(args.arithmetic, args.split, list(ARITHMETIC_ROUTES))
        atomic_write_text(args.out, "".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {args.out}")
        return 0
    names = [n.strip() for n in args.environments.split(",") if n.strip()]
    n = write_gym_examples(args.out, names)
    print(f"wrote {n} rows to {args.out}")
    return 0


def _add_gym_examples(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(subparsers, "gym-examples", _run_gym_examples)
    p.add_argument("out", metavar="OUT", help="the JSONL file to write")
    p.add_argument(
        "--environments",
        default="math_with_judge,workplace_assistant,example_single_tool_call",
        help="comma-separated Gym resources servers (default: %(default)s)",
    )
    p.add_argument("--arithmetic", type=int, default=0, metavar="N",
                   help="write N tiny-arith problems as Gym rows instead of Gym's examples")  # fmt: skip
    p.add_argument("--split", choices=("train", "test"), default="train",
                   help="--arithmetic: the problems' split (test: the held-out ones)")  # fmt: skip


def _run_export(args: argparse.Namespace) -> int:
    """turn a step checkpoint into a Hugging Face folder

    Write CKPT_DIR (a results/<run>/step_<N> folder, any data/tensor-parallel layout) as a
    Hugging Face folder OUT_DIR: weights, config, generation config, tokenizer and chat
    template. A partial checkpoint is refused.
    """
    from tempering.models.export import export_checkpoint

    folder, info = export_checkpoint(
        args.ckpt_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
        adapter=args.adapter,
    )  # fmt: skip
    how = (
        "PeftModel.from_pretrained(base_model, folder)" if args.adapter
        else "AutoModelForCausalLM.from_pretrained or vLLM"
    )  # fmt: skip
    print(
        f"exported step {info['step']} of {info['model_name']} ({info['dtype']}) to {folder}; "
        f"load it with {how}"
    )
    return 0


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(subparsers, "export", _run_export)
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a step_<N> folder (or its policy/)")
    p.add_argument(
        "out_dir", metavar="OUT_DIR",
        help="the HF folder to write: new, or a previous export (replaced); never a checkpoint",
    )  # fmt: skip
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace OUT_DIR even when it is not a previous export (never a checkpoint folder)",
    )  # fmt: skip
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weight dtype (default: the run's policy.precision)",
    )
    p.add_argument(
        "--adapter", action="store_true",
        help="a LoRA run: write the adapters alone in PEFT's format instead of the merged model",
    )  # fmt: skip


def _run_eval(args: argparse.Namespace) -> int:
    """held-out accuracy of a model (HF folder, name or step checkpoint)

    Score MODEL on held-out problems exactly as GRPO validation does (same problems,
    prompts, rollout loop and scorer; greedy), with a 95% interval; against --baseline, the
    paired difference with its interval. See tempering/evaluation.py.
    """
    import os

    from tempering.evaluation import evaluate, report

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = {
        "task": args.task, "split": args.split, "samples": args.samples, "seed": args.seed,
        "pass_at_k": args.pass_at_k, "temperature": args.temperature,
        "batch_size": args.batch_size, "backend": args.backend, "data": args.data,
        "problem_key": args.problem_key, "answer_key": args.answer_key,
        "max_new_tokens": args.max_new_tokens, "max_turns": args.max_turns,
        "use_chat_template": args.chat_template,
    }  # fmt: skip
    result = evaluate(args.model, tokenizer=args.tokenizer, **kwargs)
    baseline = None
    if args.baseline:  # the same problems and settings as the model's
        s = result.settings
        kwargs.update(max_new_tokens=s["max_new_tokens"], max_turns=s["max_turns"],
                      use_chat_template=s["use_chat_template"])  # fmt: skip
        baseline = evaluate(args.baseline, **kwargs)
    print(report(result, baseline, args.report))
    return 0


def _add_eval(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(subparsers, "eval", _run_eval)
    p.add_argument("model", metavar="MODEL", help="HF folder, registered name or step_<N> folder")
    p.add_argument("--baseline", default=None, help="a second MODEL on the same problems")
    p.add_argument("--task", required=True,
                   help="arithmetic | arithmetic_retry | calculator | gsm8k | problems | "
                   "rg:<reasoning-gym task>")  # fmt: skip
    p.add_argument("--split", default="test", help="held-out split (default: %(default)s)")
    p.add_argument("--samples", type=int, default=256, help="problems (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="problem generator seed (GRPO's: 0)")
    p.add_argument("--pass-at-k", type=int, default=0, help="also pass@K with K samples")
    p.add_argument("--temperature", type=float, default=1.0, help="for pass@K sampling")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's / task's")
    p.add_argument(
        "--max-turns", type=int, default=None, help="multi-turn tasks (default: 3, calculator 4)"
    )
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="format prompts with the chat template (default: the run's / task's)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    p.add_argument("--data", default=None, help="--task problems: JSONL / HF dataset")
    p.add_argument("--problem-key", default="problem")
    p.add_argument("--answer-key", default="expected_answer")
    p.add_argument("--report", default="eval_report.json", help="JSON report path")
    p.add_argument("--tokenizer", default=None,
                   help="MODEL's tokenizer, for a folder of weights only (not --baseline's)")  # fmt: skip


def _run_envs(args: argparse.Namespace) -> int:
    """list worker classes, the environment each runs in, and build them

    For each worker class of ACTOR_ENVIRONMENT_REGISTRY (or the FQNs given): its executable
    and state -- frozen (a python-<fqn> launcher in TEMPERING_FROZEN_ENVS_DIR), ready, stale
    (the code's lock or pyproject changed, or NRL_FORCE_REBUILD_VENVS=true), missing, or
    interpreter (no venv).
    """
    import time

    from tempering.distributed import actor_environments as ae

    for fqn, executable in map(ae.worker_spec, args.fqns or list(ae.ACTOR_ENVIRONMENT_REGISTRY)):
        state = ae.venv_state(fqn, executable)
        line = f"{fqn}\n    executable: {executable}\n    state: {state}"
        if args.build and state not in ("frozen", "interpreter", "ready"):
            start = time.perf_counter()
            python = ae.build_worker_venv(fqn, executable)
            line += f" -> built {python} in {time.perf_counter() - start:.1f} s"
        print(line, flush=True)
    print(
        f"venvs root: {ae.venvs_root()}; frozen launchers: "
        f"{ae.os.environ.get(ae.FROZEN_ENVS_DIR_ENV) or '(none)'}; "
        f"{ae.FORCE_REBUILD_ENV}={'true' if ae.force_rebuild_requested() else 'false'}"
    )
    return 0


def _add_envs(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(subparsers, "envs", _run_envs)
    p.add_argument(
        "fqns", nargs="*", metavar="FQN[=EXECUTABLE]",
        help="worker classes (default: all registered); FQN=EXECUTABLE names a class this "
        "process has not registered (a plugin's) with the executable it runs under",
    )  # fmt: skip
    p.add_argument("--build", action="store_true", help="build the stale and missing venvs now")


def _run_check_container(args: argparse.Namespace) -> int:
    """the start-up version check: does the code match the image it runs in?

    With NRL_CONTAINER=1, compare md5(pyproject.toml), md5(uv.lock) and submodule commits
    with the image's fingerprint; on a difference print each key and the remedies, and exit
    1 unless NRL_FORCE_REBUILD_VENVS=true or NRL_IGNORE_VERSION_MISMATCH=1 (the example
    scripts run the same check).
    """
    from tempering.distributed.fingerprint import check_container_fingerprint, fingerprint_path

    diff = check_container_fingerprint()
    print(f"container fingerprint {fingerprint_path()}: {'mismatch' if diff else 'matches'}")
    return 0


def _add_check_container(subparsers: argparse._SubParsersAction) -> None:
    _subcommand(subparsers, "check-container", _run_check_container)


def _run_serve(args: argparse.Namespace) -> int:
    """serve a model over the OpenAI API (chat, completions, streaming, /metrics)

    Serve MODEL (an HF folder such as results/<run>/final_hf, a step_<N> checkpoint, or a
    registered name such as tiny-arith) with the server GRPO runs use during training:
    /v1/models, /v1/chat/completions, /v1/completions (stream and n included), /health and
    Prometheus /metrics. Binds 127.0.0.1; any other --host needs --api-key (or
    TEMPERING_API_KEY). Ctrl-C stops it. See docs/guides/serve.md.
    """
    import tempfile
    import threading

    with tempfile.TemporaryDirectory(prefix="tempering_serve_") as scratch:
        close, server = build_serve(args, scratch)
        server.start()
        backend = f"{args.backend} backend" + (f", adapter {args.adapter}" if args.adapter else "")
        print(f"serving {server.service.settings.model_name!r} on {server.base_url} ({backend}); "
              "Ctrl-C stops", flush=True)  # fmt: skip
        try:
            threading.Event().wait()  # until Ctrl-C / SIGTERM (stop_cleanly)
        finally:
            server.stop()
            close()
    return 0


def build_serve(args: argparse.Namespace, scratch: str) -> tuple[Callable[[], None], Any]:
    """(the backend's close, the unstarted `OpenAIServer`) that ``tempering serve`` runs for
    parsed `args`; the address, key and TLS files are checked before the model loads.
    `scratch`: where a step checkpoint is exported."""
    import os
    from pathlib import Path

    from tempering.evaluation import generation_backend, resolve_model
    from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.generation.openai_server import OpenAIServer, require_key
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path
    from tempering.models.shapes import max_positions
    from tempering.utils.serving import check_tls_files

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    api_key = args.api_key or os.environ.get("TEMPERING_API_KEY") or None
    require_key(args.host, api_key, "pass --api-key KEY (or set TEMPERING_API_KEY)")
    check_tls_files(args.ssl_certfile, args.ssl_keyfile, ("--ssl-certfile", "--ssl-keyfile"))
    if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"--adapter {args.adapter}: no adapter_config.json there; pass "
                                "a PEFT adapter folder (tempering export --adapter)")  # fmt: skip
    path, _ = resolve_model(args.model, Path(scratch))
    tokenizer = load_tokenizer(path, named=(f"MODEL {args.model!r}", "pass an HF folder"))
    limit = max_positions(str(resolve_model_path(path))) or args.max_model_len  # a name: its folder
    if limit is None:
        raise ValueError(f"MODEL {args.model!r} names no max_position_embeddings; pass "
                         "--max-model-len N (prompt + generated tokens)")  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=args.max_tokens)
    max_len = min(limit, args.max_model_len or limit)
    generation, close = generation_backend(path, args.backend, sampling, tokenizer, args.adapter,
                                           max_model_len=max_len, kv_cache_bytes=2**30)  # fmt: skip
    settings = ServerSettings(
        model_name=args.served_model_name or args.model,
        max_model_len=max_len,
        default_sampling=sampling,
        training_mode=False,
        max_batch_size=args.max_concurrency,
        tool_parser=args.tool_parser,
        chat_template=Path(args.chat_template).read_text() if args.chat_template else None,
    )
    service = ChatCompletionService(generation, tokenizer, settings)
    return close, OpenAIServer(service, args.host, args.port, api_key, ssl_certfile=args.ssl_certfile,
                        ssl_keyfile=args.ssl_keyfile)  # fmt: skip


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(subparsers, "serve", _run_serve)
    p.add_argument("model", metavar="MODEL", help="HF folder, registered name or step_<N> folder")
    p.add_argument("--adapter", default=None, help="a PEFT adapter folder, merged on load (torch)")
    p.add_argument("--backend", choices=["torch", "vllm"], default="torch",
                   help="torch (this process) or vllm (its worker venv); default %(default)s")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="0: a free one (default %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="required off loopback: clients send Authorization: Bearer KEY "
                   "(default: $TEMPERING_API_KEY)")  # fmt: skip
    p.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve https")
    p.add_argument("--ssl-keyfile", default=None, help="its unencrypted PEM private key")
    p.add_argument("--max-concurrency", type=int, default=64,
                   help="rows (requests x n) per decode batch; more wait (default %(default)s)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256,
                   help="max_tokens when a request leaves it out (default %(default)s)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + generation tokens (default: the model's positions)")  # fmt: skip
    p.add_argument(
        "--served-model-name", default=None, help="the name clients send (default MODEL)"
    )
    p.add_argument("--tool-parser", default="hermes",
                   help="hermes | llama3_json | mistral | auto (the family's), as in training")  # fmt: skip
    p.add_argument("--chat-template", default=None,
                   help="a Jinja file (default: the tokenizer's own template)")  # fmt: skip


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_plan,
    _add_plot,
    _add_gym_examples,
    _add_export,
    _add_eval,
    _add_envs,
    _add_check_container,
    _add_serve,
]


def version_line() -> str:
    """``tempering X (python, torch, ray, transformers)`` as installed, for bug reports; read
    from package metadata, nothing imported (vLLM lives in its worker venv: `tempering envs`)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from tempering import __version__

    parts = [f"python {platform.python_version()}"]
    for dist in ("torch", "ray", "transformers"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return f"tempering {__version__} ({', '.join(parts)})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tempering",
        description="tempering command line tools",
        formatter_class=argparse.RawTextHelpFormatter,  # --version on one line
    )
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tempering`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from tempering.utils.stopping import stop_cleanly

    try:
        with stop_cleanly():  # Ctrl-C / SIGTERM: Ray freed, exit 130 / 143
            return int(args.func(args))
    except (FileNotFoundError, ValueError, KeyError, UserInputError) as e:
        print(f"tempering {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
