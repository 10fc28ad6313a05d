"""The `fern bench` verb: argument parsing for the benchmark harness, registered by sidecar.cli."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

SUITES = ("cpu", "gpu")
PARTS = ("latency", "throughput", "compare", "capture", "backends")


def register(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the `bench` verb to the `fern` command's subparsers and return its parser."""
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmark suite and write JSON + PNG results",
        description=(
            "Run Fern's benchmark suite. 'cpu' is a small version that finishes in about "
            "two minutes on a laptop; 'gpu' is the full suite (H200-sized)."
        ),
    )
    parser.add_argument("--suite", choices=SUITES, default=os.environ.get("FERN_BENCH_SUITE", "cpu"),
                        help="which suite to run (env FERN_BENCH_SUITE; default cpu)")
    parser.add_argument("--only", action="append", choices=PARTS, default=None,
                        help="run only these parts of the suite (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("FERN_BENCH_OUT", "benchmarks/results")),
                        help="folder for the JSON and PNG results (env FERN_BENCH_OUT)")
    parser.add_argument("--device", default=os.environ.get("FERN_DEVICE", "auto"),
                        help="torch device for the engine: auto, cpu, cuda, cuda:N (env FERN_DEVICE)")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where random-weight models of the real configs are built and cached")
    parser.add_argument("--attention", default="auto",
                        help="force an attention backend (auto, varlen, flashinfer, cpu)")
    parser.add_argument("--no-grpc", action="store_true",
                        help="skip the end-to-end gRPC runs (they start `fern serve` in a subprocess)")
    parser.add_argument("--latency-models", nargs="+", default=None, metavar="NAME",
                        help="the latency part's models instead of the suite's (e.g. minilm bge-base)")
    parser.add_argument("--latency-lengths", nargs="+", type=int, default=None, metavar="TOKENS",
                        help="the latency part's tokens per text instead of the suite's")
    parser.add_argument("--compare-models", nargs="+", default=None, metavar="NAME",
                        help="the compare part's models instead of the suite's (e.g. minilm)")
    parser.add_argument("--capture-prewarm", default="", metavar="SPEC",
                        help="the capture part also loads a server started with --prewarm SPEC (e.g. queries), "
                             "with the same requests as the lazy one")
    parser.add_argument("--capture-compile-in-background", action="store_true",
                        help="the capture part also loads a server started with --compile-in-background "
                             "(SERVING before the compile), with the same requests as the plain one")
    parser.add_argument("--texts", choices=("zipf", "words"), default="zipf",
                        help="the texts' words: drawn by Zipf's law from the tokenizer's vocabulary with "
                             "sentences and punctuation (default), or an even draw from a 200-word list")
    parser.add_argument("--tag", default="",
                        help="suffix for the result file names, e.g. the machine")
    parser.set_defaults(func=run_from_args)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Run the suite selected by parsed `fern bench` arguments; returns the exit status."""
    from benchmarks.suite import BenchOptions, run_suite

    options = BenchOptions(
        suite=args.suite,
        parts=tuple(args.only) if args.only else PARTS,
        out=args.out,
        device=args.device,
        models_dir=args.models_dir,
        attention=args.attention,
        grpc=not args.no_grpc,
        tag=args.tag,
        latency_models=tuple(args.latency_models or ()),
        latency_lengths=tuple(args.latency_lengths or ()),
        compare_models=tuple(args.compare_models or ()),
        capture_prewarm=args.capture_prewarm,
        capture_compile_in_background=args.capture_compile_in_background,
        texts=args.texts,
    )
    run_suite(options)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m benchmarks.cli`, the same as `fern bench`."""
    parser = argparse.ArgumentParser(prog="fern")
    sub = parser.add_subparsers(dest="verb", required=True)
    register(sub)
    args = parser.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
