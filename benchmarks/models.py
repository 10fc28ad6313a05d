"""Model directories with seeded random weights for the real architectures (BGE-M3, BGE-base, Qwen3-0.6B), built locally."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Arch:
    """One architecture: a transformers config, its sentence-transformers pooling and Fern overrides."""

    family: str                 # "bert" | "xlm-roberta" | "qwen3"
    config: dict[str, Any]
    pooling: str                # "cls" | "mean" | "lasttoken"
    normalize: bool
    max_seq_length: int
    fern: dict[str, Any] = field(default_factory=dict)


_QWEN3_06B = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=3072, vocab_size=151669, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
    attention_bias=False, eos_token_id=151643, pad_token_id=151643, bos_token_id=151643,
)

ARCHS: dict[str, Arch] = {
    # BGE-M3 is XLM-RoBERTa large: 24 layers, 1024 wide, 8192 positions, CLS pooling.
    "bge-m3": Arch("xlm-roberta", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        vocab_size=250002, max_position_embeddings=8194, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu"),
        pooling="cls", normalize=True, max_seq_length=8192),
    # all-MiniLM-L6-v2's shape, for machines where the bundled package cannot be installed.
    "minilm": Arch("bert", dict(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
        vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
        hidden_act="gelu", pad_token_id=0),
        pooling="mean", normalize=True, max_seq_length=256),
    "bge-base": Arch("bert", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
        hidden_act="gelu", pad_token_id=0),
        pooling="cls", normalize=True, max_seq_length=512),
    # pplx-embed-v1-0.6b: Qwen3-0.6B with bidirectional attention, mean pooling, int8 output.
    "pplx-0.6b": Arch("qwen3", dict(_QWEN3_06B), pooling="mean", normalize=False, max_seq_length=32768,
                      fern=dict(causal=False, native_int8=True)),
    # Qwen3-Embedding-0.6B: causal, last-token pooling.
    "qwen3-emb-0.6b": Arch("qwen3", dict(_QWEN3_06B), pooling="lasttoken", normalize=True,
                           max_seq_length=32768, fern=dict(causal=True)),
}

# Small versions of each family for GPU parity tests: realistic head sizes (64 and 128, GQA).
TINY: dict[str, Arch] = {
    "bert": Arch("bert", dict(ARCHS["bge-base"].config, hidden_size=256, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=512),
                 pooling="cls", normalize=True, max_seq_length=512),
    "xlm-roberta": Arch("xlm-roberta", dict(ARCHS["bge-m3"].config, hidden_size=256, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=512, vocab_size=30522,
                                            max_position_embeddings=514),
                        pooling="mean", normalize=True, max_seq_length=512),
    "qwen3-causal": Arch("qwen3", dict(_QWEN3_06B, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=128, intermediate_size=512,
                                       vocab_size=30522, max_position_embeddings=1024,
                                       eos_token_id=102, pad_token_id=0, bos_token_id=101),
                         pooling="lasttoken", normalize=True, max_seq_length=512, fern=dict(causal=True)),
    "qwen3-bidirectional": Arch("qwen3", dict(_QWEN3_06B, hidden_size=256, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                              intermediate_size=512, vocab_size=30522,
                                              max_position_embeddings=1024, eos_token_id=102,
                                              pad_token_id=0, bos_token_id=101),
                                pooling="mean", normalize=False, max_seq_length=512,
                                fern=dict(causal=False, native_int8=True)),
}


def tokenizer_dir() -> Path:
    """Where the BERT WordPiece tokenizer files come from: $FERN_TOKENIZER_DIR, else the bundled MiniLM."""
    import os

    if os.environ.get("FERN_TOKENIZER_DIR"):
        return Path(os.environ["FERN_TOKENIZER_DIR"])
    from core_engine.loader import default_model_dir

    return default_model_dir()


def transformers_model(arch: Arch) -> torch.nn.Module:
    """An untrained transformers model of this architecture (weights from the current torch seed)."""
    import transformers

    if arch.family == "bert":
        return transformers.BertModel(transformers.BertConfig(**arch.config), add_pooling_layer=False)
    if arch.family == "xlm-roberta":
        return transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**arch.config), add_pooling_layer=False)
    return transformers.Qwen3Model(transformers.Qwen3Config(**arch.config))


def build_random_model(arch: Arch | str, out_dir: str | Path, *, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str = "cpu",
                       tokenizer_from: str | Path | None = None) -> Path:
    """Write a Hugging Face / sentence-transformers directory with seeded random weights.

    The tokenizer is the bundled MiniLM's (BERT WordPiece, ids < 30522), valid for every
    architecture here; speed and parity do not depend on which ids the text maps to.
    Rebuilding an existing directory is skipped when its marker matches.
    """
    if isinstance(arch, str):
        arch = ARCHS[arch] if arch in ARCHS else TINY[arch]
    out = Path(out_dir)
    marker = out / "fern-random.json"
    fingerprint = json.dumps(dict(config=arch.config, pooling=arch.pooling, fern=arch.fern, seed=seed,
                                  dtype=str(dtype)), sort_keys=True)
    if marker.is_file() and marker.read_text() == fingerprint:
        return out
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers_model(arch)
    model = model.to(dtype)
    model.config.save_pretrained(out)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    del model, state
    if tokenizer_from is None:
        tokenizer_from = tokenizer_dir()
    shutil.copy(Path(tokenizer_from) / "tokenizer.json", out / "tokenizer.json")
    for name in ("tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (Path(tokenizer_from) / name).is_file():
            shutil.copy(Path(tokenizer_from) / name, out / name)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if arch.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    # Arch.pooling is Fern's "cls" / "mean" or sentence-transformers' "lasttoken"; the flags use ST's names.
    mode = {"cls": "cls_token", "mean": "mean_tokens"}.get(arch.pooling, arch.pooling)
    pooling = {f"pooling_mode_{m}": m == mode for m in
               ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    pooling["word_embedding_dimension"] = arch.config["hidden_size"]
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": arch.max_seq_length}))
    if arch.fern:
        (out / "fern.json").write_text(json.dumps(arch.fern))
    marker.write_text(fingerprint)
    return out


def reference_pooled(model: torch.nn.Module, ids: list[int], pooling: str, causal: bool) -> torch.Tensor:
    """transformers' pooled vector for one sequence (no padding), as float32 on the CPU."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    kwargs: dict[str, Any] = {}
    if not causal and isinstance(model, __import__("transformers").Qwen3Model):
        # A ready 4D mask is used as given: every token sees every token (bidirectional).
        kwargs["attention_mask"] = torch.ones(1, 1, len(ids), len(ids), dtype=torch.bool, device=device)
    with torch.inference_mode():
        hidden = model(input_ids=input_ids, **kwargs).last_hidden_state[0].float()
    if pooling == "cls":
        return hidden[0].cpu()
    if pooling == "lasttoken":
        return hidden[-1].cpu()
    return hidden.mean(0).cpu()


# Cross-encoders (one label: a relevance score per (query, document) pair).
RERANKERS: dict[str, Arch] = {
    # BAAI/bge-reranker-large: XLMRobertaForSequenceClassification, XLM-R large, 512 tokens.
    "bge-reranker-large": Arch("xlm-roberta", dict(ARCHS["bge-m3"].config, max_position_embeddings=514),
                               pooling="cls", normalize=False, max_seq_length=512),
    # cross-encoder/ms-marco-MiniLM-L-6-v2: BertForSequenceClassification, MiniLM-L6.
    "ms-marco-minilm": Arch("bert", dict(ARCHS["minilm"].config), pooling="cls", normalize=False,
                            max_seq_length=512),
}

# Small versions of each reranker family: the real configs' structure, shrunk.
TINY_RERANKERS: dict[str, Arch] = {
    "bert": Arch("bert", dict(RERANKERS["ms-marco-minilm"].config, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128, max_position_embeddings=128),
                 pooling="cls", normalize=False, max_seq_length=128),
    "xlm-roberta": Arch("xlm-roberta", dict(RERANKERS["bge-reranker-large"].config, hidden_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                            vocab_size=30522, max_position_embeddings=130),
                        pooling="cls", normalize=False, max_seq_length=128),
}


def reranker_model(arch: Arch) -> torch.nn.Module:
    """An untrained transformers *ForSequenceClassification of this architecture, one label (current torch seed)."""
    import transformers

    if arch.family == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(**arch.config, num_labels=1))
    if arch.family == "xlm-roberta":
        return transformers.XLMRobertaForSequenceClassification(
            transformers.XLMRobertaConfig(**arch.config, num_labels=1))
    raise ValueError(f"no {arch.family} cross-encoder: rerankers are BERT or XLM-RoBERTa")


def save_reranker_dir(model: torch.nn.Module, out_dir: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """A cross-encoder checkpoint directory (config.json, model.safetensors, tokenizer files) for `model`.

    The tokenizer defaults to the bundled MiniLM's (a pair template with token types 0 / 1).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # as transformers' save_pretrained writes it
    model.config.save_pretrained(out)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"))
    source = Path(tokenizer_from) if tokenizer_from is not None else tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (source / name).is_file() and (source / name).resolve() != (out / name).resolve():
            shutil.copy(source / name, out / name)
    return out


def build_random_reranker(arch: Arch | str, out_dir: str | Path, *, seed: int = 0,
                          dtype: torch.dtype = torch.float32, tokenizer_from: str | Path | None = None) -> Path:
    """A cross-encoder directory with seeded random weights (transformers' own initialization).

    Rebuilding an existing directory is skipped when its marker matches."""
    if isinstance(arch, str):
        arch = RERANKERS[arch] if arch in RERANKERS else TINY_RERANKERS[arch]
    marker = Path(out_dir) / "fern-random.json"
    fingerprint = json.dumps(dict(config=arch.config, family=arch.family, seed=seed, dtype=str(dtype),
                                  tokenizer=str(tokenizer_from)), sort_keys=True)
    if marker.is_file() and marker.read_text() == fingerprint:
        return Path(out_dir)
    torch.manual_seed(seed)
    model = reranker_model(arch).to(dtype)
    out = save_reranker_dir(model, out_dir, tokenizer_from)
    if arch.family == "xlm-roberta" and tokenizer_from is None:
        xlmr_pair_layout(out)
    marker.write_text(fingerprint)
    return out


def xlmr_pair_layout(model_dir: str | Path) -> None:
    """Give the WordPiece tokenizer in `model_dir` XLM-R's pair layout, for an XLM-R model with BERT's vocabulary.

    ``[CLS] A [SEP] [SEP] B [SEP]``, all token type 0 (``[CLS]``/``[SEP]`` stand for ``<s>``/``</s>``),
    and a tokenizer_config.json that has transformers read tokenizer.json as it is and send no
    token_type_ids, as XLM-R's tokenizer does: every reader of the directory gets the same ids.
    """
    out = Path(model_dir)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    cls, sep = ({"id": t, "type_id": 0} for t in ("[CLS]", "[SEP]"))
    piece = {"Sequence": {"id": "A", "type_id": 0}}
    second = {"Sequence": {"id": "B", "type_id": 0}}
    specials = tokenizer["post_processor"]["special_tokens"]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": cls}, piece, {"SpecialToken": sep}],
        "pair": [{"SpecialToken": cls}, piece, {"SpecialToken": sep}, {"SpecialToken": sep}, second,
                 {"SpecialToken": sep}],
        "special_tokens": {k: specials[k] for k in ("[CLS]", "[SEP]")},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 512, "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "unk_token": "[UNK]", "mask_token": "[MASK]"}))


def unigram_tokenizer(path: str | Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A SentencePiece-style (Unigram, Metaspace) tokenizer.json trained on `texts`, laid out as XLM-R's.

    Special tokens as XLM-R numbers them (<s> 0, <pad> 1, </s> 2, <unk> 3) and its fast
    tokenizer's templates: ``<s> A </s>`` and ``<s> A </s></s> B </s>``, all type 0.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>")
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = TemplateProcessing(
        single="<s>:0 $A:0 </s>:0", pair="<s>:0 $A:0 </s>:0 </s>:0 $B:0 </s>:0",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded noise in every weight (LayerNorm scales near 1): large enough that a random
    cross-encoder tells pairs apart, where transformers' own initialization scores them all alike."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
