"""The ``tempering`` command line.

    tempering plot LOG_DIR [--out FILE.png] [--keys train/loss,val/accuracy]
    tempering gym-examples OUT.jsonl [--environments math_with_judge,example_single_tool_call]
    tempering export CKPT_DIR OUT_DIR [--dtype float32|bfloat16|float16]

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its arguments and
sets ``func`` (called with the parsed namespace, returns an exit code); list it in
``SUBCOMMANDS``. Heavy imports happen inside the ``func`` so ``tempering --help`` stays fast.
Errors a user can fix (missing file, unknown key) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _run_plot(args: argparse.Namespace) -> int:
    from tempering.utils.plot import plot_metrics

    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    out = plot_metrics(args.log_dir, out=args.out, keys=keys)
    print(f"wrote {out}")
    return 0


def _add_plot(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plot",
        help="draw metric curves from a run's metrics.jsonl",
        description="Draw metric curves from LOG_DIR/metrics.jsonl into a PNG.",
    )
    p.add_argument("log_dir", metavar="LOG_DIR", help="the run's logger.log_dir")
    p.add_argument("--out", default=None, help="output PNG (default: LOG_DIR/metrics.png)")
    p.add_argument(
        "--keys",
        default=None,
        help="comma-separated metrics to draw, e.g. train/loss,val/accuracy (default: all)",
    )
    p.set_defaults(func=_run_plot)


def _run_gym_examples(args: argparse.Namespace) -> int:
    from tempering.data.nemo_gym import write_gym_examples

    names = [n.strip() for n in args.environments.split(",") if n.strip()]
    n = write_gym_examples(args.out, names)
    print(f"wrote {n} rows to {args.out}")
    return 0


def _add_gym_examples(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gym-examples",
        help="write NeMo Gym's bundled example rows as one GRPO JSONL file",
        description="Copy the example.jsonl rows that NeMo Gym ships for each environment into "
        "OUT, routed to <environment>_simple_agent (builds Gym's venv on first use).",
    )
    p.add_argument("out", metavar="OUT", help="the JSONL file to write")
    p.add_argument(
        "--environments",
        default="math_with_judge,workplace_assistant,example_single_tool_call",
        help="comma-separated Gym resources servers (default: %(default)s)",
    )
    p.set_defaults(func=_run_gym_examples)


def _run_export(args: argparse.Namespace) -> int:
    from tempering.models.export import export_checkpoint

    folder, info = export_checkpoint(args.ckpt_dir, args.out_dir, dtype=args.dtype)
    print(
        f"exported step {info['step']} of {info['model_name']} ({info['dtype']}) to {folder}; "
        "load it with AutoModelForCausalLM.from_pretrained or vLLM"
    )
    return 0


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="turn a step checkpoint into a Hugging Face folder",
        description="Write CKPT_DIR (a results/<run>/step_<N> folder, any data/tensor-parallel "
        "layout) as a Hugging Face folder OUT_DIR: weights, config, generation config, "
        "tokenizer and chat template. A partial checkpoint is refused.",
    )
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a step_<N> folder (or its policy/)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the HF folder to write (replaced)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weight dtype (default: the run's policy.precision)",
    )
    p.set_defaults(func=_run_export)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_plot,
    _add_gym_examples,
    _add_export,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tempering", description="tempering command line tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tempering`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError) as e:
        print(f"tempering {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
