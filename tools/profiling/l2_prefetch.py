"""Would prefetching the next weights into L2 make batch-1 projections faster? (CUDA only)

At batch 1 a projection reads its whole weight to do little arithmetic, and on an H200 every
cuBLAS projection of a 128-token step takes 5–10 µs inside a CUDA graph whatever its size
: the weights stream from HBM through few blocks. Those
reads do not depend on the activations, so a second stream could read the next weights into
L2 (50 MB on the H200) while the current projections run, and the projection would then read
L2. This measures that before any engine change, on the BGE-M3 layer shapes:

- ``chain``: 24 layers of the four projections (qkv, out, up, down), each feeding the next,
  as one CUDA graph (the baseline: what the engine's replay does for these matmuls);
- ``next_layer``: the same, and at each layer's start a side stream reads the next layer's
  four weights (a sum over each, the result unused);
- ``same_layer``: at each layer's start the side stream reads this layer's last three weights
  while its first projection runs;
- ``l2_resident``: the chain with one layer's weights reused by all 24 layers (an upper bound:
  every weight read hits L2).

`python -m tools.profiling.l2_prefetch --out DIR` writes DIR/l2-prefetch-<tag>.json with the command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.pg_common import write_result
from benchmarks.provenance import code_identity


def _layers(n: int, hidden: int, inter: int, distinct: bool) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    shapes = [(3 * hidden, hidden), (hidden, hidden), (inter, hidden), (hidden, inter)]
    made = []
    for i in range(n):
        if i and not distinct:
            made.append(made[0])
            continue
        made.append([(torch.randn(o, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5,
                      torch.randn(o, device="cuda", dtype=torch.bfloat16)) for o, k in shapes])
    return made


def _forward(x: torch.Tensor, layers, hidden: int, mode: str, side: torch.cuda.Stream) -> torch.Tensor:
    main = torch.cuda.current_stream()
    for i, layer in enumerate(layers):
        ahead = {"next_layer": layers[i + 1] if i + 1 < len(layers) else [],
                 "same_layer": layer[1:]}.get(mode, [])
        if ahead:
            side.wait_stream(main)  # not before this layer starts: the lines must still be in L2 when read
            with torch.cuda.stream(side):
                for w, _ in ahead:
                    w.sum(dtype=torch.float32)
        (wq, bq), (wo, bo), (wu, bu), (wd, bd) = layer
        a = F.linear(x, wq, bq)[:, :hidden]
        h = F.linear(a, wo, bo)
        u = F.linear(h, wu, bu)
        x = F.linear(u, wd, bd)
    if mode in ("next_layer", "same_layer"):
        main.wait_stream(side)  # a captured fork must join before the capture ends
    return x


def _graph_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.profiling.l2_prefetch", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="h200")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3, help="the modes run in turn this many times")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("l2_prefetch needs a CUDA GPU", file=sys.stderr)
        return 2
    distinct = _layers(args.layers, args.hidden, args.intermediate, distinct=True)
    shared = _layers(args.layers, args.hidden, args.intermediate, distinct=False)
    side = torch.cuda.Stream()
    modes = ("chain", "next_layer", "same_layer", "l2_resident")
    rows: dict[str, dict[str, list[float]]] = {}
    for m in args.rows:
        x = torch.randn(m, args.hidden, device="cuda", dtype=torch.bfloat16)
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                layers = shared if mode == "l2_resident" else distinct
                mode_run = "chain" if mode == "l2_resident" else mode
                runs[mode].append(_graph_ms(lambda: _forward(x, layers, args.hidden, mode_run, side), args.reps))
        rows[str(m)] = runs
        print(m, {mode: [round(v * 1e3 / args.layers, 1) for v in t] for mode, t in runs.items()},
              "µs per layer", flush=True)
    write_result("l2_prefetch", argv, {
        "device_name": torch.cuda.get_device_name(0), "torch": torch.__version__, **code_identity(),
        "unit": "ms per replay of the whole graph (all layers); one entry per round",
        "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "rows": rows,
    }, Path(args.out) / f"l2-prefetch-{args.tag}.json")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
