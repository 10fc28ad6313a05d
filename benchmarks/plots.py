"""PNG plots of a benchmark result: latency vs tokens, throughput vs texts per request, Fern vs baseline, capture timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(results: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """Write one PNG per part that has data; returns their paths (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    parts = results["parts"]
    device = results["environment"]["device_name"]
    written = []

    lat = {k: v for k, v in (parts.get("latency") or {}).items() if isinstance(v, dict) and "engine" in v}
    if lat:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, e in lat.items():
            xs = [int(k) for k in e["engine"]]
            ax.plot(xs, [e["engine"][k]["engine"]["p50_ms"] for k in e["engine"]], "o-", label=f"{name} engine p50")
            ax.plot(xs, [e["engine"][k]["engine"]["p99_ms"] for k in e["engine"]], "x:", label=f"{name} engine p99")
            e2e = e.get("e2e", {}).get("128")
            if e2e:
                ax.plot([128], [e2e["p50_ms"]], "s", ms=8, label=f"{name} gRPC e2e p50")
            pub = e.get("published", {}).get("e2e_p50_ms")
            if pub:
                ax.axhline(pub, ls="--", lw=0.8, color="gray")
                ax.annotate(f"Perplexity {name} {pub} ms", (xs[0], pub), fontsize=7, va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per text (batch 1)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"Batch-1 latency · {device}")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"{stem}-latency.png"))

    tp = {k: v for k, v in (parts.get("throughput") or {}).items() if isinstance(v, dict) and "engine" in v}
    if tp:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, e in tp.items():
            xs = [int(k) for k in e["engine"]]
            ax.plot(xs, [e["engine"][k]["embeddings_per_s"] for k in e["engine"]], "o-", label=f"{name} Fern engine")
            if "embeddings_per_s" in e.get("e2e", {}):
                ax.plot([e["e2e"]["texts_per_request"]], [e["e2e"]["embeddings_per_s"]], "s", ms=8,
                        label=f"{name} Fern gRPC e2e")
            pub = e.get("published", {}).get("embeddings_per_s")
            if pub:
                ax.plot([100], [pub], "*", ms=10, label=f"{name} Perplexity (published)")
        ax.set_xscale("log")
        ax.set_xlabel(f"texts per request ({parts['throughput'].get('text_tokens')} tokens each)")
        ax.set_ylabel("embeddings / s")
        ax.set_title(f"Throughput · {device}")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"{stem}-throughput.png"))

    cmp_ = {k: v for k, v in (parts.get("compare") or {}).items() if isinstance(v, dict) and "workloads" in v}
    if cmp_:
        fig, ax = plt.subplots(figsize=(7.2, 4.2))
        labels, fern, eng, st, tok = [], [], [], [], []
        for name, e in cmp_.items():
            for wl, r in e["workloads"].items():
                labels.append(f"{name}\n{wl}")
                fern.append(r["fern_tokens_per_s"])
                eng.append(r["fern_engine_tokens_per_s"])
                st.append(r["st_best_tokens_per_s"])
                tok.append(r["tokenizer_tokens_per_s"])
        xs = range(len(labels))
        w = 0.2
        ax.bar([x - 1.5 * w for x in xs], st, w, label="sentence-transformers (best batch)")
        ax.bar([x - 0.5 * w for x in xs], fern, w, label="Fern, tokenization included")
        ax.bar([x + 0.5 * w for x in xs], eng, w, label="Fern engine (pre-tokenized)")
        ax.bar([x + 1.5 * w for x in xs], tok, w, label="tokenizer alone")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"Fern vs sentence-transformers · {device}")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"{stem}-compare.png"))

    cap = parts.get("capture") or {}
    if cap.get("timeline"):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ax.plot([t for t, _ in cap["timeline"]], [ms for _, ms in cap["timeline"]], ".", ms=2)
        ax.axvline(cap["windows_s"][0], color="gray", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("seconds since SERVING")
        ax.set_ylabel("request latency (ms)")
        ax.set_title(f"Mixed load with lazy capture ({cap['model']}) · {device}")
        written.append(_save(fig, out / f"{stem}-capture.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
