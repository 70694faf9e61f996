"""One setting serves a random-weights preset end to end: ``PDSERVE_RANDOM_WEIGHTS=tiny``
in every process's environment, and the gateway (which loads no weights) takes the
preset's byte tokenizer and context length, while the workers prefill and decode it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from common.client import Client
from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_config import preset
from tests.cluster import Cluster, Host


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("random-preset")
    env = {"PDSERVE_RANDOM_WEIGHTS": "tiny", "PDSERVE_CACHE": str(workdir / "cache")}
    c = Cluster(model="tiny-random", workdir=workdir, roles=["prefill", "decode"],
                host=Host(env=env), worker_args=["--device", "cpu"])
    c.start()
    yield c
    c.stop()


def test_gateway_and_workers_serve_the_preset_from_one_setting(cluster, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    with urllib.request.urlopen(cluster.base_url + "/v1/models", timeout=30) as r:
        models = json.loads(r.read())["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [
        ("tiny-random", preset("tiny").max_position_embeddings)]

    # 40 tokens: over the disaggregation threshold, so KV crosses from prefill to decode.
    prompt = [(7 * i + 3) % 250 for i in range(40)]
    with Client(cluster.zmq_addr, timeout_s=120) as client:
        got = client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0,
                              ignore_eos=True)
    local = LLMEngine(EngineConfig(random_weights="tiny", device="cpu", dtype="float32"))
    want = local.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True))[0].token_ids
    assert got.token_ids == want and got.finish_reason == "length"
    assert cluster.worker_stats("prefill-0").prefills_done >= 1

    # Text goes through the preset's byte tokenizer: one token per byte, BOS first.
    status, body = _post(cluster.base_url + "/v1/completions", {
        "model": "tiny-random", "prompt": "hello world", "max_tokens": 4,
        "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] in (11, 12) and body["usage"]["completion_tokens"] == 4
    # The preset's 512-token context, not a default: a longer prompt is refused.
    status, body = _post(cluster.base_url + "/v1/completions", {
        "model": "tiny-random", "prompt": "x" * 600, "max_tokens": 4})
    assert status == 400 and "512" in json.dumps(body), body


def test_gateway_refuses_an_unknown_preset_at_settings():
    from services.gateway.server import GatewaySettings

    assert GatewaySettings(random_weights="tiny").random_weights == "tiny"
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'; known: llama-3-8b"):
        GatewaySettings(random_weights="llama-9")
