"""The ``keras-mp`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from keras_mp.demo import run_demo

    result = run_demo(policy=args.policy, epochs=args.epochs, batch_size=args.batch_size,
                      out_dir=args.out, verbose=0 if args.quiet else 1)
    print(result.report)
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _info(args: argparse.Namespace) -> int:
    import keras
    import tensorflow as tf

    import keras_mp
    from keras_mp import device

    prof = device.profile()
    gpus = tf.config.list_physical_devices("GPU")
    tpus = tf.config.list_logical_devices("TPU")
    flags = ", ".join(sorted(prof.flags)) or "none of amx_bf16/avx512_bf16/amx_fp16/avx512_fp16"
    lines = [
        f"keras-mp {keras_mp.__version__}, Keras {keras.__version__}, "
        f"TensorFlow {tf.__version__}",
        f"CPU: {_cpu_name()} ({os.cpu_count()} cores); low-precision flags: {flags}",
        f"GPUs: {', '.join(g.name for g in gpus) or 'none'}; TPUs: "
        f"{', '.join(t.name for t in tpus) or 'none'}",
        f"Device used: {prof.device_type}",
        "",
        "Measured matmul throughput (this machine, now):",
    ]
    for dtype, gflops in prof.throughput.items():
        native = "" if dtype == "float32" else (
            "  hardware support" if prof.hardware.get(dtype) else "  no hardware support")
        lines.append(f"  {dtype:<9} {gflops:8.1f} GFLOP/s  {prof.speedup(dtype):5.2f}x float32"
                     f"{native}")
    fast = ", ".join(prof.fast) or "none"
    lines += ["", f"Fast low-precision dtypes here: {fast}",
              f"'adaptive' would choose among: {', '.join(device.default_candidates())}"]
    lines += _execution_lines(prof.device_type)
    lines.append(f"XLA for fused elementwise work now: {keras_mp.uses_xla('elementwise')}; "
                 f"for fused layers' matmuls now: {keras_mp.uses_xla('matmul')}")
    print("\n".join(lines))
    return 0


def _execution_lines(device_type: str) -> list[str]:
    from keras_mp import device, execution

    ex = execution.profile(device_type)
    lines = ["", "Measured train step, TF graph vs XLA (median per step; process CPU / wall):"]
    if not ex.xla_available:
        lines.append("  XLA does not run on this device: graph only")
    for dtype, times in ex.step.items():
        (gc, gw) = times["graph"]
        if "xla" in times:
            (xc, xw) = times["xla"]
            lines.append(f"  {dtype:<9} graph {gc * 1e3:6.1f} / {gw * 1e3:6.1f} ms   XLA "
                         f"{xc * 1e3:6.1f} / {xw * 1e3:6.1f} ms   XLA speed-up "
                         f"{ex.xla_speedup(dtype):4.2f}x  -> {execution.choose([dtype])}")
        mm = ex.matmul.get(dtype, {})
        if "xla" in mm:
            lines.append(f"  {'':<9} matmul {mm['graph']:7.1f} GFLOP/s graph, "
                         f"{mm['xla']:7.1f} under XLA")
    cands = device.default_candidates(device_type)
    override = os.environ.get(execution.ENV_VAR)
    lines.append(f"Train step under 'adaptive' ({', '.join(cands)}): "
                 f"{execution.choose(cands, device_type)}"
                 + (f" (but {execution.ENV_VAR}={override} overrides it)" if override else
                    f" (override: {execution.ENV_VAR}=xla|graph|keep)"))
    if cands[0] in ex.matmul and "xla" in ex.matmul[cands[0]]:
        lines.append(f"Fused layers' {cands[0]} matmuls, as measured: "
                     f"{'XLA' if ex.matmul_xla_wins(cands[0]) else 'TensorFlow graph'} "
                     "(applied by keras_mp.execution.configure)")
    return lines


def _bench(args: argparse.Namespace) -> int:
    try:
        # Installed: benchmarks/ ships as keras_mp.benchmarks.
        from keras_mp.benchmarks import suite
    except ModuleNotFoundError:
        # A source checkout on sys.path (e.g. tests run from the repository
        # root) shadows the installed package and has benchmarks/ beside it.
        from benchmarks import suite

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] \
        if args.variants else suite.VARIANTS
    suite.run(models=models, quick=args.quick, out=args.out, rounds=args.rounds,
              steps=args.steps, variants=variants)
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
    demo.add_argument("--policy", default="adaptive",
                      help="precision policy to train with (default: %(default)s)")
    demo.add_argument("--epochs", type=int, default=3, help="epochs (default: %(default)s)")
    demo.add_argument("--batch-size", type=int, default=64,
                      help="batch size (default: %(default)s)")
    demo.add_argument("--out", default=".", help="folder for the PNG plot "
                                                 "(default: the current folder)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)

    info = sub.add_parser(
        "info", help="what this machine runs fast and what 'adaptive' would choose",
        description="Prints the device, its low-precision CPU flags, a measured matmul "
                    "micro-benchmark per dtype, the dtypes the adaptive policy uses, and a "
                    "measured train step as a TF graph and under XLA per dtype, with the "
                    "execution mode keras-mp picks from it.")
    info.set_defaults(func=_info)

    bench = sub.add_parser(
        "bench", help="plain Keras vs keras-mp, side by side",
        description="Times training steps of keras-mp's recommended set-up (adaptive, "
                    "fused, AdaptivePrecision) and of every Keras one-liner (float32, "
                    "mixed_bfloat16, mixed_float16, each with and without XLA) in one "
                    "process, in interleaved rounds, by process CPU time and wall time; "
                    "prints medians, spreads and ratios against Keras float32 and the best "
                    "Keras variant; writes bench.json and bench.png.")
    bench.add_argument("--quick", action="store_true",
                       help="smaller shapes (a few minutes on 2 cores)")
    bench.add_argument("--variants", default=None,
                       help="comma-separated subset of keras_float32, keras_float32_xla, "
                            "keras_mixed_bfloat16, keras_mixed_bfloat16_xla, "
                            "keras_mixed_float16, keras_mixed_float16_xla, keras_mp "
                            "(default: all)")
    bench.add_argument("--rounds", type=int, default=None,
                       help="interleaved timed rounds, >= 5 (default: 5 quick, 7 full)")
    bench.add_argument("--steps", type=int, default=None,
                       help="training steps per round and variant, >= 5 (default: 5 quick, "
                            "8 full)")
    bench.add_argument("--models", default="mlp,cnn,transformer",
                       help="comma-separated, among mlp, cnn, transformer "
                            "(default: %(default)s)")
    bench.add_argument("--out", default=None, help="folder for bench.json and bench.png")
    bench.set_defaults(func=_bench)
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
