"""The ``keras-mp`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from keras_mp.cli.demo import run_demo

    result = run_demo(epochs=args.epochs, batch_size=args.batch_size, out_dir=args.out,
                      verbose=0 if args.quiet else 1)
    print(result.report)
    return 0


def _cpu_name() -> str:
    from keras_mp.device import _cpuinfo

    name = _cpuinfo.fields().get("model name")
    if name:
        return name
    import platform

    return platform.processor() or platform.machine()


def _cpuinfo_line() -> str:
    from keras_mp.device import _cpuinfo

    return _cpuinfo.describe()


def _info(args: argparse.Namespace) -> int:
    import keras
    import tensorflow as tf

    from keras_mp import device
    from keras_mp._version import __version__
    from keras_mp.device.xla import uses_xla

    prof = device.profile()
    gpus = tf.config.list_physical_devices("GPU")
    tpus = tf.config.list_logical_devices("TPU")
    flags = ", ".join(sorted(prof.flags)) or "none of amx_bf16/avx512_bf16/amx_fp16/avx512_fp16"
    lines = [
        f"keras-mp {__version__}, Keras {keras.__version__}, "
        f"TensorFlow {tf.__version__}",
        f"CPU: {_cpu_name()} ({os.cpu_count()} cores); low-precision flags: {flags}",
        f"  {_cpuinfo_line()}",
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
    f8 = ("float8 units: yes (Dense/EinsumDense may train in float8)"
          if prof.hardware.get("float8") else
          "float8 units: none (float8 would be emulated; 'adaptive_float8' still runs it)")
    lines += ["", f"Fast low-precision dtypes here: {fast}", f8,
              f"'adaptive' would choose among: {', '.join(device.default_candidates())}"]
    lines += _execution_lines(prof.device_type)
    lines.append(f"XLA for fused elementwise work now: {uses_xla('elementwise')}; "
                 f"for fused layers' matmuls now: {uses_xla('matmul')}")
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
    lines.append(f"Train step under 'adaptive' ({', '.join(cands)}): this probe favours "
                 f"{execution.choose(cands, device_type)}; each model's own step is timed, "
                 "as a graph, as a graph with the optimizer update under XLA, and under XLA, "
                 "on its first training calls"
                 + (f" (but {execution.ENV_VAR}={override} overrides it)" if override else
                    f" (override: {execution.ENV_VAR}={'|'.join(execution.MODES[1:])})"))
    if cands[0] in ex.matmul and "xla" in ex.matmul[cands[0]]:
        lines.append(f"Fused layers' {cands[0]} matmuls, as measured: "
                     f"{'XLA' if ex.matmul_xla_wins(cands[0]) else 'TensorFlow graph'} "
                     "(applied by keras_mp.execution.configure)")
    return lines


def _bench(args: argparse.Namespace) -> int:
    # keras_mp/cli/command.py -> the folder holding keras_mp/
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(root, "benchmarks", "suite.py")):
        # A source checkout: its own benchmarks/, beside the keras_mp it runs
        # (an editable install may map keras_mp.benchmarks to another checkout).
        if root not in sys.path:
            sys.path.insert(0, root)
        from benchmarks import suite
    else:
        # Installed: benchmarks/ ships as keras_mp.benchmarks.
        from keras_mp.benchmarks import suite

    models = None if args.models is None else [
        m.strip() for m in args.models.split(",") if m.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] \
        if args.variants else None
    suite.run(models=models, quick=args.quick, out=args.out, rounds=args.rounds,
              steps=args.steps, variants=variants, memory=not args.no_memory,
              size=None if args.size is None else suite.parse_size(args.size))
    return 0


def _export(args: argparse.Namespace) -> int:
    import keras

    from keras_mp import _checks
    from keras_mp.deploy import export

    weights = None if args.weights == "float32" else args.weights
    extra = {}
    if args.format == "onnx":
        extra = {"compute_dtype": args.compute_dtype or "float32", "opset": args.opset}
    elif args.compute_dtype is not None or args.opset is not None:
        raise ValueError("--compute-dtype and --opset apply to --format onnx only.")
    # Everything but the model, then the file, before the model is loaded.
    export.check_arguments(args.out, args.format, output_dtype=args.output_dtype,
                           weights=weights, **extra)
    _checks.keras_file("model", args.model)
    model = keras.saving.load_model(args.model, compile=False)
    export.export(model, args.out, args.format, output_dtype=args.output_dtype, weights=weights,
                  **extra)
    compute = f", {extra['compute_dtype']} compute" if extra else ""
    print(f"Wrote {args.out} ({args.format}, float32 inputs, "
          f"{'float32' if args.format == 'litert' else args.output_dtype} outputs{compute})")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-mp",
        description="Mixed-precision training for Keras 3 on TensorFlow.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = sub.add_parser(
        "demo",
        help="adaptive precision rescuing a run that static float16 loses; what this "
             "device runs fast",
        description="Trains one small model on the embedded digits three times (float32, "
                    "static mixed_float16, adaptive float16/float32) on inputs that overflow "
                    "float16, and prints accuracy, the precision switches with their reasons "
                    "and the loss scale; then what this device runs fast and what 'adaptive' "
                    "picks here. About a minute on 2 CPU cores.")
    demo.add_argument("--epochs", type=int, default=4, help="epochs (default: %(default)s)")
    demo.add_argument("--batch-size", type=int, default=32,
                      help="batch size (default: %(default)s)")
    demo.add_argument("--out", default=".", help="folder for the PNG plot "
                                                 "(default: the current folder)")
    demo.add_argument("--quiet", action="store_true", help="no per-epoch lines")
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
                    "Keras variant, and each variant's peak memory (a fresh process each); "
                    "writes bench.json and bench.png.")
    bench.add_argument("--quick", action="store_true",
                       help="the mlp and transformer models, smaller (under 3 minutes on 2 "
                            "cores)")
    bench.add_argument("--variants", default=None,
                       help="comma-separated subset of keras_float32, keras_float32_xla, "
                            "keras_mixed_bfloat16, keras_mixed_bfloat16_xla, "
                            "keras_mixed_float16, keras_mixed_float16_xla, keras_mp "
                            "(default: all; --quick leaves out the Keras one-liners of a "
                            "16-bit dtype this device has no hardware support for)")
    bench.add_argument("--rounds", type=int, default=None,
                       help="interleaved timed rounds, >= 5 (default: 5 quick, 7 full)")
    bench.add_argument("--steps", type=int, default=None,
                       help="training steps per round and variant, >= 5 (default: 20)")
    bench.add_argument("--models", default=None,
                       help="comma-separated, among mlp, cnn, transformer, gpt2 (needs "
                            "keras-hub), resnet (default: all; with --quick: mlp,transformer)")
    bench.add_argument("--size", default=None,
                       help="override the models' sizes, e.g. batch=64,length=256 (keys: "
                            "batch for all; features, width, depth for mlp; side, filters "
                            "for cnn; length, dim, blocks for transformer and gpt2; "
                            "vocabulary for gpt2; side for resnet)")
    bench.add_argument("--no-memory", action="store_true",
                       help="do not measure each variant's peak memory")
    bench.add_argument("--out", default=None, help="folder for bench.json and bench.png")
    bench.set_defaults(func=_bench)

    exp = sub.add_parser(
        "export", help="write a .keras model as a SavedModel, a LiteRT or an ONNX file",
        description="Loads MODEL.keras (adaptive, fused or quantized) and writes it for "
                    "serving with keras_mp.deploy.export.export: a SavedModel folder, a .tflite "
                    "file or a .onnx file (needs keras-mp[onnx]), with float32 inputs and "
                    "outputs.")
    exp.add_argument("model", help="the .keras file")
    exp.add_argument("out", help="the SavedModel folder, .tflite or .onnx file to write")
    exp.add_argument("--format", default="tf_saved_model",
                     choices=["tf_saved_model", "litert", "onnx"],
                     help="(default: %(default)s)")
    exp.add_argument("--weights", default="float32", choices=["float32", "float16", "int8"],
                     help="LiteRT weight storage (default: %(default)s)")
    exp.add_argument("--output-dtype", default="float32", choices=["float32", "compute"],
                     help="SavedModel outputs: float32, or the model's own dtype "
                          "(default: %(default)s)")
    exp.add_argument("--compute-dtype", default=None, choices=["float32", "float16"],
                     help="ONNX compute dtype; float32 layers of a mixed model stay "
                          "float32 (default: float32)")
    exp.add_argument("--opset", type=int, default=None,
                     help="ONNX opset, 13 to 18 (default: tf2onnx's, 15)")
    exp.set_defaults(func=_export)
    # Read by keras_mp._backend before TensorFlow loads; accepted before or
    # after the command.
    verbose = "show TensorFlow's native start-up log (hidden by default)"
    parser.add_argument("--verbose", action="store_true", help=verbose)
    for command in sub.choices.values():
        try:
            command.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help=verbose)
        except argparse.ArgumentError:
            pass  # the command has its own --verbose
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, ImportError) as e:
        # One line, no traceback: what was wrong and the fix (a missing extra
        # names its pip install).
        print(f"keras-mp {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
