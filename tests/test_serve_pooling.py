"""`vllm serve` of an embedder, as a user runs it: embeddings (through
/v1/embeddings and /pooling), scores and reranking, a classifier's
probabilities through /classify, equal to HF's, and bad requests answered with a 400 that says
what is allowed while the server keeps serving."""

from __future__ import annotations

import contextlib
import subprocess

import pytest
import requests
import torch
import torch.nn.functional as F

from test_pooling import hf_embedding
from test_serve import VLLM, free_port, server_env
from helpers import wait_until_serving
from vllm_accel.testing.tiny_encoders import make_tiny_encoder

pytestmark = pytest.mark.slow  # a server: the full suite only

TOL = 1e-4


@contextlib.contextmanager
def serving(kind, tmp_path_factory):
    """(base URL, model dir) of `vllm serve` on a tiny ``kind`` encoder."""
    model = make_tiny_encoder(kind, tmp_path_factory.mktemp(kind))
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [VLLM, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "128"]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=server_env(VLLM_PLUGINS="accel"),
                                stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base, log)
        yield base, str(model)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving("bert", tmp_path_factory) as served:
        yield served


def expected(model, text):
    from transformers import AutoTokenizer

    return hf_embedding(model, "bert", AutoTokenizer.from_pretrained(model)(text).input_ids)


def test_embeddings_pooling_scores_and_rerank_equal_hf(server):
    base, model = server
    texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
    out = requests.post(f"{base}/v1/embeddings", json={"model": model, "input": texts}).json()
    vectors = [torch.tensor(d["embedding"]) for d in out["data"]]
    hf = [expected(model, t) for t in texts]
    for got, want in zip(vectors, hf):
        assert torch.allclose(got, want, atol=TOL, rtol=0)

    pooled = requests.post(f"{base}/pooling", json={"model": model, "input": texts,
                                                    "task": "embed"}).json()
    for got, want in zip(pooled["data"], hf):
        assert torch.allclose(torch.tensor(got["data"]), want, atol=TOL, rtol=0)

    query, docs = "a fox and a dog", texts
    cosines = [F.cosine_similarity(expected(model, query), d, dim=0).item() for d in hf]
    scores = requests.post(f"{base}/score", json={"model": model, "text_1": query,
                                                  "text_2": docs}).json()
    assert [round(d["score"], 4) for d in scores["data"]] == [round(c, 4) for c in cosines]
    ranked = requests.post(f"{base}/rerank", json={"model": model, "query": query,
                                                   "documents": docs}).json()["results"]
    assert [r["index"] for r in ranked] == sorted(range(2), key=lambda i: -cosines[i])


def test_bad_requests_get_a_400_naming_what_is_allowed_and_serving_goes_on(server):
    base, model = server
    completion = requests.post(f"{base}/v1/completions",
                               json={"model": model, "prompt": "hello", "max_tokens": 4})
    assert completion.status_code == 400
    message = completion.json()["error"]["message"]
    assert "pooling model (tasks: embed, token_embed)" in message and "/v1/embeddings" in message
    too_long = requests.post(f"{base}/v1/embeddings",
                             json={"model": model, "input": "word " * 200})
    assert too_long.status_code == 400
    assert "maximum context length is 128" in too_long.json()["error"]["message"]
    ok = requests.post(f"{base}/v1/embeddings", json={"model": model, "input": "hello world"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64


def test_classify_gives_hf_probabilities(tmp_path_factory):
    from transformers import AutoTokenizer, BertForSequenceClassification

    texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
    with serving("bert_classifier", tmp_path_factory) as (base, model):
        out = requests.post(f"{base}/classify", json={"model": model, "input": texts})
        assert out.status_code == 200, out.text
        data = out.json()["data"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = BertForSequenceClassification.from_pretrained(model).eval()
    for text, got in zip(texts, data):
        with torch.no_grad():
            want = hf(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        assert torch.allclose(torch.tensor(got["probs"]), want, atol=TOL, rtol=0)
        assert got["label"] == hf.config.id2label[int(want.argmax())]
