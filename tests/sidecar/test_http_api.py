"""The HTTP door on the wire: bad input, body caps, auth before the body, TEI's statuses, against `fern serve`."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
import urllib.request
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.client import FernClient
from sidecar.lexical import term_index
from tests.sidecar.lane_holder import batch_lane_held, until_refused

TOKEN = "api-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
MAX_BODY = 1_000_000


@pytest.fixture(scope="module")
def served(sidecar_factory):
    process = sidecar_factory("--token", TOKEN, "--http-port", "0", "--http-max-body-bytes", str(MAX_BODY),
                              "--max-queued-tokens-batch", "64", "--metrics-port", "0")
    yield process
    assert process.terminate() == 0  # SIGTERM with the HTTP door open still drains cleanly
    process.stop()


@pytest.fixture(scope="module")
def address(served) -> tuple[str, int]:
    url = urlsplit(served.http_url)
    return url.hostname, url.port


def call(address, method: str, path: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict | list | None, http.client.HTTPResponse]:
    """One request on a fresh connection; the parsed JSON body (None when empty)."""
    conn = http.client.HTTPConnection(*address, timeout=60)
    try:
        payload = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=payload, headers=AUTH if headers is None else headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None, response
    finally:
        conn.close()


def error_message(body: dict) -> str:
    return body["error"]["message"] if isinstance(body["error"], dict) else body["error"]


BAD_OPENAI = [
    # (what, body, status, substring of the message, OpenAI param)
    ("malformed JSON", b'{"input": "x",', 400, "not valid JSON", None),
    ("not an object", b'["x"]', 400, "expected a JSON object, got an array", None),
    ("empty body", b"", 400, "request body: empty", None),
    ("lone surrogate", b'{"input": "\\ud800"}', 400, "not valid JSON", None),
    ("input a number", {"input": 5}, 400, "input: expected a string or a list of strings, got a number", "input"),
    ("input missing", {"model": "all-MiniLM-L6-v2"}, 400, "input: missing", "input"),
    ("a number among texts", {"input": ["a", 5]}, 400, "input[1]: expected a string, got a number", "input"),
    ("a null among texts", {"input": ["a", "b", None]}, 400, "input[2]: expected a string, got null", "input"),
    ("empty text", {"input": ""}, 400, "input[0]: empty text", "input"),
    ("empty text in a list", {"input": ["a", "b", ""]}, 400, "input[2]: empty text", "input"),
    ("empty list", {"input": []}, 400, "input: an empty list", "input"),
    ("NUL", {"input": ["fine", "a\u0000b"]}, 400, "input[1]: contains a NUL character", "input"),
    ("100,000 inputs", {"input": ["a"] * 100_000}, 413, "100000 inputs exceeds the limit of 8192", "input"),
    ("unknown model", {"input": "x", "model": "text-embedding-3-small"}, 404,
     "'text-embedding-3-small' is not served here (served: all-MiniLM-L6-v2)", "model"),
    ("model a number", {"input": "x", "model": 3}, 400, "model: expected a string, got a number", "model"),
    ("dimensions zero", {"input": "x", "dimensions": 0}, 400, "dimensions: 0 is not a positive integer", "dimensions"),
    ("dimensions too big", {"input": "x", "dimensions": 4096}, 400, "dimensions: 4096 is outside 1..384", "dimensions"),
    ("dimensions a string", {"input": "x", "dimensions": "64"}, 400, "dimensions: expected a positive integer",
     "dimensions"),
    ("encoding_format", {"input": "x", "encoding_format": "hex"}, 400, "encoding_format: 'hex' is not one of",
     "encoding_format"),
    ("Fern encoding", {"input": "x", "encoding": "int4"}, 400, "encoding: 'int4' is not one of", "encoding"),
    ("token ids", {"input": [[9906, 1917]]}, 400, "check_embedding_ctx_length=False", "input"),
    ("flat token ids", {"input": [9906, 1917]}, 400, "token ids are not accepted", "input"),
    ("bad lane", {"input": "x", "lane": "fast"}, 400, "lane: 'fast' is not a lane", "lane"),
    ("bad prompt", {"input": "x", "prompt_name": "nope"}, 400, "prompt_name: 'nope' is not a prompt", "prompt_name"),
    ("too long, truncate off", {"input": "word " * 300, "truncate": False}, 413,
     "input[0]: 302 tokens exceeds the model's limit of 256 tokens (truncate is false", "input"),
]


@pytest.mark.parametrize("what,body,status,message,param", BAD_OPENAI, ids=[row[0] for row in BAD_OPENAI])
def test_openai_bad_input_table(address, what, body, status, message, param):
    got, answer, _ = call(address, "POST", "/v1/embeddings", body)
    assert got == status, answer
    assert message in answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_a_10mb_body_is_refused_by_its_length_and_the_server_stays_up(address, served):
    body = json.dumps({"input": "x" * (10 * 1024 * 1024)}).encode()
    status, answer, _ = call(address, "POST", "/v1/embeddings", body)
    assert status == 413  # by its Content-Length: the declared size is in the message
    assert f"request body: {len(body)} bytes exceeds this door's limit of 1000000 bytes" in answer["error"]["message"]
    assert "EmbedStream" in answer["error"]["message"]
    status, answer, _ = call(address, "POST", "/v1/embeddings", {"input": "after the big one"})
    assert status == 200 and len(answer["data"]) == 1
    with FernClient(served.target, token=TOKEN) as client:
        assert client.health()


def test_a_chunked_body_is_refused_once_it_streams_past_the_cap(address):
    """No Content-Length: the body is counted as it arrives, and refused at the cap, not held whole."""
    with socket.create_connection(address, timeout=60) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                  b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 65536
        for _ in range(MAX_BODY // len(chunk) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer = b""
        while b"more than 1000000 bytes" not in answer:  # headers and body may come in separate reads
            data = s.recv(65536)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"more than 1000000 bytes" in answer, answer


def test_auth_is_checked_before_the_body_is_read(address):
    """A wrong token gets 401 as soon as the headers are in: the declared body is never waited for."""
    with socket.create_connection(address, timeout=30) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n")
        response = http.client.HTTPResponse(s)
        response.begin()
        answer = json.loads(response.read())
    assert response.status == 401 and "Bearer" in answer["error"]["message"]
    assert response.getheader("www-authenticate") == "Bearer"
    for headers in ({}, {"Authorization": "Bearer " + TOKEN + "x"}, {"Authorization": TOKEN}):
        status, answer, _ = call(address, "POST", "/embed", {"inputs": "x"}, headers=headers)
        assert status == 401 and "Bearer" in answer["error"]


def test_health_is_open_and_the_rest_is_not(address):
    status, answer, _ = call(address, "GET", "/health", headers={})
    assert status == 200 and answer is None
    assert call(address, "GET", "/info", headers={})[0] == 401
    assert call(address, "GET", "/v1/models", headers={})[0] == 401


def test_queue_full_is_429_with_retry_after(address, served):
    fits = "word " * 20  # fits the empty 64-token lane, not one that bulk work holds

    def refused(path: str, body: dict, headers: dict = AUTH):
        status, answer, response = call(address, "POST", path, body, headers=headers)
        return (answer, response) if status == 429 else None

    with batch_lane_held(served.target, TOKEN) as holder:
        answer, response = until_refused(holder, lambda: refused("/v1/embeddings", {"input": fits},
                                                                 {**AUTH, "X-Fern-Lane": "batch"}))
        assert response.getheader("retry-after") == "1"
        assert "BATCH lane" in answer["error"]["message"] and answer["error"]["type"] == "rate_limit_error"
        answer, _ = until_refused(holder, lambda: refused("/embed", {"inputs": fits, "lane": "batch"}))
        assert answer["error_type"] == "overloaded"
    status, _, _ = call(address, "POST", "/v1/embeddings", {"input": fits, "lane": "batch"})
    assert status == 200  # the same lane takes it once there is room


def test_a_text_longer_than_the_whole_lane_is_413_not_429(address):
    # Retrying could never help: the answer says so and names the input, and no Retry-After invites it.
    status, answer, response = call(address, "POST", "/v1/embeddings", {"input": ["ok", "word " * 80]},
                                    headers={**AUTH, "X-Fern-Lane": "batch"})
    assert status == 413 and response.getheader("retry-after") is None
    assert answer["error"]["message"].startswith("input[1]: 82 tokens exceeds the BATCH lane's queue of 64")
    assert "never fits" in answer["error"]["message"]
    status, answer, _ = call(address, "POST", "/embed", {"inputs": "word " * 80, "lane": "batch"})
    assert status == 413 and "never fits" in answer["error"]


BAD_TEI = [
    ("malformed JSON", "/embed", b"{", 422, "not valid JSON", "validation"),
    ("inputs a number", "/embed", {"inputs": 1}, 422, "inputs: expected a string or a list of strings", "validation"),
    ("empty text", "/embed", {"inputs": ["a", ""]}, 400, "inputs[1]: empty text", "empty"),
    ("empty list", "/embed", {"inputs": []}, 400, "inputs: an empty list", "empty"),
    ("too long, TEI's default truncate=false", "/embed", {"inputs": "word " * 300}, 413,
     "inputs[0]: 302 tokens exceeds the model's limit of 256", "validation"),
    ("too many inputs", "/embed", {"inputs": ["a"] * 9000}, 413, "9000 inputs exceeds the limit", "validation"),
    ("left truncation", "/embed", {"inputs": "x", "truncate": True, "truncation_direction": "Left"}, 422,
     "truncation_direction: 'Left' is not supported", "validation"),
    ("normalize a string", "/embed", {"inputs": "x", "normalize": "yes"}, 422, "normalize: expected true or false",
     "validation"),
    ("NUL on /", "/", {"inputs": "a\u0000"}, 422, "inputs[0]: contains a NUL character", "validation"),
    ("sparse, empty text", "/embed_sparse", {"inputs": [""]}, 400, "inputs[0]: empty text", "empty"),
    ("sparse, unknown language", "/embed_sparse", {"inputs": ["x"], "sparse_language": "klingon"}, 422,
     "sparse_language: 'klingon' is not a language of the BM25 sparse vectors (known: danish", "validation"),
    ("tokenize, bad prompt", "/tokenize", {"inputs": "x", "prompt_name": "nope"}, 422, "prompt_name: 'nope'",
     "validation"),
    ("unknown model", "/embed", {"inputs": "x", "model": "bge-m3"}, 404, "'bge-m3' is not served here", "validation"),
]


@pytest.mark.parametrize("what,path,body,status,message,error_type", BAD_TEI, ids=[row[0] for row in BAD_TEI])
def test_tei_bad_input_table(address, what, path, body, status, message, error_type):
    got, answer, _ = call(address, "POST", path, body)
    assert got == status, answer
    assert message in answer["error"] and answer["error_type"] == error_type


def engine_steps(served) -> float:
    url = re.search(r"^fern: metrics on (\S+)", served.log(), re.M).group(1)
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "fern_engine_steps" for sample in family.samples if sample.name.endswith("_total"))


def test_tei_routes_answer_in_tei_shapes(address, served):
    with FernClient(served.target, token=TOKEN) as client:
        reference = client.embed(["hello there", "general kenobi"], sparse=True)
    status, vectors, _ = call(address, "POST", "/embed", {"inputs": ["hello there", "general kenobi"]})
    assert status == 200 and len(vectors) == 2 and len(vectors[0]) == 384
    assert abs(vectors[0][0] - float(reference.vectors[0][0])) < 1e-6
    steps = engine_steps(served)
    status, sparse, _ = call(address, "POST", "/embed_sparse", {"inputs": ["hello there", "general kenobi"]})
    assert status == 200
    assert [[t["index"] for t in row] for row in sparse] == [s.indices.tolist() for s in reference.sparse]
    for row, want in zip(sparse, reference.sparse):
        assert [t["value"] for t in row] == pytest.approx(want.values.tolist(), rel=1e-6)
    assert engine_steps(served) == steps  # sparse vectors come from the text: no engine step ran
    status, german, _ = call(address, "POST", "/embed_sparse", {"inputs": ["die Katzen"], "prompt_name": "query",
                                                                "sparse_language": "german"})
    assert status == 200 and german == [[{"index": term_index("katz"), "value": 1.0}]]
    status, tokens, _ = call(address, "POST", "/tokenize", {"inputs": "hello there"})
    assert status == 200 and [t["text"] for t in tokens[0]] == ["[CLS]", "hello", "there", "[SEP]"]
    assert tokens[0][1] == {"id": 7592, "text": "hello", "special": False, "start": 0, "stop": 5}
    status, answer, _ = call(address, "POST", "/v1/embeddings", {"input": "no model named"})
    assert status == 200 and answer["model"] == "all-MiniLM-L6-v2"  # a raw request may leave it out
    status, info, _ = call(address, "GET", "/info")
    assert status == 200 and info["model_id"] == "all-MiniLM-L6-v2" and info["max_input_length"] == 256
    status, answer, _ = call(address, "GET", "/nope")
    assert status == 404 and "no such route" in answer["error"]
    status, answer, _ = call(address, "GET", "/v1/embeddings")
    assert status == 405 and answer["error"]["type"] == "invalid_request_error"


def test_keep_alive_connection_serves_many_requests(address):
    conn = http.client.HTTPConnection(*address, timeout=60)
    try:
        for i in range(20):
            conn.request("POST", "/v1/embeddings", body=json.dumps({"input": f"text {i}"}), headers=AUTH)
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["data"][0]["index"] == 0
            if i == 10:  # an error answer leaves the connection usable
                conn.request("POST", "/v1/embeddings", body=b"{", headers=AUTH)
                bad = conn.getresponse()
                assert bad.status == 400
                bad.read()
    finally:
        conn.close()


def test_metrics_count_http_requests_by_route_status_and_lane(address, served):
    url = re.search(r"^fern: metrics on (\S+)", served.log(), re.M).group(1)

    def scrape() -> dict[tuple, float]:
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        return {(sample.name, *sorted(sample.labels.items())): sample.value
                for family in text_string_to_metric_families(text) if family.name.startswith("fern_http_")
                for sample in family.samples}

    before = scrape()
    assert call(address, "POST", "/v1/embeddings", {"input": "counted"})[0] == 200
    assert call(address, "POST", "/embed", {"inputs": "word " * 80, "truncate": True},
                headers={**AUTH, "X-Fern-Lane": "batch"})[0] == 413
    after = scrape()
    ok = ("fern_http_requests_total", ("lane", "online"), ("route", "/v1/embeddings"), ("status", "200"))
    full = ("fern_http_requests_total", ("lane", "batch"), ("route", "/embed"), ("status", "413"))
    assert after[ok] == before.get(ok, 0) + 1 and after[full] == before.get(full, 0) + 1
    count = ("fern_http_request_seconds_count", ("route", "/embed"))
    assert after[count] == before.get(count, 0) + 1
    assert after[("fern_http_request_seconds_bucket", ("le", "+Inf"), ("route", "/embed"))] == after[count]


def test_a_client_that_disconnects_cancels_its_bulk_request(address, served):
    url = re.search(r"^fern: metrics on (\S+)", served.log(), re.M).group(1)

    def cancelled() -> float:
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "fern_requests_cancelled" for sample in family.samples
                   if sample.name.endswith("_total") and sample.labels["lane"] == "online")

    before = cancelled()
    body = json.dumps({"input": [f"passage {i}: " + "words of a long passage " * 40 for i in range(400)]}).encode()
    with socket.create_connection(address, timeout=60) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)  # the request is admitted; 400 passages take the CPU engine many seconds
    deadline = time.monotonic() + 60
    while cancelled() == before:
        assert time.monotonic() < deadline, "the disconnect never cancelled the request"
        time.sleep(0.05)
    status, answer, _ = call(address, "POST", "/v1/embeddings", {"input": "still serving"})
    assert status == 200 and len(answer["data"]) == 1
