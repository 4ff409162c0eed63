"""Sampling from the LM head's rows on the logits' device: greedy, temperature, top-k, top-p,
per-request seeds, log-probabilities — the whole batch at once, and one copy to the host per
step (the sampled ids, with the log-probabilities the rows asked for).

A sampled row draws by the Gumbel-max trick: the argmax of its masked, temperature-scaled
logits plus Gumbel noise -log(-log U), one uniform U per vocabulary entry, is a draw from
their softmax. A seeded request's U come from a counter-based hash of (seed, output index,
vocabulary index), computed with integer tensor ops on the device, so its n-th token depends
only on (seed, n, its logits): not on the rest of the batch, and the same after preemption
and recomputation. Unseeded rows take their U from one generator on the device.
docs/gpu.md#sampling has the details.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_worker.cpu_kernels import cpu_kernels
from shared.attention_choice import installed
from shared.plan import NO_TOKEN, SampledToken
from shared.sampling import SamplingParams

_MASK32 = 0xFFFFFFFF
# top-k/top-p look at each row's this many largest first (_top_k_top_p)
NUCLEUS_WIDTH = 1024
# the per-row parameters, packed into one host tensor (one copy to the device per step)
_ROW, _TEMPERATURE, _TOP_P, _TOP_K, _SEEDED, _SEED_LO, _SEED_HI, _INDEX, _MIN_P = range(9)
_FLOAT32_MAX = torch.finfo(torch.float32).max
# the largest logit the repetition penalty makes: a penalty so small that a logit divided by
# it passes float32's range made it inf (and an exact 0 divided by 0, NaN), and the draw
# garbage. Far above any model's logits, and still finite in float32 divided by the least
# temperature that is not greedy (1e-5); float16 logits stop at their own largest
_MAX_PENALIZED = 1e30
_TRITON = installed("triton")        # the GPU's argmax (triton_ops.argmax_rows)


def to_host(t: torch.Tensor) -> list:
    """The sampler's only read of the device: one per step (tests count the calls)."""
    return t.tolist()


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without ever overflowing int64:
    the halves of x times a 32-bit constant stay below 2**48."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply, the "lowbias32" constants) on int64
    tensors holding values in [0, 2**32); the same bits on every device."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_bits(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor,
                columns: int) -> torch.Tensor:
    """[R, columns] 32-bit words (in int64), a pure function of each row's (seed, output
    index) and the column. Arguments: int64 [R] tensors, each value in [0, 2**32)."""
    key = hash32((seed_lo + 0x9E3779B9) & _MASK32)
    key = hash32(key ^ seed_hi)
    key = hash32(key ^ index)[:, None]
    column = torch.arange(columns, device=key.device, dtype=torch.int64)[None, :]
    return hash32(hash32(key ^ column) ^ ((key * 5 + 0x632BE5AB) & _MASK32))


def seeded_row_uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor,
                        index: torch.Tensor) -> torch.Tensor:
    """[R, 1] float64 uniforms in (0, 1), one a row, from 52 bits of two words:
    (2m + 1) / 2**53, exact, never 0 nor 1."""
    bits = seeded_bits(seed_lo, seed_hi, index, 2) >> 6          # 26 bits each
    m = bits[:, :1] * (1 << 26) + bits[:, 1:]
    return (2 * m + 1).to(torch.float64) * 2.0 ** -53


class Sampler:
    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator, one per device, made on first use."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_index: list[int],
               counts: Sequence[TokenCounts | None] | None = None,
               eos_token_ids: frozenset[int] = frozenset(),
               masked: bool = False) -> list[SampledToken]:
        """logits: [S, V], one row per sampling request; output_index[i] is how many tokens
        row i's request has generated before this one; counts[i] its TokenCounts, which a
        row whose params adjust its logits (a bias, a penalty) needs; `eos_token_ids` are
        kept from rows short of their min_tokens. Everything runs on the logits' device; the
        ids (and the log-probabilities asked for) reach the host in one copy.
        Log-probabilities are the model's, before any penalty (as vLLM's), after the mask
        of a structured output (`masked`: some rows have one), -inf as -9999 (as vLLM's, so
        that the JSON they go into stays JSON). A row whose masks leave no token gets
        NO_TOKEN."""
        raw = logits
        adjusted = {i: (p, counts[i] if counts is not None else None)
                    for i, p in enumerate(params) if p.adjusts_logits}
        banned = [(i, t) for i, p in enumerate(params) if p.min_tokens > output_index[i]
                  for t in p.suppressed(output_index[i], eos_token_ids)]
        if adjusted or banned:
            logits = apply_penalties(logits, adjusted, banned)
        token_ids = argmax(logits)                      # greedy rows: exact argmax
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            table = _to_device(torch.tensor(
                [_row_params(i, params[i], output_index[i]) for i in drawn], dtype=torch.float64),
                logits.device)
            rows = table[:, _ROW].to(torch.int64)
            chosen = self._draw(logits.index_select(0, rows), table,
                                [params[i] for i in drawn])
            token_ids = token_ids.index_copy(0, rows, chosen)
        if masked or adjusted or banned:      # a row may have nothing left
            none_left = logits.gather(1, token_ids[:, None]).squeeze(1) == float("-inf")
            token_ids = token_ids.masked_fill(none_left, NO_TOKEN)
        return _finish(raw, params, token_ids)

    def _draw(self, logits: torch.Tensor, table: torch.Tensor,
              params: list[SamplingParams]) -> torch.Tensor:
        """[R] ids drawn from [R, V] logits; `table`: the rows' packed parameters."""
        # a temperature past float32's range would be inf there, and a masked logit (-inf)
        # divided by it NaN: the row would have no token left; the largest float32 scales
        # the others as much (all but equal: uniform over what the masks leave)
        x = logits.float() / table[:, _TEMPERATURE, None].clamp(max=_FLOAT32_MAX).float()
        if any(p.min_p > 0 for p in params):
            # first, as vLLM (top-p then weighs what is left): p(t) < min_p * p(best) where
            # x(t) < x(best) + log(min_p); log(0) = -inf keeps all
            floor = x.max(dim=-1, keepdim=True).values + torch.log(table[:, _MIN_P, None]).float()
            x = x.masked_fill(x < floor, float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            x = _top_k_top_p(x, table, params)
        # one uniform a row: a seeded row's a function of its seed and output index alone
        # (so its token depends on nothing else in the batch), the others' from the generator
        seeded = [p.seed is not None for p in params]
        if all(seeded):
            u = seeded_row_uniforms(*_seed_columns(table))
        else:
            u = 1.0 - torch.rand((x.shape[0], 1), generator=self._generator(x.device),
                                 device=x.device, dtype=torch.float64)     # in (0, 1]
            if any(seeded):
                u = torch.where(table[:, _SEEDED, None] > 0,
                                seeded_row_uniforms(*_seed_columns(table)), u)
        return inverse_cdf(x, u)


class TokenCounts:
    """One request's tokens as its penalties need them, on the logits' device, brought up to
    date with the tokens appended since the last step rather than rebuilt every step: the
    distinct tokens of the prompt and the output (the repetition penalty's), and the
    output's distinct tokens with how often each occurs (the frequency and presence
    penalties'). Sparse: a step touches only these tokens' logits, not the vocabulary.
    `tokens` is the request's own list, which only grows (the runner appends each token)."""

    def __init__(self, tokens: list[int], num_prompt: int) -> None:
        self.tokens, self.num_prompt = tokens, num_prompt
        self.upto = 0
        self._seen: set[int] = set()
        self._at: dict[int, int] = {}           # output token -> its place in out_ids
        self.seen_ids = self.out_ids = self.out_counts = None

    def update(self, device: torch.device) -> "TokenCounts":
        if self.seen_ids is None:
            self.seen_ids = torch.empty(0, dtype=torch.int64, device=device)
            self.out_ids = torch.empty(0, dtype=torch.int64, device=device)
            self.out_counts = torch.empty(0, dtype=torch.float32, device=device)
        new = self.tokens[self.upto:]
        fresh = [t for t in dict.fromkeys(new) if t not in self._seen]
        if fresh:
            self._seen.update(fresh)
            self.seen_ids = torch.cat([self.seen_ids, _ids(fresh, device)])
        output = self.tokens[max(self.upto, self.num_prompt):]
        if output:
            first = [t for t in dict.fromkeys(output) if t not in self._at]
            if first:
                self._at.update(zip(first, range(len(self._at), len(self._at) + len(first))))
                self.out_ids = torch.cat([self.out_ids, _ids(first, device)])
                self.out_counts = torch.cat([self.out_counts, torch.zeros(len(first),
                                                                          device=device)])
            self.out_counts.index_add_(0, _ids([self._at[t] for t in output], device),
                                       torch.ones(len(output), device=device))
        self.upto = len(self.tokens)
        return self


def bad_word_ends(words: Sequence[Sequence[int]], tokens: Sequence[int],
                  num_prompt: int) -> list[int]:
    """The ids that would complete one of `words` (token sequences) after the output so far,
    `tokens[num_prompt:]`: each word's last token, where the output ends with the rest of it
    (a one-token word: always). Only each word's length of the tail is looked at."""
    return [w[-1] for w in words
            if len(w) == 1 or (len(tokens) - num_prompt >= len(w) - 1 and
                               list(tokens[len(tokens) - len(w) + 1:]) == list(w[:-1]))]


def _ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def apply_penalties(logits: torch.Tensor,
                    rows: dict[int, tuple[SamplingParams, TokenCounts]],
                    banned: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """A copy of logits [S, V] with each listed row's logit bias and penalties applied, given
    its params and its request's TokenCounts, in vLLM's order, every row in one pass of each
    kind over the logits of the tokens concerned. The bias first; then the repetition penalty
    on the tokens of the prompt and the output, in transformers' form (a logit below 0 times
    the penalty, any other divided by it), so greedy output matches its `repetition_penalty`
    bit for bit; then the frequency penalty times each token's count in the output, and the
    presence penalty once for each token there. Last, a row with allowed_token_ids has every
    other id masked out (-inf), and so has each (row, token) of `banned` (a request short of
    its min_tokens: what would end it) and each token that would complete a bad word."""
    out = logits.clone(memory_format=torch.contiguous_format)   # a vocabulary slice too
    flat, vocab, device = out.view(-1), out.shape[1], out.device
    bias: list[tuple[int, float]] = []
    allowed: list[tuple[int, int]] = []
    bad: list[tuple[int, int]] = []
    rep: list[tuple[torch.Tensor, float]] = []
    freq: list[tuple[torch.Tensor, torch.Tensor, float, float]] = []
    for i, (p, counts) in rows.items():
        # an id past these logits (a tokenizer with more ids than the LM head) would land on
        # the next row's: another request's logits
        bias += [(i * vocab + t, b) for t, b in p.logit_bias if t < vocab]
        allowed += [(i, t) for t in p.allowed_token_ids if t < vocab]
        if p.bad_words_token_ids:
            bad += [(i, t) for t in bad_word_ends(p.bad_words_token_ids, counts.tokens,
                                                  counts.num_prompt)]
        if p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty:
            continue
        c = counts.update(device)
        if p.repetition_penalty != 1.0:
            rep.append((c.seen_ids + i * vocab, p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and len(c.out_ids):
            freq.append((c.out_ids + i * vocab, c.out_counts, p.frequency_penalty,
                         p.presence_penalty))
    if bias:
        at, b = zip(*bias)
        flat.index_add_(0, _ids(at, device), torch.tensor(b, dtype=out.dtype, device=device))
    if rep:
        at = torch.cat([a for a, _ in rep])
        by = _per_entry([r for _, r in rep], [len(a) for a, _ in rep], out.dtype, device)
        finfo = torch.finfo(out.dtype)
        by = by.clamp_min(finfo.tiny)                     # a penalty of 1e-300 is 0 there
        score = flat[at]
        flat[at] = torch.where(score < 0, score * by, score / by).clamp_max(
            min(_MAX_PENALIZED, finfo.max))
    if freq:
        at = torch.cat([a for a, *_ in freq])
        n = torch.cat([c for _, c, *_ in freq]).to(out.dtype)
        sizes = [len(a) for a, *_ in freq]
        f = _per_entry([f for *_, f, _ in freq], sizes, out.dtype, device)
        pres = _per_entry([p for *_, p in freq], sizes, out.dtype, device)
        flat.index_add_(0, at, -(n * f + pres))
    if allowed:          # vLLM's allowed_token_ids: every other id of those rows masked
        rows_of = sorted({i for i, _ in allowed})
        keep = torch.full((len(rows_of), vocab), float("-inf"), dtype=out.dtype, device=device)
        at = {i: k for k, i in enumerate(rows_of)}
        keep[_ids([at[i] for i, _ in allowed], device), _ids([t for _, t in allowed], device)] = 0
        out.index_add_(0, _ids(rows_of, device), keep)
    banned = [(i, t) for i, t in [*banned, *bad] if t < vocab]
    if banned:
        at, ids = zip(*banned)
        out[_ids(at, device), _ids(ids, device)] = float("-inf")
    return out


def _per_entry(values: list[float], sizes: list[int], dtype, device) -> torch.Tensor:
    """Each row's value repeated for each of its entries."""
    return torch.repeat_interleave(torch.tensor(values, dtype=dtype, device=device),
                                   torch.tensor(sizes, device=device))


def inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] ids, row r's drawn from softmax(x[r]) by its inverse CDF at u[r] (in (0, 1]): one
    uniform a row, where the Gumbel trick draws one a token and takes two logarithms of each
    (32 rows of 49,152 on 2 CPU cores: 1.8 ms against 12.6, docs/benchmarks.md#sampling).
    Masked tokens (-inf) have no width in the CDF and are never drawn: u · total > 0."""
    cdf = torch.cumsum(torch.softmax(x, dim=-1), dim=-1, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=x.shape[1] - 1).flatten()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (the first index of each row's largest value, a NaN the largest);
    for float32 logits on CPU the kernels' (csrc/sampling.cpp: 0.1 ms for 32 rows of 49,152
    against torch's 1.3 ms here); on a GPU Triton's (gpu_worker/model/triton_ops.py)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and \
            x.is_contiguous() and x.shape[1] > 0:
        kernels = cpu_kernels()
        if kernels is not None and hasattr(kernels, "argmax_rows"):
            out = torch.empty(x.shape[0], dtype=torch.int64)
            kernels.argmax_rows(x, out)
            return out
    if x.is_cuda and x.dim() == 2 and x.shape[1] > 0 and _TRITON:
        from gpu_worker.model.triton_ops import argmax_rows
        return argmax_rows(x if x.stride(-1) == 1 else x.contiguous())
    return x.argmax(dim=-1)


def _row_params(row: int, p: SamplingParams, n: int) -> tuple:
    seed = p.seed if p.seed is not None else 0
    return (row, p.temperature, p.top_p, p.top_k, p.seed is not None,
            seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, n & 0xFFFFFFFF, p.min_p)


def _seed_columns(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cols = table[:, _SEED_LO:_INDEX + 1].to(torch.int64)     # exact: each value < 2**32
    return cols[:, 0], cols[:, 1], cols[:, 2]


def _top_k_top_p(x: torch.Tensor, table: torch.Tensor,
                 params: list[SamplingParams]) -> torch.Tensor:
    """Mask (-inf) what each row's top-k and top-p leave out; k = 0 and p = 1 are off. Ties
    with the k-th value stay in; top-p keeps the smallest prefix (by probability) whose mass
    reaches p, so a p that rounds to 0 keeps the most likely token (the mass summed in
    float32: a prefix within its rounding of p may keep one token more, docs/gpu.md#sampling).

    Sorting whole rows is what costs (32 rows of 49,152: 56 ms on 2 CPU cores), so on a CPU
    each row's largest come first (NUCLEUS_WIDTH of them for top-p: 8 ms; k for top-k alone):
    where k is within them and they hold at least p of the mass, the nucleus is a prefix of
    them. Rows where not are sorted whole. That needs a look at the values, free on a CPU; on
    a GPU it would be a sync, so there every row is sorted whole. `params`: the rows' own, on
    the host (the window's width comes from them)."""
    vocab = x.shape[1]
    if x.device.type != "cpu":
        return _top_k_top_p_sorted(x, table)
    k = table[:, _TOP_K].to(torch.int64)
    top_p = table[:, _TOP_P, None].float()
    # top-k alone needs each row's k largest; a nucleus, the wider window
    nucleus_rows = any(p.top_p < 1.0 for p in params)
    width = min(vocab, NUCLEUS_WIDTH if nucleus_rows else max(p.top_k for p in params))
    if width == vocab:
        return _top_k_top_p_sorted(x, table)
    vals, order = torch.topk(x, width, dim=-1)              # each row's largest, descending
    # the k-th value (ties with it stay in), -inf for rows without top-k
    kth = vals.gather(1, (k.clamp(1, width) - 1)[:, None])
    kth = torch.where(((k > 0) & (k < vocab))[:, None], kth, float("-inf"))
    masked = x.masked_fill(x < kth, float("-inf"))
    if not nucleus_rows:
        return masked
    vals = vals.masked_fill(vals < kth, float("-inf"))
    probs = torch.exp(vals - torch.logsumexp(masked, dim=-1, keepdim=True))
    drop = (probs.cumsum(dim=-1) - probs >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    nucleus = torch.full_like(x, float("-inf")).scatter(1, order,
                                                        vals.masked_fill(drop, float("-inf")))
    out = torch.where(top_p < 1.0, nucleus, masked)
    # rows whose k reaches past the candidates, or whose nucleus does
    whole = ((k > width) & (k < vocab)) \
        | ((top_p[:, 0] < 1.0) & (probs.sum(dim=-1) < top_p[:, 0]))
    if bool(whole.any()):
        rows = whole.nonzero().flatten()
        out[rows] = _top_k_top_p_sorted(x[rows], table[rows])
    return out


def _top_k_top_p_sorted(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """_top_k_top_p by sorting whole rows."""
    vocab = x.shape[1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    k = table[:, _TOP_K].to(torch.int64)
    k = torch.where(k > 0, k.clamp(max=vocab), vocab)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    top_p = table[:, _TOP_P, None].float()
    drop = (probs.cumsum(dim=-1) - probs >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    drop = drop | (sorted_x == float("-inf"))
    return x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


# the least log-probability reported: a masked token's (-inf) is no JSON number
LOGPROB_FLOOR = -9999.0


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto the device without waiting for it (pinned, non-blocking on CUDA)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _finish(logits: torch.Tensor, params: list[SamplingParams],
            token_ids: torch.Tensor) -> list[SampledToken]:
    """The ids, and for the rows that asked the chosen token's log-probability and the top
    N, gathered on the device and brought to the host in one copy."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return [SampledToken(t) for t in to_host(token_ids)]
    top_n = max(params[i].logprobs for i in want)
    rows = _to_device(torch.tensor(want, dtype=torch.int64), logits.device)
    logp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    logp = logp.clamp_min_(LOGPROB_FLOOR)
    chosen = logp.gather(1, token_ids.index_select(0, rows).clamp_min(0)[:, None])
    parts = [token_ids.double(), chosen.double().flatten()]
    if top_n:
        vals, ids = torch.topk(logp, top_n, dim=-1)
        parts += [vals.double().flatten(), ids.double().flatten()]
    flat = to_host(torch.cat(parts))          # ids < 2**53 and float32 values: exact in float64
    n_rows, w = len(params), len(want)
    out = [SampledToken(int(t)) for t in flat[:n_rows]]
    vals, ids = flat[n_rows + w:n_rows + w + w * top_n], flat[n_rows + w + w * top_n:]
    for j, i in enumerate(want):
        top = None
        if params[i].logprobs:
            n = params[i].logprobs
            top = [(int(t), v) for t, v in zip(ids[j * top_n:j * top_n + n],
                                                vals[j * top_n:j * top_n + n])]
        out[i] = SampledToken(out[i].token_id, flat[n_rows + j], top)
    return out
