"""Reranking throughput: pairs/s through Fern's packed engine beside sentence-transformers' CrossEncoder.predict, same GPU, same pairs, same run.

`python -m benchmarks.rerank [--arch bge-reranker-large] [--queries 20] [--docs 100]
[--doc-tokens 256] [--rounds 3] [--out FILE]` builds the architecture with seeded random
weights (bf16; the bundled MiniLM tokenizer, whose ids every architecture here takes, so both
sides read the very same token ids), makes `--queries` queries of `--docs` documents of
`--doc-tokens` tokens each, and alternates the two engines round by round so both meet the
same machine state:

- Fern: per query, the pairs tokenized (`sidecar.tokenize.pairs`), packed into steps of at
  most the engine's `max_step_tokens`, all steps launched, then their scores collected.
  Bucket shapes are captured as CUDA graphs before timing.
- sentence-transformers: `CrossEncoder.predict(pairs, batch_size=B)` per query, for each
  `--st-batch-sizes` B (padding to the longest pair of each batch, as it does); the best B
  is the baseline.
- `fern serve` (unless `--no-server`): the same checkpoint served, `--server-clients`
  threads each sending its share of the queries as Rerank calls (raw scores) over loopback
  gRPC: what a user's application gets, tokenizing and the wire included.

Both sides' raw logits on the same pairs are compared (max difference, top-10 agreement), and
the rates are set beside the roofline: the model's matmul FLOPs per pair at the card's
sustained bf16 matmul rate, measured in the same run.
`--smoke` runs tiny sizes on the CPU in seconds: a check that the harness works, not a figure.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.models import RERANKERS, TINY_RERANKERS, build_random_reranker, tokenizer_dir
from benchmarks.provenance import result_header
from benchmarks.texts import make_texts


def _pairs_texts(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    """Seeded queries and, per query, its documents, each of the requested token count."""
    tokenizer = tokenizer_dir() / "tokenizer.json"
    queries = make_texts(tokenizer, [args.query_tokens] * args.queries, seed=1)
    documents = make_texts(tokenizer, [args.doc_tokens] * (args.queries * args.docs), seed=2)
    return queries, [documents[i * args.docs:(i + 1) * args.docs] for i in range(args.queries)]


def _steps(sequences: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive groups of sequences of at most `max_tokens` tokens each."""
    steps: list[list[list[int]]] = [[]]
    used = 0
    for seq in sequences:
        if steps[-1] and used + len(seq) > max_tokens:
            steps.append([])
            used = 0
        steps[-1].append(seq)
        used += len(seq)
    return steps


class FernSide:
    """Fern's engine and pair tokenizer on one reranker directory."""

    def __init__(self, path: Path, device: str, max_step_tokens: int | None) -> None:
        from core_engine.engine import Engine
        from sidecar.tokenize.pairs import PairTokenizer

        self.engine = Engine(path, device=device, max_step_tokens=max_step_tokens)
        self.pairs = PairTokenizer.for_spec(self.engine.spec)

    def scores(self, query: str, documents: list[str]):
        import numpy as np

        sequences = self.pairs.encode(query, documents)
        handles = [self.engine.step(self.engine.prepare(step))
                   for step in _steps(sequences, self.engine.max_step_tokens)]
        return np.concatenate([h.result()[:, 0] for h in handles])

class CrossEncoderSide:
    """sentence-transformers' CrossEncoder on the same directory, the same dtype and device."""

    def __init__(self, path: Path, device: str, dtype) -> None:
        import torch
        import transformers
        from sentence_transformers import CrossEncoder

        # transformers 4.56 renamed from_pretrained's torch_dtype to dtype.
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        # A local directory: nothing to fetch, ever.
        self.model = CrossEncoder(str(path), device=device, max_length=512, local_files_only=True,
                                  model_kwargs={key: dtype})
        self.identity = torch.nn.Identity()

    def scores(self, query: str, documents: list[str], batch_size: int):
        return self.model.predict([(query, d) for d in documents], batch_size=batch_size,
                                  activation_fn=self.identity, show_progress_bar=False)


class ServerSide:
    """`fern serve` on the same directory, called by `clients` threads, one Rerank call per query."""

    def __init__(self, path: Path, device: str, clients: int, log_dir: Path) -> None:
        from benchmarks.server import start_sidecar
        from sidecar.client import FernClient

        self.served = start_sidecar(path, device=device, log_dir=log_dir, name="rerank")
        self.client = FernClient(self.served.target, timeout=120.0)
        self.clients = clients

    def scores(self, query: str, documents: list[str]):
        import numpy as np

        ranked = self.client.rerank(query, documents, raw_scores=True, lane="batch")
        out = np.empty(len(documents), dtype=np.float32)
        for result in ranked.results:
            out[result.index] = result.score
        return out

    def run_all(self, queries: list[str], documents: list[list[str]]) -> None:
        """Every query once, spread over the client threads."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.clients) as pool:
            list(pool.map(self.scores, queries, documents))

    def close(self) -> None:
        self.client.close()
        self.served.stop()


def _sig(x: float) -> float:
    """`x` to 6 significant digits."""
    return float(f"{float(x):.6g}")


def _timed(run, queries: list[str], documents: list[list[str]], sync) -> float:
    sync()
    start = time.perf_counter()
    for query, docs in zip(queries, documents):
        run(query, docs)
    sync()
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    arch_table = TINY_RERANKERS if args.smoke else RERANKERS
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    cache = Path(args.model_dir or Path(tempfile.gettempdir()) / "fern-bench-rerankers")
    path = build_random_reranker(arch_table[args.arch], cache / f"{args.arch}-{str(dtype).split('.')[-1]}",
                                 seed=0, dtype=dtype)
    queries, documents = _pairs_texts(args)
    fern = FernSide(path, args.device, args.max_step_tokens)
    st = CrossEncoderSide(path, args.device, dtype)
    server = None if args.no_server else ServerSide(path, args.device, args.server_clients,
                                                   Path(tempfile.mkdtemp(prefix="fern-rerank-")))
    try:
        return _measure(args, arch_table, dtype, queries, documents, fern, st, server)
    finally:
        if server is not None:
            server.close()


def _measure(args, arch_table, dtype, queries, documents, fern, st, server) -> dict[str, Any]:
    import numpy as np
    import torch

    from benchmarks.suite import flops_per_token, matmul_tflops, sustained_matmul_tflops

    def sync() -> None:
        if args.device != "cpu":
            torch.cuda.synchronize()

    # Warm-up: every step shape of these pairs captured (eager, capture, replay), every ST batch shape seen.
    for _ in range(fern.engine.policy.eager_hits + 2):
        for query, docs in zip(queries, documents):
            fern.scores(query, docs)
    for b in args.st_batch_sizes:
        st.scores(queries[0], documents[0], b)
    if server is not None:
        for _ in range(4):  # the server's engine captures its bucket shapes lazily too
            server.run_all(queries, documents)

    ours = np.concatenate([fern.scores(q, d) for q, d in zip(queries, documents)])
    theirs = np.concatenate([st.scores(q, d, args.st_batch_sizes[0]) for q, d in zip(queries, documents)])
    served = None if server is None else np.concatenate([server.scores(q, d) for q, d in zip(queries, documents)])
    top = max(1, min(10, args.docs // 2))
    overlap = [len(set(np.argsort(-ours[i * args.docs:(i + 1) * args.docs])[:top])
                   & set(np.argsort(-theirs[i * args.docs:(i + 1) * args.docs])[:top])) / top
               for i in range(args.queries)]

    pairs = args.queries * args.docs
    fern_times: list[float] = []
    st_times: dict[int, list[float]] = {b: [] for b in args.st_batch_sizes}
    server_times: list[float] = []
    for _ in range(args.rounds):
        fern_times.append(_timed(fern.scores, queries, documents, sync))
        for b in args.st_batch_sizes:
            st_times[b].append(_timed(lambda q, d, b=b: st.scores(q, d, b), queries, documents, sync))
        if server is not None:
            start = time.perf_counter()
            server.run_all(queries, documents)
            server_times.append(time.perf_counter() - start)

    def rate(times: list[float]) -> float:
        return round(pairs / statistics.median(times), 1)

    st_rates = {str(b): rate(t) for b, t in st_times.items()}
    best = max(st_rates, key=lambda b: st_rates[b])
    lengths = [len(seq) for q, d in zip(queries, documents) for seq in fern.pairs.encode(q, d)]
    tokens = sum(lengths)
    spec = fern.engine.spec
    # Per pair: each pair's own matmul FLOPs (attention grows with its length), summed over all pairs.
    flops_per_pair = sum(n * flops_per_token(spec.config, spec.family, n, spec.causal) for n in lengths) / pairs
    peak = matmul_tflops(args.device)
    sustained = sustained_matmul_tflops(args.device) or peak
    ceiling = sustained * 1e12 / flops_per_pair  # pairs/s at the sustained matmul rate

    def fraction(pairs_per_s: float) -> float:
        return round(pairs_per_s / ceiling, 3)

    fern_rate = rate(fern_times)
    roofline = {"flops_per_pair": round(flops_per_pair), "matmul_tflops": _sig(peak),
                "matmul_tflops_sustained": _sig(sustained),
                "pairs_per_s_at_sustained_matmul_rate": round(ceiling, 1),
                "fern_engine_fraction": fraction(fern_rate),
                "sentence_transformers_fraction": fraction(st_rates[best]),
                "most_possible_over_sentence_transformers": round(ceiling / st_rates[best], 2)}
    server_result = None
    if server is not None:
        server_rate = rate(server_times)
        server_result = {"pairs_per_s": server_rate, "round_seconds": [round(t, 4) for t in server_times],
                         "clients": args.server_clients, "lane": "batch",
                         "over_sentence_transformers": round(server_rate / st_rates[best], 3),
                         "max_abs_logit_difference_vs_engine": _sig(np.abs(served - ours).max()),
                         "command": " ".join(server.served.command[1:])}
        roofline["fern_serve_fraction"] = fraction(server_rate)
    return {
        "arch": args.arch, "config": arch_table[args.arch].config, "device": str(fern.engine.device),
        "gpu": torch.cuda.get_device_name(fern.engine.device) if fern.engine.device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."), "attention": fern.engine.attention.name,
        "torch": torch.__version__,
        "workload": {"queries": args.queries, "documents_per_query": args.docs, "doc_tokens": args.doc_tokens,
                     "query_tokens": args.query_tokens, "pair_tokens_mean": round(tokens / pairs, 1),
                     "rounds": args.rounds, "timing": "median over rounds of all queries, one call per query"},
        "fern": {"pairs_per_s": fern_rate, "round_seconds": [round(t, 4) for t in fern_times],
                 "max_step_tokens": fern.engine.max_step_tokens, "graphs": fern.engine.counters.as_dict()},
        "sentence_transformers": {"pairs_per_s_by_batch_size": st_rates, "best_batch_size": int(best),
                                  "pairs_per_s": st_rates[best]},
        "fern_over_sentence_transformers": round(fern_rate / st_rates[best], 3),
        "fern_serve": server_result,
        "roofline": roofline,
        # Random weights: the logits are close together, so the difference is given beside their range.
        "agreement": {"max_abs_logit_difference": _sig(np.abs(ours - theirs).max()),
                      "logit_range": _sig(np.ptp(theirs)), "max_abs_logit": _sig(np.abs(theirs).max()),
                      f"top{top}_overlap_mean": round(float(np.mean(overlap)), 4)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rerank", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="bge-reranker-large", help=f"one of {sorted(RERANKERS)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--docs", type=int, default=100, help="documents per query")
    parser.add_argument("--doc-tokens", type=int, default=256, help="tokens of each document, specials included")
    parser.add_argument("--query-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--st-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128])
    parser.add_argument("--max-step-tokens", type=int, default=None,
                        help="tokens per engine step (default: the engine's); a query's pairs are split into such steps")
    parser.add_argument("--server-clients", type=int, default=4,
                        help="threads calling `fern serve`'s Rerank at once, each with its share of the queries")
    parser.add_argument("--no-server", action="store_true", help="leave out the served side")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the random checkpoint is kept")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU (the architecture's small twin): checks the harness runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.arch = {"bge-reranker-large": "xlm-roberta", "ms-marco-minilm": "bert"}.get(args.arch, args.arch)
        args.device, args.queries, args.docs, args.doc_tokens, args.rounds = "cpu", 2, 6, 24, 1
        args.st_batch_sizes = [4]
    out = args.out or Path("benchmarks/results") / ("cpu" if args.device == "cpu" else "gpu") / "rerank.json"
    result = {**result_header("benchmarks.rerank", argv), **measure(args)}
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
