"""Model families by name: the module class and the Hugging Face weight converter of each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from core_engine.models import bert, qwen3


@dataclass(frozen=True)
class Family:
    """How to build one family's module and map its checkpoint names onto it."""

    module: type[nn.Module]
    convert_weights: Callable[..., dict[str, torch.Tensor]]
    # The family's cross-encoder (ModelSpec.kind "reranker"), where it has one.
    scorer: type[nn.Module] | None = None
    convert_scorer_weights: Callable[..., dict[str, torch.Tensor]] | None = None


FAMILIES: dict[str, Family] = {
    "bert": Family(bert.BertEncoder, bert.convert_weights, bert.BertScorer, bert.convert_scorer_weights),
    "xlm-roberta": Family(bert.BertEncoder, bert.convert_weights, bert.BertScorer, bert.convert_scorer_weights),
    "qwen3": Family(qwen3.Qwen3Encoder, qwen3.convert_weights),
}
