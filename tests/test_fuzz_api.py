"""Fuzzing the HTTP API from its own OpenAPI description (schemathesis): over a thousand
generated requests, valid ones and deliberately invalid ones, against a real `pacer up`
serving a tiny random model with a 32-token context (so every valid request finishes fast).
Every answer must be 2xx or 4xx, and the server must be healthy and serving afterwards.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.helpers_tiny_model import write_tiny_llama
from tests.served_fixture import API_KEY, Served, start_served

schemathesis = pytest.importorskip("schemathesis")

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# examples per (operation, mode); a GET without parameters has only one to give. Each run
# draws fresh ones (no example database), so runs add up; the budget keeps the suite in time.
BUDGET = {"POST": {"positive": 60, "negative": 50}, "GET": {"positive": 20, "negative": 0}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-model"))
    system = start_served(str(tmp_path_factory.mktemp("fuzz") / "pacer-up.log"),
                          "--model", model, "--max-model-len", "32", "--max-num-seqs", "16")
    try:
        yield system
    finally:
        system.stop()


def test_generated_requests_get_only_2xx_or_4xx_and_the_server_stays_healthy(served: Served):
    status, raw = served.get("/openapi.json")
    assert status == 200
    schema = schemathesis.openapi.from_dict(json.loads(raw))
    answers: list[int] = []
    server_errors: list[tuple[int, str, object]] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, count in BUDGET[operation.method.upper()].items():
            if count:
                _fuzz(served, operation, schemathesis.GenerationMode(mode), count, answers,
                      server_errors)
    print(f"\nfuzz: {len(answers)} requests, "
          + ", ".join(f"{s}: {answers.count(s)}" for s in sorted(set(answers))))
    assert len(answers) >= 480
    assert not server_errors, server_errors[:5]
    assert all(200 <= s < 300 or 400 <= s < 500 for s in answers)
    assert served.get("/health")[0] == 200
    _assert_serves(served)


def _fuzz(served: Served, operation, mode, count: int, answers: list[int],
          server_errors: list) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def call(case) -> None:
        response = case.call(base_url=served.base_url, headers=HEADERS, timeout=60)
        answers.append(response.status_code)
        if not (200 <= response.status_code < 300 or 400 <= response.status_code < 500):
            server_errors.append((response.status_code, operation.label, case.body))

    call()


def _assert_serves(served: Served) -> None:
    listing = urllib.request.Request(f"{served.base_url}/v1/models", headers=HEADERS)
    with urllib.request.urlopen(listing, timeout=30) as r:
        models = json.loads(r.read())
    body = json.dumps({"model": models["data"][0]["id"], "prompt": "hello there",
                       "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{served.base_url}/v1/completions", data=body,
                                     headers={**HEADERS, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
        assert json.loads(r.read())["usage"]["completion_tokens"] == 4
