"""A BGE-M3-shaped checkpoint directory, built offline: the real BGE-M3 config shrunk, random weights, both heads.

The encoder is transformers' XLMRobertaModel with BGE-M3's config (pad 1, bos 0, eos 2,
one token type, 8,194 positions, layer norm eps 1e-5, CLS pooling, normalized), narrowed
and shortened; `sparse_linear.pt` and `colbert_linear.pt` are torch Linear state dicts as
FlagEmbedding saves them. The tokenizer is an XLM-R style SentencePiece Unigram over a
small vocabulary (`<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, `<mask>` last), built with
`tokenizers`, with XLM-R's `<s> $A </s>` template.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.models import ARCHS

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
WORDS = ("the a of and to in is for on with as by that this it vector search data query index table row model "
         "token graph memory database embedding sentence dense sparse late interaction retrieval engine "
         "fox dog quick brown lazy jumps over hello world apple river ocean city music paris france "
         "capital what where how fast qdrant postgres sidecar batch online lane").split()
SUFFIXES = ("s", "ing", "ed", "er", "ly", "es")


def xlmr_tokenizer():
    """An XLM-R style Unigram tokenizer: letters, a few words and suffixes; anything else is `<unk>`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    letters = "abcdefghijklmnopqrstuvwxyz0123456789.,?!'"
    vocab = [(t, 0.0) for t in SPECIALS] + [("\u2581", -3.0)]
    vocab += [("\u2581" + w, -2.0 - 0.01 * i) for i, w in enumerate(WORDS)]
    vocab += [(s, -4.0) for s in SUFFIXES]
    vocab += [("\u2581" + c, -6.0) for c in letters] + [(c, -7.0) for c in letters]
    vocab.append(("<mask>", 0.0))
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS + ["<mask>"]])
    return tokenizer


@dataclass
class BgeM3Checkpoint:
    """The directory and the reference modules its files hold."""

    path: Path
    encoder: torch.nn.Module        # transformers XLMRobertaModel, eval, fp32
    sparse: torch.nn.Linear | None  # sparse_linear.pt
    colbert: torch.nn.Linear | None  # colbert_linear.pt
    unused: tuple[int, ...] = (0, 1, 2, 3)  # cls, pad, eos, unk


def build_bge_m3(path: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                 sparse: bool = True, colbert: bool = True, colbert_dim: int | None = None) -> BgeM3Checkpoint:
    """Write a BGE-M3-shaped directory at ``path`` with seeded random weights."""
    import transformers
    from safetensors.torch import save_file

    tokenizer = xlmr_tokenizer()
    config = dict(ARCHS["bge-m3"].config, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, intermediate_size=4 * hidden,
                  vocab_size=tokenizer.get_vocab_size())
    torch.manual_seed(seed)
    encoder = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**config), add_pooling_layer=False).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights well away from init, so a mixed-up tensor cannot hide
        for name, p in encoder.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    path.mkdir(parents=True, exist_ok=True)
    encoder.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(path / "model.safetensors"))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "sep_token": "</s>",
        "unk_token": "<unk>", "mask_token": "<mask>", "model_max_length": 8192,
        "tokenizer_class": "XLMRobertaTokenizer"}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    heads_out = {}
    for name, wanted, out in (("sparse", sparse, 1), ("colbert", colbert, colbert_dim or hidden)):
        if not wanted:
            heads_out[name] = None
            continue
        linear = torch.nn.Linear(hidden, out)
        with torch.no_grad():
            linear.weight.copy_(0.2 * torch.randn(linear.weight.shape, generator=g))
            linear.bias.copy_(0.05 * torch.randn(linear.bias.shape, generator=g))
        torch.save(linear.state_dict(), path / f"{name}_linear.pt")
        heads_out[name] = linear.eval()
    return BgeM3Checkpoint(path, encoder, heads_out["sparse"], heads_out["colbert"])


@dataclass
class M3Reference:
    """The model card's three outputs for one text."""

    dense: torch.Tensor                 # [H], L2-normalized CLS state
    sparse: dict[int, float]            # token id -> largest relu(sparse_linear(h)) weight
    colbert: torch.Tensor               # [L - 1, dim], L2-normalized colbert_linear(h[1:])


def m3_reference(ckpt: BgeM3Checkpoint, sequences: list[list[int]],
                 dtype: torch.dtype = torch.float32) -> list[M3Reference]:
    """BGE-M3's formulas in plain torch over transformers' padded-batch outputs (CPU), with the
    encoder and heads in `dtype` (fp32: the reference; bf16: how far bf16 alone moves it)."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), 1, dtype=torch.long)  # <pad>
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    encoder, sparse, colbert_head = (copy.deepcopy(m).to(dtype) if dtype != torch.float32 and m is not None else m
                                     for m in (ckpt.encoder, ckpt.sparse, ckpt.colbert))
    with torch.inference_mode():
        hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        dense = torch.nn.functional.normalize(hidden[:, 0].float(), dim=-1)
        weights = torch.relu(sparse(hidden)).squeeze(-1).float() if sparse is not None else None
        colbert = None
        if colbert_head is not None:
            colbert = colbert_head(hidden[:, 1:]).float() * mask[:, 1:, None].float()
            colbert = torch.nn.functional.normalize(colbert, dim=-1)
    out = []
    for i, s in enumerate(sequences):
        lexical: dict[int, float] = {}
        if weights is not None:
            for token, w in zip(s, weights[i, : len(s)].tolist()):
                if token not in ckpt.unused and w > 0 and w > lexical.get(token, 0.0):
                    lexical[token] = w
        vectors = colbert[i, : len(s) - 1] if colbert is not None else torch.zeros(0)
        out.append(M3Reference(dense[i], lexical, vectors))
    return out


def sparse_gap(a: list[M3Reference], b: list[M3Reference]) -> float:
    """The largest difference of one token's sparse weight between two references."""
    return max((abs(x.sparse.get(t, 0.0) - y.sparse.get(t, 0.0)) for x, y in zip(a, b)
                for t in set(x.sparse) | set(y.sparse)), default=0.0)
