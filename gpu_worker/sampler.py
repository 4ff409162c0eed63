"""Sampling from the LM head's rows: greedy, temperature, top-k, top-p, per-request seeds,
log-probabilities.

A seeded request draws its n-th token from a generator seeded with (seed, n), so its output
depends on nothing else in the batch and survives preemption and recomputation unchanged.
"""
from __future__ import annotations

import torch

from shared.plan import SampledToken
from shared.sampling import SamplingParams

_SEED_STRIDE = 1_000_003


class Sampler:
    def __init__(self, seed: int | None = None):
        self._unseeded = torch.Generator(device="cpu")
        if seed is None:
            self._unseeded.seed()
        else:
            self._unseeded.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_index: list[int]) -> list[SampledToken]:
        """logits: [S, V] float32, one row per sampling request; output_index[i] is how many
        tokens row i's request has generated before this one."""
        # Greedy rows: one argmax over every row on the logits' device and one copy of the
        # ids to the host per step — no boolean-mask indexing, no per-row sync. The rows that
        # sample are then overwritten (the argmax of a row is cheap beside its draw).
        if any(p.greedy for p in params):
            token_ids = logits.argmax(dim=-1).to("cpu", torch.int64)
        else:
            token_ids = torch.empty(len(params), dtype=torch.int64)
        for i, p in enumerate(params):
            if not p.greedy:
                token_ids[i] = self._draw(logits[i], p, output_index[i])
        return self._with_logprobs(logits, params, token_ids)

    def _draw(self, row: torch.Tensor, p: SamplingParams, n: int) -> int:
        row = row.float() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) >= p.top_p   # keep the first past p
            drop[0] = False                     # a top_p that rounds to 0 keeps the top token
            row = row.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(row, -1).cpu()
        gen = self._unseeded
        if p.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(p.seed * _SEED_STRIDE + n)
        return int(torch.multinomial(probs, 1, generator=gen))

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                       token_ids: torch.Tensor) -> list[SampledToken]:
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        out = [SampledToken(int(t)) for t in token_ids.tolist()]
        if not want:
            return out
        logp = torch.log_softmax(logits[want].float(), dim=-1).cpu()
        for row, i in enumerate(want):
            tok = int(token_ids[i])
            top = None
            if params[i].logprobs:
                vals, ids = torch.topk(logp[row], params[i].logprobs)
                top = list(zip(ids.tolist(), vals.tolist()))
            out[i] = SampledToken(tok, float(logp[row, tok]), top)
        return out
