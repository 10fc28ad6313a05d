"""The gateway in process, on the real CPU engine and scheduler: chunking, prompts, limits, draining."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from core_engine.loader import default_model_dir
from sidecar.errors import EmbedError
from sidecar.gateway import EmbedParams, Gateway
from sidecar.registry import ModelSource, Registry
from sidecar.scheduler import Lane, SchedulerConfig


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def registry(loop, tmp_path_factory):
    """The bundled model, and a copy of it (weights linked) whose config defines prompts."""
    prompted = tmp_path_factory.mktemp("prompted")
    for item in default_model_dir().iterdir():
        (prompted / item.name).symlink_to(item)
    (prompted / "config_sentence_transformers.json").unlink()
    (prompted / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": ""}, "default_prompt_name": "query"}))
    # Queue bounds small enough that a 300-input request needs several chunks.
    config = SchedulerConfig.for_device("cpu", max_queued_tokens_online=1024,
                                        max_queued_tokens_batch=2048)
    reg = Registry.load([ModelSource(None), ModelSource(prompted, "prompted")], device="cpu",
                        scheduler_config=config, tokenizer_workers=2)
    loop.run_until_complete(reg.start())
    yield reg
    loop.run_until_complete(reg.drain())
    reg.close()


@pytest.fixture
def run(loop):
    return lambda coro: loop.run_until_complete(coro)


def test_a_request_larger_than_the_queue_is_split_and_reassembled_in_order(registry, run):
    texts = [f"sentence number {i} " + "pad " * (i % 40) for i in range(300)]
    gateway = Gateway(registry, chunk_texts=64)

    async def both():
        big = await gateway.embed(EmbedParams(texts=texts, lane=Lane.BATCH))
        prepared = await gateway.prepare(EmbedParams(texts=texts, lane=Lane.BATCH))
        singles = [await gateway.embed(EmbedParams(texts=[t])) for t in texts[::37]]
        return big, gateway._chunks(prepared), singles

    big, chunks, singles = run(both())
    assert len(chunks) >= 5  # 64 inputs or 2,048 tokens at most per chunk
    assert [c.start for c in chunks] == sorted(c.start for c in chunks) and chunks[-1].stop == 300
    assert big.vectors.shape == (300, 384)
    for k, single in enumerate(singles):
        np.testing.assert_allclose(big.vectors[37 * k], single.vectors[0], atol=1e-5)


def test_prompts_from_the_model_config(registry, run):
    gateway = Gateway(registry)
    assert [m.name for m in gateway.models()] == ["all-MiniLM-L6-v2", "prompted"]

    async def embed(texts, **kw):
        return await gateway.embed(EmbedParams(texts=texts, **kw))

    by_name = run(embed(["cats"], model="prompted", prompt_name="query"))
    by_default = run(embed(["cats"], model="prompted"))  # default_prompt_name = query
    by_hand = run(embed(["query: cats"]))
    passage = run(embed(["cats"], model="prompted", prompt_name="passage"))
    plain = run(embed(["cats"]))
    assert by_name.model == "prompted" and by_name.token_counts == [5]  # [CLS] query : cats [SEP]
    np.testing.assert_allclose(by_name.vectors, by_hand.vectors, atol=1e-6)
    np.testing.assert_allclose(by_default.vectors, by_hand.vectors, atol=1e-6)
    np.testing.assert_allclose(passage.vectors, plain.vectors, atol=1e-6)
    with pytest.raises(EmbedError, match="prompt_name: 'shout' is not a prompt of model 'prompted'"):
        run(embed(["cats"], model="prompted", prompt_name="shout"))


def test_limits_and_draining(registry, run):
    gateway = Gateway(registry, max_inputs=3)

    async def check():
        with pytest.raises(EmbedError) as too_many:
            await gateway.embed(EmbedParams(texts=["a"] * 4))
        gateway.draining = True
        with pytest.raises(EmbedError) as draining:
            await gateway.embed(EmbedParams(texts=["a"]))
        return too_many.value, draining.value

    too_many, draining = run(check())
    assert too_many.code == grpc.StatusCode.INVALID_ARGUMENT and "4 inputs exceeds the limit of 3" in too_many.message
    assert draining.code == grpc.StatusCode.UNAVAILABLE


def test_unknown_model_names_what_is_served(registry):
    with pytest.raises(EmbedError) as info:
        registry.get("bge-m3")
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert "'bge-m3'" in info.value.message and "all-MiniLM-L6-v2" in info.value.message
