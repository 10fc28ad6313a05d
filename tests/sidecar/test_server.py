"""The sidecar over real gRPC on loopback, started by `fern serve`: health, Embed, ListModels, reflection, errors."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from sidecar.client import FernError
from sidecar.wire import embedder_pb2 as pb
from sidecar.wire import embedder_pb2_grpc as pb_grpc


def test_health_serving(sidecar_target):
    with grpc.insecure_channel(sidecar_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "fern.v1.Embedder"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_list_models(client):
    (model,) = client.list_models()
    assert model.name == "all-MiniLM-L6-v2"
    assert (model.dimensions, model.max_tokens, model.pooling) == (384, 256, "mean")
    assert model.normalize is True and model.vocab_size == 30522 and model.distance == "cosine"


def test_embed_returns_normalized_float32_rows_in_input_order(client):
    texts = ["first text", "a second, longer text about vector search", "third"]
    e = client.embed(texts)
    assert e.vectors.shape == (3, 384) and e.vectors.dtype == np.dtype("<f4")
    np.testing.assert_allclose(np.linalg.norm(e.vectors, axis=1), 1.0, atol=1e-5)
    one = client.embed([texts[1]]).vectors[0]
    np.testing.assert_allclose(e.vectors[1], one, atol=1e-5)
    assert e.model == "all-MiniLM-L6-v2" and e.token_counts.tolist()[0] == 4  # [CLS] first text [SEP]


def test_token_ids_input_equals_text_input(client):
    by_text = client.embed(["hello world"])
    by_ids = client.embed_tokens([[101, 7592, 2088, 102]])
    np.testing.assert_allclose(by_text.vectors, by_ids.vectors, atol=1e-6)


def _reflected_stub(channel: grpc.Channel):
    """Embed/ListModels callables and message classes built only from server reflection."""
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    service = pool.FindServiceByName("fern.v1.Embedder")
    calls = {}
    for name in ("Embed", "ListModels"):
        method = service.methods_by_name[name]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        calls[name] = (request_cls, channel.unary_unary(
            f"/{service.full_name}/{name}", request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString))
    return calls


def test_client_built_only_from_server_reflection(sidecar_target, client):
    with grpc.insecure_channel(sidecar_target) as channel:
        calls = _reflected_stub(channel)
        request_cls, list_models = calls["ListModels"]
        models = list_models(request_cls(), timeout=30)
        assert models.default_model == "all-MiniLM-L6-v2"
        assert [m.dimensions for m in models.models] == [384]
        request_cls, embed = calls["Embed"]
        assert request_cls is not pb.EmbedRequest  # not the generated class
        resp = embed(request_cls(texts=["reflection works", "second"], request_id="r1"), timeout=60)
    assert (resp.request_id, resp.count, resp.dimensions) == ("r1", 2, 384)
    vectors = np.frombuffer(resp.vectors, dtype="<f4").reshape(2, 384)
    np.testing.assert_allclose(vectors, client.embed(["reflection works", "second"]).vectors, atol=1e-6)


# ---------------------------------------------------------------------------------- errors

def _raw_embed(target: str, request: pb.EmbedRequest) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.EmbedderStub(channel).Embed(request, timeout=60)
    return info.value


BAD_INPUTS = [
    # (id, call kwargs or raw request, status, index, message fragment)
    ("empty-list", dict(texts=[]), "INVALID_ARGUMENT", None, "no inputs"),
    ("empty-text", dict(texts=["ok", "fine", ""]), "INVALID_ARGUMENT", 2, "texts[2]: empty text"),
    ("bad-prompt", dict(texts=["x"], prompt="shouting"), "INVALID_ARGUMENT", None, "prompt_name: 'shouting'"),
    ("bad-dimensions", dict(texts=["x"], dimensions=385), "INVALID_ARGUMENT", None, "dimensions: 385"),
    ("over-length", dict(texts=["fine", "word " * 300], truncate=False), "INVALID_ARGUMENT", 1,
     "texts[1]: 302 tokens exceeds the model's limit of 256"),
    ("unknown-model", dict(texts=["x"], model="no-such-model"), "NOT_FOUND", None, "'no-such-model'"),
    ("too-many", dict(texts=["x"] * 8193), "INVALID_ARGUMENT", None, "8193 inputs exceeds the limit of 8192"),
]


@pytest.mark.parametrize("kwargs,status,index,fragment",
                         [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_inputs_get_their_status_and_name_the_input(client, kwargs, status, index, fragment):
    kwargs = dict(kwargs)
    texts = kwargs.pop("texts")
    with pytest.raises(FernError) as info:
        client.embed(texts, **kwargs)
    err = info.value
    assert err.code == getattr(grpc.StatusCode, status)
    assert fragment in err.message
    assert err.index == index


@pytest.mark.parametrize("ids,index,fragment", [
    ([[101, 102], [101, 30522, 102]], 1, "token_ids[1]: token id 30522 is outside the vocabulary"),
    ([[101, 102], []], 1, "token_ids[1]: no token ids"),
])
def test_bad_token_ids(client, ids, index, fragment):
    with pytest.raises(FernError) as info:
        client.embed_tokens(ids)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.message and info.value.index == index


def test_over_length_token_ids_with_truncation_off(client):
    with pytest.raises(FernError) as info:
        client.embed_tokens([[101] + [2773] * 300 + [102]], truncate=False)
    assert info.value.index == 0 and "token_ids[0]: 302 tokens" in info.value.message


def test_both_texts_and_token_ids(sidecar_target):
    req = pb.EmbedRequest(texts=["x"], token_ids=[pb.TokenIds(ids=[101, 102])])
    err = _raw_embed(sidecar_target, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "both texts and token_ids" in err.details()


@pytest.mark.parametrize("field,value", [("lane", 7), ("encoding", 9), ("truncation", 4)])
def test_unknown_enum_values(sidecar_target, field, value):
    req = pb.EmbedRequest(texts=["x"], **{field: value})
    err = _raw_embed(sidecar_target, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{field}: unknown value {value}" in err.details()


def test_index_travels_in_trailing_metadata(sidecar_target):
    err = _raw_embed(sidecar_target, pb.EmbedRequest(texts=["a", "b", "c", ""]))
    assert ("fern-input-index", "3") in tuple(err.trailing_metadata())


@pytest.mark.parametrize("blank", [" ", "\n\t", "\u00a0\u2003", "\x00", "\x00\x00\x01",
                                   "\u200b", "\u200d\ufeff\u2060", " \u200b\t\x7f "])
def test_text_with_nothing_to_embed_is_refused_like_the_empty_text(client, blank):
    with pytest.raises(FernError) as info:
        client.embed(["fine", blank])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.index == 1
    assert info.value.message == ("texts[1]: empty text (only whitespace, control or zero-width "
                                  "characters)")


def test_text_with_any_visible_character_embeds_as_the_character(client):
    e = client.embed([" a ", "\u200ba\u200b", "a\x00", "a"])
    np.testing.assert_allclose(e.vectors[:3], np.repeat(e.vectors[3:], 3, axis=0), atol=1e-5)


def test_server_keeps_serving_after_errors(client):
    for _ in range(3):
        with pytest.raises(FernError):
            client.embed(["ok", ""])
    assert client.health()
    assert client.embed(["still here"]).vectors.shape == (1, 384)


def test_deadline_exceeded(client):
    with pytest.raises(FernError) as info:
        client.embed(["word " * 250] * 200, timeout=0.001)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.embed(["after a deadline"]).vectors.shape == (1, 384)


def test_cancelled_call_leaves_the_server_serving(sidecar_target, client):
    with grpc.insecure_channel(sidecar_target) as channel:
        future = pb_grpc.EmbedderStub(channel).Embed.future(
            pb.EmbedRequest(texts=["word " * 250] * 64, lane=pb.LANE_BATCH), timeout=60)
        future.cancel()
        assert future.cancelled() or future.exception() is not None
    assert client.embed(["after a cancel"]).vectors.shape == (1, 384)
