"""The OpenAI-compatible embeddings route without a server: requests, answers and errors in OpenAI's shape.

(tests/test_embeddings.py calls it with the ``openai`` package against the real model.)
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from broker.spec import PipelineIO, TensorSpec
from gateway.errors import Overloaded, StageError
from gateway.http.predict import Pending
from gateway.http.routes import Router
from gateway.http.server import HttpServer
from gateway.http.settings import HttpSettings
from gateway.http.types import Reply, Request
from gateway.monitor.metrics import Metrics
from tests.test_http import FakeBackend, ready_status
from tests.test_routes import Several

pytestmark = pytest.mark.unit

EMBEDDINGS = PipelineIO((TensorSpec("text", "BYTES", (-1,)),),
                        (TensorSpec("embedding", "FP32", (-1, 3)), TensorSpec("tokens", "INT64", (-1,))),
                        batched=True, task="embeddings")


@dataclass
class Registered:
    io: PipelineIO
    registered: bool = True


class Embedder(FakeBackend):
    """A fake embeddings pipeline: "bad" raises in the stage; else a 3-d vector and a token count."""

    def __init__(self, name: str, io: PipelineIO = EMBEDDINGS) -> None:
        super().__init__(status=ready_status())
        self.pipeline = name
        self.registration = Registered(io)

    async def _predict(self, x: Any) -> Any:
        if x == "bad":
            raise StageError("ValueError", "bad text", "tokenize", "")
        tokens = len(x.split()) + 2
        cut = {"truncated": True} if tokens > 6 else {}  # as the example's pipeline answers a text over its length
        return {"embedding": np.array([len(x), 1.0, -0.5], dtype=np.float32), "tokens": min(tokens, 6), **cut}


def _call(backends: Any, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    reply = _reply(backends, method, path, body)
    return reply.status, json.loads(reply.body)


def _reply(backends: Any, method: str, path: str, body: Any = None) -> Reply:
    router = Router(backends, HttpSettings(), Metrics(backends), lambda: False)

    async def main() -> Reply:
        raw = b"" if body is None else json.dumps(body).encode()
        _, answer = router.start(Request(method.encode(), path.encode(), {}, raw))
        if isinstance(answer, Pending):
            while not answer.future.done():
                await asyncio.sleep(0.001)
            answer = answer.finish(answer.future)
        return answer

    return asyncio.run(asyncio.wait_for(main(), 5))


def test_a_list_of_texts_is_answered_in_order_with_usage() -> None:
    served = Several(Embedder("emb"))
    status, body = _call(served, "POST", "/v1/embeddings", {"model": "emb", "input": ["a b", "abcd", "x"]})
    assert status == 200 and body["object"] == "list" and body["model"] == "emb"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["embedding"][0] for d in body["data"]] == [3.0, 4.0, 1.0]
    assert body["usage"] == {"prompt_tokens": 4 + 3 + 3, "total_tokens": 10}


def test_a_text_over_the_models_length_is_refused_unless_truncate_is_asked() -> None:
    """As OpenAI: 400 for a text the model would cut; text-embeddings-inference's ``truncate`` embeds its start."""
    served = Several(Embedder("emb"))
    long = "w " * 10
    status, body = _call(served, "POST", "/v1/embeddings", {"model": "emb", "input": ["a", long]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "input 1 is longer than the model 'emb' takes (it was read as far as its first 6 tokens)" \
        in body["error"]["message"]
    status, body = _call(served, "POST", "/v1/embeddings", {"model": "emb", "input": ["a", long], "truncate": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == 3 + 6, body
    status, body = _call(served, "POST", "/v1/embeddings", {"model": "emb", "input": ["a", long], "truncate": None})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body  # null: false (TEI)


def test_base64_is_the_float32_bytes() -> None:
    status, body = _call(Several(Embedder("emb")), "POST", "/v1/embeddings",
                         {"model": "emb", "input": "abc", "encoding_format": "base64"})
    assert status == 200
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == [3.0, 1.0, -0.5]


class Busy(Embedder):
    async def _predict(self, x: Any) -> Any:
        raise Overloaded("the pipeline's backlog is full: retry")


def test_an_overloaded_pipeline_says_when_to_retry() -> None:
    """As the other routes' 503 Overloaded: the ``openai`` package waits what retry-after says."""
    reply = _reply(Several(Busy("emb")), "POST", "/v1/embeddings", {"model": "emb", "input": "a"})
    assert reply.status == 503 and json.loads(reply.body)["error"]["code"] == "overloaded", reply
    assert (b"retry-after", b"1") in reply.headers


class Misshapen(Embedder):
    """An embeddings pipeline whose stage answers something else than one vector of its declared 3 dimensions."""

    async def _predict(self, x: Any) -> Any:
        return {"no map key": {"vector": [1.0, 2.0, 3.0]}, "short": np.ones(2, np.float32), "long": [1.0] * 4,
                "words": ["a", "b", "c"], "ragged": [[1.0], [2.0, 3.0]], "two": np.ones((2, 3)),
                "empty": [], "ok": [1.0, 2.0, 3.0]}[x]


@pytest.mark.parametrize(("text", "words"), [("no map key", "a map without 'embedding' (its keys: vector)"),
                                             ("short", "answered 2 dimensions where it declares 3"),
                                             ("long", "answered 4 dimensions where it declares 3"),
                                             ("words", "dtype <U1"), ("ragged", "not one vector"),
                                             ("two", "of shape (2, 3)"), ("empty", "not one vector")])
@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_an_answer_that_is_no_vector_of_the_declared_size_is_a_500(text: str, words: str, encoding: str) -> None:
    """A map without 'embedding' was served as a vector of one NaN in base64, a vector of another length as it
    came: the caller's index would have mixed sizes."""
    status, body = _call(Several(Misshapen("emb")), "POST", "/v1/embeddings",
                         {"model": "emb", "input": ["ok", text], "encoding_format": encoding})
    assert status == 500 and body["error"]["type"] == "server_error", body
    assert body["error"]["message"].startswith("input 1: the pipeline answered") and words in body["error"]["message"]


@pytest.mark.parametrize(("request_body", "status", "param", "words"), [
    ({"model": "emb"}, 400, "input", "non-empty list"),
    ({"model": "emb", "input": []}, 400, "input", "non-empty list"),
    ({"model": "emb", "input": [[1, 2, 3]]}, 400, "input", "token ids"),
    ({"model": "emb", "input": [1, "a"]}, 400, "input", "list of strings"),
    ({"model": "emb", "input": [True, False]}, 400, "input", "list of strings"),  # booleans are no token ids
    ({"input": "a"}, 400, "model", "'model' is required"),
    ({"model": "emb", "input": "a", "encoding_format": "int8"}, 400, "encoding_format", "'float' or 'base64'"),
    ({"model": "emb", "input": "a", "encoding_format": ""}, 400, "encoding_format", "'float' or 'base64'"),
    ({"model": "emb", "input": "a", "encoding_format": False}, 400, "encoding_format", "'float' or 'base64'"),
    ({"model": "emb", "input": "a", "encoding_format": {}}, 400, "encoding_format", "'float' or 'base64'"),
    ({"model": "emb", "input": "a", "dimensions": 2}, 400, "dimensions", "answers 3 dimensions"),
    ({"model": "nope", "input": "a"}, 404, "model", "does not exist here"),
    ({"model": "plain", "input": "a"}, 404, "model", "not an embeddings model"),
    ({"model": "emb", "input": ["ok", "bad"]}, 400, "input", "input 1: "),
    ({"model": "emb", "input": ""}, 400, "input", "input 0 is an empty string"),
    ({"model": "emb", "input": ["a", ""]}, 400, "input", "input 1 is an empty string"),
    ({"model": "emb", "input": "a", "truncate": "yes"}, 400, "truncate", "true or false"),
])
def test_errors_have_openais_shape(request_body: dict[str, Any], status: int, param: str, words: str) -> None:
    served = Several(Embedder("emb"), Embedder("plain", PipelineIO()))
    got, body = _call(served, "POST", "/v1/embeddings", request_body)
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_the_models_own_dimensions_are_accepted_and_models_are_listed() -> None:
    served = Several(Embedder("emb"), Embedder("plain", PipelineIO()))
    assert _call(served, "POST", "/v1/embeddings", {"model": "emb", "input": "a", "dimensions": 3})[0] == 200
    status, body = _call(served, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["emb", "plain"]
    assert all(m["object"] == "model" for m in body["data"])
    status, body = _call(served, "GET", "/v1/models/emb")  # client.models.retrieve("emb")
    assert status == 200 and body == {"id": "emb", "object": "model", "created": 0, "owned_by": "conveyor"}
    status, body = _call(served, "GET", "/v1/models/nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_errors_made_before_the_route_reach_the_openai_package_in_its_shape() -> None:
    """The connection's 413 and the router's 405 on /v1/embeddings are written in OpenAI's shape, as the
    route's own errors are: the ``openai`` package reads their type and code."""
    import openai

    async def main() -> list[openai.APIStatusError]:
        server = HttpServer(Several(Embedder("emb")), HttpSettings(port=0, max_body_bytes=1024))
        await server.start()
        errors = []
        try:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0,
                                        timeout=5)
            for call in (client.embeddings.create(model="emb", input="x" * 2000),
                         client.get("/embeddings", cast_to=object)):
                with pytest.raises(openai.APIStatusError) as refused:
                    await call
                errors.append(refused.value)
            await client.close()
        finally:
            await server.close(drain=False)
        return errors

    too_large, wrong_method = asyncio.run(asyncio.wait_for(main(), 10))
    assert too_large.status_code == 413 and wrong_method.status_code == 405
    for error, code in ((too_large, "PayloadTooLarge"), (wrong_method, "MethodNotAllowed")):
        assert error.type == "invalid_request_error" and error.code == code, error.body
        assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code", "request_id"}
