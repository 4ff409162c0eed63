"""The worker's side of structured outputs (docs/design.md#structured-outputs): a grammar
matcher per constrained request, which masks its logits row before every sample and takes
each token sampled. It lives where the tokens are sampled, so a plan made ahead of the last
result (docs/design.md#overlap) never needs the token the mask depends on.

A matcher is made from the request's tokens whenever a plan brings the request here (first
schedule, recompute after preemption, a restarted worker, a P/D hand-off): it consumes the
output tokens so far, so its state is a function of the tokens alone.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence

import structlog
import torch
import torch.nn.functional as F

from shared.model_source import ModelSource
from shared.sampling import SamplingParams
from shared.structured import grammar

log = structlog.get_logger("worker")


class Grammars:
    """Makes matchers for one model. Its vocabulary as llguidance reads it (~0.5 s for the
    default model's 49k tokens, after the weights were read) is built once: by `warm()` in the
    background as a served worker starts, else on the first constrained request."""

    def __init__(self, source: ModelSource, vocab_size: int, eos_token_ids: Iterable[int]):
        self.source, self.vocab_size = source, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the vocabulary on a thread of its own, so that the first constrained request
        does not stall every stream of its iteration."""
        threading.Thread(target=self._vocabulary, name="grammar-vocabulary", daemon=True).start()

    def _vocabulary(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build()
            return self._tokenizer

    def _build(self):
        from llguidance import LLTokenizer

        from shared.tokenizer import load_tokenizer
        backend = load_tokenizer(self.source).backend
        return LLTokenizer(backend.to_str(), n_vocab=max(self.vocab_size, backend.get_vocab_size()),
                           eos_token=self.eos_token_ids)

    @property
    def n_vocab(self) -> int:
        """How many tokens the matchers' masks cover: the model's logits or the tokenizer's
        vocabulary, whichever is wider (llguidance wants a mask buffer of exactly this)."""
        return self._vocabulary().vocab_size

    def matcher(self, request_id: str, sampling: SamplingParams, output: Sequence[int]):
        """A matcher for `sampling`'s constraint that has taken `output` (the request's
        tokens sampled so far), or None when the request has none. One the grammar engine
        gave up on (`is_error()`: its limits, or an output it does not match) is returned as
        it is: the request's next sample is no token, and it ends with an error, never
        unconstrained."""
        if sampling.structured_outputs is None:
            return None
        from llguidance import LLMatcher
        m = LLMatcher(self._vocabulary(), grammar(*sampling.structured_outputs))
        m.consume_tokens(list(output))
        if m.is_error():
            log.warning("the grammar engine gave up on a request's structured output",
                        request_id=request_id, error=m.get_error())
        return m


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list, n_vocab: int) -> None:
    """Set to -inf, in place, each listed row's logits of the tokens its matcher does not
    allow next; `n_vocab`: the matchers' (`Grammars.n_vocab`: a tokenizer may have tokens
    the logits do not). The masks are computed on the host, one bit a token, and widened on the
    logits' device by a table of 256 bytes' eight (0 or -inf) values: added to the logits,
    an allowed one is unchanged (x + 0) and the others -inf. (A boolean masked_fill over the
    vocabulary costs 7x as much on a CPU: 3.3 ms against 0.5 at 32 rows.)"""
    # llguidance.torch is not imported: it compiles a kernel of its own with torch.compile
    # (and imports dynamo, ~2 s)
    vocab = logits.shape[1]         # at most n_vocab (the vocabulary counts the logits)
    bits = torch.empty((len(rows), -(-n_vocab // 32)), dtype=torch.int32)
    row_bytes = bits.shape[1] * 4
    if len(matchers) == 1:
        matchers[0].unsafe_compute_mask_ptr(bits.data_ptr(), row_bytes)
    else:        # the rows on llguidance's own threads, the GIL let go
        _executor().unsafe_compute_mask_ptr(list(zip(matchers, range(len(matchers)))),
                                            bits.data_ptr(), row_bytes, len(matchers))
    byte_values = bits.view(torch.uint8).to(logits.device, non_blocking=True).long()
    additive = F.embedding(byte_values, _byte_table(logits.device, logits.dtype)).flatten(1)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits.index_add_(0, index, additive[:, :vocab])


@functools.lru_cache(maxsize=1)
def _executor():
    """llguidance's thread pool for a batch's masks, one thread per torch thread: a mask the
    grammar engine has not met before (a bounded repetition makes every position new) costs
    ~0.3 ms a row, 10 ms for 32 rows on one thread, 5 on two."""
    from llguidance import LLExecutor
    return LLExecutor(max(1, torch.get_num_threads()))


@functools.lru_cache(maxsize=8)
def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: byte b's bit k (little-endian: token 8j + k of byte j) as 0 (allowed) or
    -inf."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
