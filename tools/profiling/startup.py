"""Where an engine's start-up goes, phase by phase, each phase timed in a fresh interpreter.

`fern serve` reports SERVING ~20 s after start for the BGE-M3 architecture on the H200 host.
This times its parts apart: importing torch, the engine, torch._dynamo, torch._inductor and
FlashInfer; the CUDA context; reading the checkpoint onto the device; and the whole Engine with
its own `startup_seconds`. Every measurement runs in a new `python` so that none profits from
another's imports or CUDA context; the checkpoint is read once first, so every read finds it in
the page cache, as a restart does. (Stop 19 on the H200: the imports take ~13 s, the read 0.5 s.)

Ways of reading the checkpoint onto the device:
  loader      `core_engine.loader.read_checkpoint(dir, device)` (safetensors' `load_file`)
  cpu-then    `load_file` onto the CPU, then each tensor `.to(device)`
  staged      the file read in 64 MB pieces into two pinned buffers, each piece copied to the
              device while the next is read; the tensors are views of one device buffer

Usage: python -m tools.profiling.startup --model DIR [--device cuda] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.provenance import result_header

# Each snippet prints one JSON line of seconds; `T0` is taken before its first import.
_PRELUDE = "import time; T0 = time.perf_counter()\nimport json\n"

# Waits for the device's queued work (nothing to wait for on the CPU).
_SYNC = "SYNC = __import__('torch').cuda.synchronize if DEVICE.startswith('cuda') else (lambda: None)\n"

_SNIPPETS: dict[str, str] = {
    "import torch": "import torch\nprint(json.dumps({'seconds': time.perf_counter() - T0}))",
    "import the engine": (
        "import core_engine.engine\nprint(json.dumps({'seconds': time.perf_counter() - T0}))"),
    "import torch._dynamo": (
        "import torch\nt = time.perf_counter()\nimport torch._dynamo\n"
        "print(json.dumps({'seconds': time.perf_counter() - t}))"),
    "import torch._inductor": (
        "import torch, torch._dynamo\nt = time.perf_counter()\nimport torch._inductor.compile_fx\n"
        "print(json.dumps({'seconds': time.perf_counter() - t}))"),
    "import flashinfer": (
        "import torch\nt = time.perf_counter()\nimport flashinfer\n"
        "print(json.dumps({'seconds': time.perf_counter() - t}))"),
    "cuda context": (
        "import torch\nt = time.perf_counter()\ntorch.cuda.init(); torch.empty(1, device=DEVICE)\n"
        "SYNC()\nprint(json.dumps({'seconds': time.perf_counter() - t}))"),
    "read: loader": (
        "import torch\nfrom core_engine.loader import read_checkpoint\n"
        "torch.empty(1, device=DEVICE); SYNC()\nt = time.perf_counter()\n"
        "w = read_checkpoint(MODEL, DEVICE); SYNC()\n"
        "print(json.dumps({'seconds': time.perf_counter() - t, 'tensors': len(w)}))"),
    "read: cpu-then": (
        "import torch\nfrom core_engine.loader import read_checkpoint\n"
        "torch.empty(1, device=DEVICE); SYNC()\nt = time.perf_counter()\n"
        "w = {k: v.to(DEVICE) for k, v in read_checkpoint(MODEL, 'cpu').items()}; SYNC()\n"
        "print(json.dumps({'seconds': time.perf_counter() - t, 'tensors': len(w)}))"),
    "read: staged": (
        "import torch\nfrom tools.profiling.startup import staged_read\n"
        "torch.empty(1, device=DEVICE); SYNC()\nt = time.perf_counter()\n"
        "w = staged_read(MODEL / 'model.safetensors', DEVICE); SYNC()\n"
        "print(json.dumps({'seconds': time.perf_counter() - t, 'tensors': len(w)}))"),
    "engine": (
        "import torch\nfrom core_engine.engine import Engine\nt = time.perf_counter()\n"
        "e = Engine(MODEL, device=DEVICE)\n"
        "print(json.dumps({'seconds': time.perf_counter() - t, 'since_start': time.perf_counter() - T0, "
        "'startup_seconds': e.startup_seconds}))"),
}


# Phases timed unless --only names others ("read: cpu-then" and "read: staged" are the
# alternatives to the loader's read, which is not where start-up goes).
DEFAULT_PHASES = ["import torch", "import the engine", "import torch._dynamo", "import torch._inductor",
                  "import flashinfer", "cuda context", "read: loader", "engine"]


def staged_read(path: Path, device: str, piece: int = 64 << 20) -> dict[str, Any]:
    """A safetensors file's tensors on `device`, read through two pinned buffers (a probe)."""
    import torch

    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
              "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        total = max(entry["data_offsets"][1] for entry in header.values())
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        buffers = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events = [torch.cuda.Event(), torch.cuda.Event()]
        stream = torch.cuda.Stream(device)
        done = 0
        for i in range(0, total, piece):
            n = min(piece, total - i)
            buf, event = buffers[(i // piece) % 2], events[(i // piece) % 2]
            if done >= 2:
                event.synchronize()  # the copy out of this buffer two pieces ago has finished
            f.readinto(memoryview(buf.numpy())[:n])
            with torch.cuda.stream(stream):
                flat[i:i + n].copy_(buf[:n], non_blocking=True)
                event.record(stream)
            done += 1
        stream.synchronize()
    out = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        out[name] = flat[start:end].view(dtypes[entry["dtype"]]).view(entry["shape"])
    return out


def _run(name: str, model: Path, device: str) -> dict[str, Any]:
    code = _PRELUDE + f"from pathlib import Path\nMODEL = Path({str(model)!r}); DEVICE = {device!r}\n" + _SYNC \
        + _SNIPPETS[name]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall_seconds"] = wall
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="model directory (model.safetensors)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=2, help="times each phase runs, interleaved")
    parser.add_argument("--only", nargs="*", choices=list(_SNIPPETS),
                        help=f"phases to time (default: {', '.join(DEFAULT_PHASES)})")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    names = args.only or DEFAULT_PHASES
    _run("read: loader", args.model, args.device)  # the file into the page cache
    header = {**result_header("tools.profiling.startup", argv), "model": str(args.model),
              "checkpoint_bytes": sum(p.stat().st_size for p in args.model.glob("*.safetensors"))}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    summary: dict[str, float] = {}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(_run(name, args.model, args.device))
            print(f"{name:22s} {json.dumps(runs[name][-1])}", flush=True)
        # Written after every round, so that a run cut short keeps the rounds it finished.
        summary = {name: round(statistics.median(r["seconds"] for r in rs), 3)
                   for name, rs in runs.items() if rs and all("seconds" in r for r in rs)}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**header, "median_seconds": summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
