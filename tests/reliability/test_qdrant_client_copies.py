"""Fern's Qdrant clients construct, copy and pickle as stock qdrant-client does, and a copy keeps embedding."""

from __future__ import annotations

import asyncio
import copy
import inspect
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from qdrant_client import AsyncQdrantClient, QdrantClient, models

from adapters.qdrant.async_client import AsyncFernQdrantClient
from adapters.qdrant.client import FernQdrantClient
from sidecar.client import AsyncFernClient, FernClient

COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda client: pickle.loads(pickle.dumps(client)),
    "deepcopy": copy.deepcopy,
}


def doc(text: str) -> models.Document:
    return models.Document(text=text, model="fern/")


def outcome(make: Callable[[], Any]) -> tuple[str, Any]:
    try:
        make()
    except Exception as err:  # the type is the outcome under comparison
        return "raised", type(err)
    return "made", None


@pytest.fixture(scope="module")
def fern(sidecar_target: str) -> Iterator[FernClient]:
    with FernClient(sidecar_target) as client:
        client.wait_ready()
        yield client


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_holds_the_same_points_and_still_embeds(fern, how):
    client = FernQdrantClient(":memory:", fern=fern)
    layout = client.setup_collection("docs", sparse=None)
    client.upsert("docs", [models.PointStruct(id=1, vector={"dense": doc("the first point")})])

    twin = COPIES[how](client)
    assert isinstance(twin, FernQdrantClient)
    assert twin.fern is not fern and twin.fern.target == fern.target
    twin.upsert("docs", [models.PointStruct(id=2, vector={"dense": doc("the second point")})])
    # As with stock qdrant-client in memory: the copy has its own data.
    assert (twin.count("docs").count, client.count("docs").count) == (2, 1)
    hit = twin.query_points("docs", query=doc("the second point"), using=layout.dense,
                            limit=1).points[0]
    assert hit.id == 2 and hit.score > 0.999
    twin.close()
    client.upsert("docs", [models.PointStruct(id=3, vector={"dense": doc("a third one")})])
    assert client.count("docs").count == 2  # closing the copy left the original's sidecar channel open
    client.close()


@pytest.mark.parametrize("how", sorted(COPIES))
def test_copies_succeed_and_fail_where_stock_does(fern, tmp_path, how):
    cases = {
        "memory": (lambda cls, **kw: cls(":memory:", **kw)),
        "path": (lambda cls, **kw: cls(path=str(tmp_path / cls.__name__), **kw)),
        "url": (lambda cls, **kw: cls(url="http://127.0.0.1:9", check_compatibility=False, **kw)),
    }
    for name, make in cases.items():
        stock = make(QdrantClient)
        ours = make(FernQdrantClient, fern=fern)
        assert outcome(lambda: COPIES[how](ours)) == outcome(lambda: COPIES[how](stock)), name
        stock.close()
        ours.close()


def test_a_copy_keeps_the_token_and_timeout(sidecar_factory):
    sidecar = sidecar_factory("--token", "copy-secret")
    with FernClient(sidecar.target, token="copy-secret", timeout=45.0) as fern:
        client = FernQdrantClient(":memory:", fern=fern)
        client.setup_collection("docs", sparse=None)
        twin = pickle.loads(pickle.dumps(client))
        assert twin.fern.timeout == 45.0
        twin.upsert("docs", [models.PointStruct(id=1, vector={"dense": doc("with a token")})])
        assert twin.count("docs").count == 1
        twin.close()
        client.close()
    sidecar.stop()


def test_async_client_copies_and_still_embeds(sidecar_target, fern):
    size = fern.model().dimensions

    async def scenario() -> tuple:
        client = AsyncFernQdrantClient(":memory:", fern=AsyncFernClient(sidecar_target))
        await client.create_collection("docs", vectors_config={
            "dense": models.VectorParams(size=size, distance=models.Distance.COSINE)})
        results = []
        for how in sorted(COPIES):
            twin = COPIES[how](client)
            await twin.upsert("docs", [models.PointStruct(id=1, vector={"dense": doc("copied")})])
            stored = await twin.retrieve("docs", [1], with_vectors=True)
            results.append((how, (await twin.count("docs")).count, stored[0].vector["dense"]))
            await twin.close()
        results.append(("original", (await client.count("docs")).count, None))
        await client.close()
        await client.fern.close()
        return results

    results = asyncio.run(scenario())
    want = fern.embed(["copied"], lane="batch").vectors[0]
    for how, count, vector in results[:-1]:
        assert count == 1, how
        assert np.allclose(vector, want, atol=1e-5), how
    assert results[-1][1] == 0


@pytest.mark.parametrize("stock_cls,fern_cls", [(QdrantClient, FernQdrantClient),
                                                (AsyncQdrantClient, AsyncFernQdrantClient)])
def test_constructor_takes_stock_positional_arguments(stock_cls, fern_cls):
    if fern_cls is AsyncFernQdrantClient:
        async def in_a_loop() -> None:  # an AsyncFernClient needs an event loop to exist
            check_positional_arguments(stock_cls, fern_cls)
        asyncio.run(in_a_loop())
    else:
        check_positional_arguments(stock_cls, fern_cls)


def check_positional_arguments(stock_cls: type, fern_cls: type) -> None:
    fern_arg = "127.0.0.1:9"  # never called: constructing opens no sidecar connection
    positional = [
        (None, "http://127.0.0.1:9"),            # location, url
        (None, "http://127.0.0.1:9", 7000),      # ... port
        (None, None, None, 6334, False, None, "key", None, 5, "127.0.0.1"),  # ... host
        (":memory:",),
    ]
    for args in positional:
        stock = stock_cls(*args, check_compatibility=False)
        ours = fern_cls(*args, check_compatibility=False, fern=fern_arg)
        assert ours.init_options == stock.init_options, args
        assert type(ours._client) is type(stock._client), args
        if hasattr(stock._client, "rest_uri"):
            assert ours._client.rest_uri == stock._client.rest_uri, args
    too_many = tuple([None] * 30)
    assert outcome(lambda: fern_cls(*too_many, fern=fern_arg)) == outcome(lambda: stock_cls(*too_many))
    stock_params = list(inspect.signature(stock_cls).parameters)
    ours_params = list(inspect.signature(fern_cls).parameters)
    assert ours_params[:len(stock_params) - 1] == stock_params[:-1]
    assert {"fern", "fern_models", "fern_prefix"} <= set(ours_params)
