"""The OpenAI-compatible embeddings API, for pipelines that declare ``task="embeddings"``.

::

    POST /v1/embeddings   {"model": NAME, "input": str | [str, ...], "encoding_format": "float" | "base64",
                           "dimensions": D (only the model's own), "truncate": false | true}
        -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...] | "base64"}],
            "model": NAME, "usage": {"prompt_tokens": n, "total_tokens": n}}
    GET  /v1/models       {"object": "list", "data": [{"id": NAME, "object": "model", "created": 0,
                           "owned_by": "conveyor"}]}: every pipeline served
    GET  /v1/models/NAME  {"id": NAME, "object": "model", ...}, or 404

What the ``openai`` SDK, LangChain and LlamaIndex call. A list input is one item per text, each
submitted on its own so that it batches with everyone else's, gathered in order. ``base64`` is the
float32 little-endian bytes of each vector, as OpenAI sends them. Token counts come from the
pipeline's ``tokens`` output (0 without one). Token-id inputs (lists of integers) are refused: the
tokenizer is a stage of the pipeline, which takes text. As OpenAI does, an empty text is refused, and so is a
text longer than the model takes (the pipeline answers ``"truncated": true`` for it) unless the request asks
``"truncate": true`` (text-embeddings-inference's option), which embeds its first tokens. Errors have
OpenAI's shape, ``{"error": {"message", "type", "param", "code", "request_id"}}`` (the id added as the answer is
written: gateway.http.request_ids), with the status codes of the other routes; every answer carries
``X-Request-Id``, which the ``openai`` package reads as a response's ``_request_id``.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import orjson

from broker.spec import EMBEDDINGS, PipelineIO
from gateway.backends import Backend, Backends, known_io
from gateway.client.slot import failure
from gateway.errors import Overloaded, PayloadTooLarge, StageError, UnknownPipeline
from gateway.http.oip.items import Gather, ItemFailed
from gateway.http.predict import (
    PARTITION_KEY_HEADER,
    Pending,
    cancelling,
    later,
    once_declared,
    priority_of,
    request_bound_s,
    submit_items,
)
from gateway.http.request_ids import item_ids
from gateway.http.types import HttpError, Reply, Request

__all__ = ["OpenAI"]

MAX_INPUTS = 2048  # OpenAI's own bound on one request's list


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, outcome: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.outcome = (
            status, message, type_, param, code, outcome)

    def reply(self) -> Reply:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        retry = ((b"retry-after", b"1"),) if self.status == 503 else ()  # as the other routes' Overloaded
        return Reply(self.status, orjson.dumps(body), headers=retry, outcome=self.outcome)


def _failure(exc: BaseException) -> OpenAIError:
    """An item's (or a submission's) exception in OpenAI's terms."""
    prefix = ""
    if isinstance(exc, ItemFailed):
        prefix, exc = f"input {exc.index}: ", exc.error
    if isinstance(exc, StageError) and exc.type != "DeadlineExceeded":
        return OpenAIError(400, prefix + str(exc), param="input", code="stage_error", outcome="stage_error")
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | StageError):  # StageError here: DeadlineExceeded
        return OpenAIError(504, prefix + (str(exc) or "no answer before the deadline"), "timeout", outcome="timeout")
    if isinstance(exc, Overloaded | UnknownPipeline):
        return OpenAIError(503, prefix + str(exc), "server_error", code="overloaded", outcome="overloaded")
    if isinstance(exc, PayloadTooLarge):
        return OpenAIError(413, prefix + str(exc), param="input", outcome="too_large")
    if isinstance(exc, ValueError):  # CodecError: an input that cannot travel
        return OpenAIError(400, prefix + str(exc), param="input")
    return OpenAIError(500, prefix + f"{type(exc).__name__}: {exc}", "server_error", outcome="error")


class Query:
    """One embeddings request, checked against the model's contract."""

    def __init__(self, body: bytes) -> None:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise OpenAIError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise OpenAIError(400, "'model' is required: the name of an embeddings pipeline", param="model")
        self.model = model
        self.size = -1  # the declared dimensions (check), -1 if the pipeline does not declare them
        self.texts = _texts(doc.get("input"))
        self.encoding = doc.get("encoding_format")
        if self.encoding is None:  # absent or null: OpenAI's default
            self.encoding = "float"
        if not isinstance(self.encoding, str) or self.encoding not in ("float", "base64"):
            raise OpenAIError(400, f"encoding_format must be 'float' or 'base64', got {self.encoding!r}",
                              param="encoding_format")
        self.dimensions = doc.get("dimensions")
        self.truncate = doc.get("truncate")
        if self.truncate is None:  # absent or null, as encoding_format and dimensions (and TEI) take it: false
            self.truncate = False
        if not isinstance(self.truncate, bool):
            raise OpenAIError(400, f"truncate must be true or false, got {self.truncate!r}", param="truncate")

    def check(self, io: PipelineIO) -> None:
        if io.task != EMBEDDINGS:
            raise OpenAIError(404, f"the model {self.model!r} is not an embeddings model (its pipeline does not "
                                   "declare task='embeddings')", param="model", code="model_not_found",
                              outcome="not_found")
        embedding = io.output("embedding")
        size = self.size = embedding.shape[1] if embedding is not None else -1
        if self.dimensions is not None and (self.dimensions != size or size == -1):
            raise OpenAIError(400, f"dimensions={self.dimensions!r} is not supported: the model {self.model!r} "
                                   f"answers {size if size != -1 else 'its own number of'} dimensions; leave "
                                   "dimensions out", param="dimensions")

    def _vector(self, index: int, vector: Any, answer: Any) -> np.ndarray:
        """The stage's answer for input ``index`` as float32, checked to be one vector of numbers of the
        declared size: a pipeline of another shape is a 500 naming what it gave, never a vector of
        another length, or a NaN made of a missing one (base64 would serve either)."""
        if isinstance(answer, dict) and "embedding" not in answer:
            raise OpenAIError(500, f"input {index}: the pipeline answered a map without 'embedding' (its keys: "
                                   f"{', '.join(sorted(map(str, answer))[:8])})", "server_error", outcome="error")
        try:
            array = np.asarray(vector)
        except ValueError:  # ragged lists
            array = np.asarray(None)
        if array.dtype.kind not in "biuf" or array.size == 0 or (array.ndim > 1 and array.size != array.shape[-1]):
            raise OpenAIError(500, f"input {index}: the pipeline answered {type(vector).__name__} of shape "
                                   f"{array.shape} and dtype {array.dtype}, not one vector of numbers "
                                   "(a stage of task='embeddings' answers a vector, or a map with 'embedding')",
                              "server_error", outcome="error")
        if self.size != -1 and array.size != self.size:
            raise OpenAIError(500, f"input {index}: the pipeline answered {array.size} dimensions where it declares "
                                   f"{self.size}", "server_error", outcome="error")
        return array.astype(np.float32).reshape(-1)

    def respond(self, answers: list[Any]) -> Reply:
        data, tokens = [], 0
        for index, answer in enumerate(answers):
            vector, count = (answer.get("embedding"), answer.get("tokens", 0)) if isinstance(answer, dict) \
                else (answer, 0)
            if not self.truncate and isinstance(answer, dict) and answer.get("truncated"):
                raise OpenAIError(400, f"input {index} is longer than the model {self.model!r} takes (it was read "
                                       f"as far as its first {count} tokens): shorten it, or send \"truncate\": "
                                       f"true to embed those {count} tokens", param="input",
                                       code="context_length_exceeded")
            array = self._vector(index, vector, answer)
            if not bool(np.isfinite(array).all()) and self.encoding == "float":
                raise OpenAIError(500, f"input {index}: the embedding holds NaN or Infinity, which JSON cannot "
                                       "carry (ask for encoding_format='base64')", "server_error", outcome="error")
            embedding: Any = (base64.b64encode(array.astype("<f4").tobytes()).decode() if self.encoding == "base64"
                              else array)
            data.append({"object": "embedding", "index": index, "embedding": embedding})
            tokens += int(count or 0)
        body = {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return Reply(200, orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "conveyor"}


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise OpenAIError(400, "'input' must be a string or a non-empty list of strings", param="input")
    if len(value) > MAX_INPUTS:
        raise OpenAIError(400, f"'input' holds {len(value)} texts; at most {MAX_INPUTS} per request", param="input")
    if not all(isinstance(v, str) for v in value):
        def token_ids(v: Any) -> bool:
            return type(v) is int or (isinstance(v, list) and all(type(i) is int for i in v))

        if all(token_ids(v) for v in value):  # bool is an int, but no token id
            raise OpenAIError(400, "token ids are not supported as input: send text (the pipeline tokenizes it)",
                              param="input")
        raise OpenAIError(400, "'input' must be a string or a list of strings", param="input")
    empty = next((i for i, v in enumerate(value) if not v), None)
    if empty is not None:
        raise OpenAIError(400, f"input {empty} is an empty string: every text must hold at least one character",
                          param="input")
    return value


class OpenAI:
    """The handlers of ``/v1/embeddings`` and ``/v1/models``."""

    def __init__(self, backends: Backends) -> None:
        self.backends = backends

    def models(self, request: Request, params: tuple[str, ...]) -> Reply:
        data = [_model(name) for name in self.backends.names()]
        return Reply(200, orjson.dumps({"object": "list", "data": data}))

    def model(self, request: Request, params: tuple[str, ...]) -> Reply:
        """``GET /v1/models/{id}`` (``client.models.retrieve``): one pipeline served, else 404."""
        (name,) = params
        if self.backends.get(name) is None:
            return OpenAIError(404, f"the model {name!r} does not exist here (served: "
                                    f"{', '.join(self.backends.names())})", param="model", code="model_not_found",
                               outcome="not_found").reply()
        return Reply(200, orjson.dumps(_model(name)))

    def embeddings(self, request: Request, params: tuple[str, ...]) -> Reply | Pending:
        try:
            query = Query(request.body)
            backend = self.backends.get(query.model)
            if backend is None:
                raise OpenAIError(404, f"the model {query.model!r} does not exist here (served: "
                                       f"{', '.join(self.backends.names())})", param="model", code="model_not_found",
                                  outcome="not_found")
            io = known_io(backend)
            if io is None:  # the spec not seen yet: wait for the pipeline's registration first
                return later(once_declared(request, backend, lambda io: self._submit(request, query, backend, io),
                                           _refused))
            return self._submit(request, query, backend, io)
        except OpenAIError as exc:
            return exc.reply()

    def _submit(self, request: Request, query: Query, backend: Backend, io: PipelineIO) -> Reply | Pending:
        try:
            query.check(io)
            bound_s = request_bound_s(request.headers)
            key = request.headers.get(PARTITION_KEY_HEADER)
            ids = item_ids(request.request_id, len(query.texts))  # one text: the request's id; several: <id>.<i>
            priority = priority_of(request.headers)
            waiters = submit_items(backend, query.texts, ids, bound_s, key, priority)
        except OpenAIError as exc:
            return exc.reply()
        except HttpError as exc:
            return OpenAIError(exc.status, exc.message, outcome=exc.outcome).reply()
        except Exception as exc:  # refused at once: Overloaded, PayloadTooLarge, CodecError
            return _failure(exc).reply()
        cancel = cancelling(backend, waiters)
        gather = Gather(asyncio.get_running_loop(), waiters, cancel)
        return Pending(gather.slot, lambda slot: _finish(query, slot), cancel)


def _finish(query: Query, slot: Any) -> Reply:
    exc = failure(slot)  # not raised: see gateway.client.slot.failure
    if exc is not None:
        return exc.reply() if isinstance(exc, OpenAIError) else _failure(exc).reply()
    try:
        return query.respond(slot.result())
    except OpenAIError as err:
        return err.reply()
    except Exception as err:
        return _failure(err).reply()


def _refused(exc: Exception) -> Reply:
    """The model's tensors could not be learned (not registered in time, Redis lost): OpenAI's shape."""
    if isinstance(exc, HttpError):
        return OpenAIError(exc.status, exc.message, outcome=exc.outcome).reply()
    return _failure(exc).reply()
