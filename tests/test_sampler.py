"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, log-probabilities."""
from __future__ import annotations

import torch

from gpu_worker.sampler import Sampler
from shared.sampling import SamplingParams


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    out = Sampler(seed=0).sample(x, [SamplingParams(temperature=0.0)] * 4, [0] * 4)
    assert [t.token_id for t in out] == x.argmax(-1).tolist()


def test_top_k_1_is_greedy():
    x = logits()
    out = Sampler(seed=0).sample(x, [SamplingParams(temperature=1.0, top_k=1)] * 4, [0] * 4)
    assert [t.token_id for t in out] == x.argmax(-1).tolist()


def test_seeded_draw_ignores_the_rest_of_the_batch():
    x = logits(rows=6)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(seed=1).sample(x[2:3], [p], [5])[0].token_id
    others = [SamplingParams(temperature=1.0)] * 6
    for seed in range(5):
        params = list(others)
        params[2] = p
        mixed = Sampler(seed=seed).sample(x, params, [0, 1, 5, 3, 4, 5])[2].token_id
        assert mixed == alone


def test_seeded_draws_differ_by_output_index():
    x = logits(rows=1, vocab=1000) * 0   # uniform: a repeat would be a 1-in-1000 chance
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [Sampler().sample(x, [p], [n])[0].token_id for n in range(5)]
    assert len(set(draws)) > 1


def test_top_k_and_top_p_restrict_the_support():
    x = logits(rows=1, vocab=50)
    top3 = set(torch.topk(x[0], 3).indices.tolist())
    s = Sampler(seed=0)
    for n in range(200):
        t = s.sample(x, [SamplingParams(temperature=2.0, top_k=3)], [n])[0].token_id
        assert t in top3
    probs = torch.softmax(x[0], -1)
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[:int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for n in range(200):
        t = s.sample(x, [SamplingParams(temperature=1.0, top_p=0.5)], [n])[0].token_id
        assert t in nucleus


def test_temperature_one_follows_the_softmax():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = Sampler(seed=0)
    counts = torch.zeros(4)
    n = 4000
    for i in range(n):
        counts[s.sample(x, [SamplingParams(temperature=1.0)], [i])[0].token_id] += 1
    expected = torch.softmax(x[0], -1)
    assert torch.allclose(counts / n, expected, atol=0.03), (counts / n, expected)


def test_logprobs_are_the_log_softmax_with_top_n():
    x = logits(rows=2)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = Sampler().sample(x, params, [0, 0])
    ref = torch.log_softmax(x, -1)
    tok = out[0].token_id
    assert abs(out[0].logprob - float(ref[0, tok])) < 1e-6
    ids = [i for i, _ in out[0].top_logprobs]
    assert ids == torch.topk(ref[0], 3).indices.tolist()
    assert out[1].logprob is None and out[1].top_logprobs is None


def test_extreme_parameters_never_produce_nan():
    x = logits(rows=1) * 1000
    s = Sampler(seed=0)
    for p in (SamplingParams(temperature=1e-30), SamplingParams(temperature=1.0, top_p=1e-45),
              SamplingParams(temperature=1e-6, top_p=1e-6, top_k=2), SamplingParams(temperature=100.0)):
        t = s.sample(x, [p], [0])[0].token_id
        assert 0 <= t < x.shape[1]
    assert s.sample(x, [SamplingParams(temperature=1.0, top_p=1e-45)], [0])[0].token_id == int(x.argmax())
