"""Benchmark workloads generated from a seed (no data set can be downloaded).

- `random`: like vLLM's random dataset. Prompt and output lengths are drawn uniformly from
  [len·(1 − range_ratio), len·(1 + range_ratio)]; the prompt is random non-special token ids,
  sent either as those ids (exact length) or decoded to text and adjusted until the text
  re-encodes to the drawn length (exact in practice; `prompt_len` is always the re-encoded
  length, so a rare miss is visible, never hidden).
- `sharegpt-like`: ShareGPT's shape without its text. Prompt and output lengths are lognormal,
  with the means the vLLM paper reports for ShareGPT (161 prompt tokens, 338 output tokens)
  and a spread chosen so the median sits well below the mean (long tail), then clipped the way
  vLLM filters ShareGPT (each side >= 4 tokens, prompt <= 1024, prompt + output <= 2048).
  Prompt content is random tokens, as above.
- `shared-prefix`: `num_prefixes` system prompts of `prefix_len` tokens; each request is one
  of them (drawn uniformly) followed by a user turn of its own (`input_len`, as `random`).
  What prefix caching and cache-aware routing are for.
- `multi-turn`: conversations whose every turn resends the history: turn k's prompt is the
  user turns and assistant replies before it (replies are random tokens of `output_len`, not
  what the server answered) plus a new user turn. Turn k+1 is sent only once turn k ended
  (`BenchRequest.after`), as a chat client would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.tokenizer import Tokenizer

# round trips text -> ids -> text allowed before accepting an approximate length
MAX_TEXT_ADJUSTMENTS = 16


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]     # text, or token ids (the completions endpoint accepts both)
    prompt_len: int             # tokens the server will see for a completions request
    output_len: int             # max_tokens sent (with ignore_eos, the tokens generated)
    after: int | None = None    # multi-turn: the index of the request that must end first


@dataclass(frozen=True)
class LogNormalLengths:
    """Lengths whose mean is `mean` and whose log has standard deviation `sigma`."""
    mean: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma ** 2 / 2    # E[exp(N(mu, s²))] = exp(mu + s²/2)
        raw = rng.lognormal(mu, self.sigma, n)
        return np.clip(np.rint(raw), self.low, self.high).astype(int)


# ShareGPT as the vLLM paper (Kwon et al. 2023, fig. 11) summarises it: mean prompt 161 tokens,
# mean output 338; sigma 1.0 puts the prompt median near 98 and the output median near 225.
SHAREGPT_PROMPT = LogNormalLengths(mean=161.0, sigma=1.0, low=4, high=1024)
SHAREGPT_OUTPUT = LogNormalLengths(mean=338.0, sigma=0.9, low=4, high=2044)
SHAREGPT_MAX_TOTAL = 2048


def uniform_lengths(rng: np.random.Generator, n: int, length: int,
                    range_ratio: float) -> np.ndarray:
    """vLLM's random dataset: integers uniform in [len·(1−r), len·(1+r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, n)


class PromptMaker:
    """Random prompts of a given token length, avoiding special tokens (which would change
    the model's behaviour and re-encode differently)."""

    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids
        special = set(tokenizer.backend.get_added_tokens_decoder())
        self._allowed = np.array([t for t in range(tokenizer.vocab_size) if t not in special])

    def _ids(self, rng: np.random.Generator, n: int) -> list[int]:
        return self._allowed[rng.integers(0, len(self._allowed), n)].tolist()

    def make(self, rng: np.random.Generator, length: int) -> tuple[str | list[int], int]:
        ids = self._ids(rng, length)
        if self.as_token_ids:
            return ids, length
        return self._text_of_length(rng, ids, length)

    def join(self, parts: list[str | list[int]]) -> tuple[str | list[int], int]:
        """Parts made by `make`, one after another, with the joined prompt's length (text
        may merge a token at each seam; the count is the re-encoded one)."""
        if self.as_token_ids:
            ids = [t for part in parts for t in part]
            return ids, len(ids)
        text = "".join(parts)
        return text, len(self.tokenizer.encode(text, add_special_tokens=True))

    def _text_of_length(self, rng: np.random.Generator, ids: list[int],
                        length: int) -> tuple[str, int]:
        # decoding then encoding merges or splits tokens at the seams: trim or top up the
        # re-encoded ids until the text's own encoding has the wanted length
        tok = self.tokenizer
        text = tok.decode(ids)
        for _ in range(MAX_TEXT_ADJUSTMENTS):
            encoded = tok.encode(text, add_special_tokens=True)
            if len(encoded) == length:
                break
            if len(encoded) > length:
                encoded = encoded[:length]
            else:
                encoded = encoded + self._ids(rng, length - len(encoded))
            text = tok.decode(encoded)
        return text, len(tok.encode(text, add_special_tokens=True))


def random_dataset(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0,
                   as_token_ids: bool = False) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lens = uniform_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = uniform_lengths(rng, num_prompts, output_len, range_ratio)
    maker = PromptMaker(tokenizer, as_token_ids)
    out = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        prompt, actual = maker.make(rng, n_in)
        out.append(BenchRequest(prompt, actual, n_out))
    return out


def sharegpt_like_lengths(rng: np.random.Generator, n: int,
                          output_len: int | None = None) -> list[tuple[int, int]]:
    """(prompt, output) lengths; `output_len` fixes every output like vLLM's
    --sharegpt-output-len."""
    prompts = SHAREGPT_PROMPT.sample(rng, n)
    outputs = SHAREGPT_OUTPUT.sample(rng, n) if output_len is None else np.full(n, output_len)
    outputs = np.maximum(1, np.minimum(outputs, SHAREGPT_MAX_TOTAL - prompts))
    return list(zip(prompts.tolist(), outputs.tolist()))


def sharegpt_like_dataset(tokenizer: Tokenizer, num_prompts: int, seed: int = 0,
                          output_len: int | None = None,
                          as_token_ids: bool = False) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, as_token_ids)
    out = []
    for n_in, n_out in sharegpt_like_lengths(rng, num_prompts, output_len):
        prompt, actual = maker.make(rng, n_in)
        out.append(BenchRequest(prompt, actual, n_out))
    return out


def shared_prefix_dataset(tokenizer: Tokenizer, num_prompts: int, num_prefixes: int,
                          prefix_len: int, input_len: int, output_len: int,
                          range_ratio: float = 0.0, seed: int = 0,
                          as_token_ids: bool = False) -> list[BenchRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each request one of them plus a
    user turn of its own."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("num_prefixes and prefix_len must be >= 1")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, as_token_ids)
    prefixes = [maker.make(rng, prefix_len)[0] for _ in range(num_prefixes)]
    which = rng.integers(0, num_prefixes, num_prompts).tolist()
    in_lens = uniform_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = uniform_lengths(rng, num_prompts, output_len, range_ratio)
    out = []
    for p, n_in, n_out in zip(which, in_lens.tolist(), out_lens.tolist()):
        prompt, actual = maker.join([prefixes[p], maker.make(rng, n_in)[0]])
        out.append(BenchRequest(prompt, actual, n_out))
    return out


def multi_turn_dataset(tokenizer: Tokenizer, num_prompts: int, num_conversations: int,
                       input_len: int, output_len: int, range_ratio: float = 0.0,
                       seed: int = 0, as_token_ids: bool = False) -> list[BenchRequest]:
    """`num_prompts` turns spread over `num_conversations` conversations (turn-major order:
    every conversation's first turn, then every second turn, ...); each turn resends the
    conversation so far and waits for the previous turn."""
    if num_conversations < 1:
        raise ValueError("num_conversations must be >= 1")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, as_token_ids)
    in_lens = uniform_lengths(rng, num_prompts, input_len, range_ratio).tolist()
    out_lens = uniform_lengths(rng, num_prompts, output_len, range_ratio).tolist()
    history: list[list] = [[] for _ in range(num_conversations)]
    last: list[int | None] = [None] * num_conversations
    out = []
    for index in range(num_prompts):
        c = index % num_conversations
        history[c].append(maker.make(rng, in_lens[index])[0])
        prompt, actual = maker.join(history[c])
        out.append(BenchRequest(prompt, actual, out_lens[index], after=last[c]))
        # the reply the next turn resends: random tokens of the length this turn generates
        history[c].append(maker.make(rng, out_lens[index])[0])
        last[c] = index
    return out
