"""`fern serve` with a stand-in forward pass, so the process around the engine can be measured on a CPU machine.

    python -m tools.profiling.stand_in --engine-us 100 --engine-ns-per-token 100 serve [fern serve flags]

Everything is `fern serve`'s own (its flags, doors, tokenizers, scheduler, event loop and
start-up) except each engine's forward pass: a step's result is ready `--engine-us` plus
`--engine-ns-per-token` times its tokens after `step()` returns, as a GPU step's event is,
and the schedulers collect it as they collect a CUDA engine's. The host's cores stay free
of forward passes, as beside a GPU, so what bulk requests cost the queries sharing the
process (tokenizing, the event loop, the engine thread's Python, the GIL) shows. Pass the
GPU's step budgets (`--max-step-tokens 8192 --online-step-tokens 2048`), since the CPU
defaults are for a CPU engine. `benchmarks.lanes_e2e --stand-in` starts it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profiling.stand_in", description=__doc__.splitlines()[0])
    parser.add_argument("--engine-us", type=float, default=100.0, help="a step's fixed time (default %(default)s)")
    parser.add_argument("--engine-ns-per-token", type=float, default=100.0,
                        help="a step's time per token (default %(default)s: 10 M tokens/s)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not rest or rest[0] != "serve":
        parser.error("expected `serve` and fern serve's flags after the stand-in's own")

    install_stand_in(args.engine_us, args.engine_ns_per_token)
    from sidecar.cli import main as fern

    return fern(rest)


def install_stand_in(engine_us: float, engine_ns_per_token: float) -> None:
    """Make `fern serve` in this process load its models with the stand-in forward pass."""
    import sidecar.serve
    from tools.profiling.overhead import with_stand_in

    load = sidecar.serve.load_registry

    def load_with_stand_in(*a, **kw):
        return with_stand_in(load(*a, **kw), engine_us, engine_ns_per_token)

    sidecar.serve.load_registry = load_with_stand_in


if __name__ == "__main__":
    raise SystemExit(main())
