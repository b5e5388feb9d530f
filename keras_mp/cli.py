"""The ``keras-mp`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from keras_mp.demo import run_demo

    result = run_demo(policy=args.policy, epochs=args.epochs, batch_size=args.batch_size,
                      out_dir=args.out, verbose=0 if args.quiet else 1)
    print(result.report)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-mp",
        description="Mixed-precision training for Keras 3 on TensorFlow.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = sub.add_parser(
        "demo", help="train a small model on embedded data with keras-mp and compare "
                     "it with float32",
        description="Trains a small CNN on the embedded digits with keras-mp, then in "
                    "float32, and prints the precision, loss-scale history and speed.")
    demo.add_argument("--policy", default="mixed_bfloat16",
                      help="precision policy to train with (default: %(default)s)")
    demo.add_argument("--epochs", type=int, default=3, help="epochs (default: %(default)s)")
    demo.add_argument("--batch-size", type=int, default=64,
                      help="batch size (default: %(default)s)")
    demo.add_argument("--out", default=".", help="folder for the PNG plot "
                                                 "(default: the current folder)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, PermissionError, OSError) as e:
        print(f"keras-mp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
