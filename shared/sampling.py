"""Per-request sampling parameters. Pure data: validated once, then shared by the scheduler
(stop conditions) and the worker (the sampler)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

from shared.errors import InvalidRequestError
from shared.structured import structured_pair


_GREEDY_BELOW = 1e-5
MAX_REPETITION_PENALTY = 2.0
MAX_PENALTY = 2.0                     # presence and frequency: [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0                # logit_bias values: [-100, 100], as OpenAI's
MAX_LOGIT_BIAS_ENTRIES = 1024
# each is paid for on every step of the batch its request is in: bounded as logit_bias is
# (a 49k allowed_token_ids took a 5 ms step to 17, 60k bad_words to 43)
MAX_TOKEN_IDS = 1024                  # allowed_token_ids, stop_token_ids
MAX_BAD_WORDS = 1024                  # bad_words (each one or two token sequences)
MAX_TOKEN_ID_DIGITS = 19              # a token id as a key: int64's, the wire's
# A seed: any int64, as OpenAI's and vLLM's (a millisecond clock reading is a common one; so is
# 2**63 - 1). The sampler hashes its 64 bits: a larger one would alias a smaller one's tokens
# (2**64 gave seed 0's), so none is taken.
SEED_RANGE = (-2**63, 2**63)
INT64_TEXT = "a 64-bit integer, from -2**63 to 2**63 - 1"


def choice_seed(seed: int, j: int) -> int:
    """The seed of a request's j-th choice: seed + j (vLLM's rule), wrapped to stay an int64
    (the same 64 bits the sampler hashes, so the same tokens as seed + j unwrapped)."""
    return (seed + j - SEED_RANGE[0]) % 2**64 + SEED_RANGE[0]


_INT_FIELDS = ("max_tokens", "top_k", "seed", "logprobs", "min_tokens", "prompt_logprobs")
_OPTIONAL_FIELDS = ("seed", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0                # (0, 1]
    top_k: int = 0                    # 0 means off
    seed: int | None = None           # same seed -> same tokens, whatever shares the batch
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None       # None: none; 0: the sampled token's; N: plus top-N
    # OpenAI's penalties, subtracted from a token's logit: once if it is in the output so far
    # (presence), once per time it is there (frequency); vLLM's repetition penalty divides a
    # positive logit (multiplies a negative one) of any token in the prompt or the output
    presence_penalty: float = 0.0     # [-2, 2]
    frequency_penalty: float = 0.0    # [-2, 2]
    repetition_penalty: float = 1.0   # (0, 2]; 1 is off
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits first
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # vLLM's: no EOS and no stop token (nor stop string) before this many output tokens
    min_tokens: int = 0
    # vLLM's: drop tokens less likely than min_p times the most likely one; 0 is off
    min_p: float = 0.0
    # the prompt's own log-probabilities (each prompt token's given those before it), as
    # OpenAI's `echo` with `logprobs` returns them: None: none; 0: the token's; N: plus top-N
    prompt_logprobs: int | None = None
    # vLLM's: only these ids may be drawn (empty: any)
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # vLLM's bad_words, as token sequences: a sequence's last token is never drawn where the
    # output so far ends with the rest of it (the gateway tokenizes each word, with and
    # without a leading space)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    # what the output must match (shared/structured.py): (kind, text), e.g. ("json", a JSON
    # schema); vLLM's {kind: spec} is taken too. None: free text
    structured_outputs: tuple[str, str] | None = None
    # max_tokens was not asked for (a chat's default: the rest of the context as the gateway
    # knew it): a scheduler whose context is shorter answers in the rest of its own (vLLM's
    # max_tokens None) where one asked for is refused there (`fit_context`)
    max_tokens_default: bool = False

    # set by the gateway for the schedulers, not by a user: not among a request's fields
    INTERNAL_FIELDS: ClassVar[tuple[str, ...]] = ("max_tokens_default",)

    def __post_init__(self) -> None:
        self._check_types()
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids",
                                                              self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(
            _token_ids("allowed_token_ids", self.allowed_token_ids)))))
        if not isinstance(self.bad_words_token_ids, (list, tuple)):
            raise InvalidRequestError(f"bad_words_token_ids must be a list of lists of token "
                                      f"ids, got {self.bad_words_token_ids!r:.100}")
        object.__setattr__(self, "bad_words_token_ids", tuple(dict.fromkeys(
            _token_ids(f"bad_words_token_ids[{i}]", seq)
            for i, seq in enumerate(self.bad_words_token_ids))))
        if len(self.allowed_token_ids) > MAX_TOKEN_IDS or \
                len(self.stop_token_ids) > 2 * MAX_TOKEN_IDS or \
                len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise InvalidRequestError(f"allowed_token_ids and stop_token_ids take at most "
                                      f"{MAX_TOKEN_IDS} ids, bad_words {MAX_BAD_WORDS} words")
        if not all(self.bad_words_token_ids):        # each id is checked (_token_ids)
            raise InvalidRequestError("bad_words_token_ids must be non-empty lists of token "
                                      "ids >= 0")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES or \
                any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} "
                                      f"token ids >= 0, each with a bias in [-{MAX_LOGIT_BIAS:g}, "
                                      f"{MAX_LOGIT_BIAS:g}]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens="
                                      f"{self.max_tokens}], got {self.min_tokens!r}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise InvalidRequestError(f"{name} must be in [0, 20], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                          f"got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", structured_pair(self.structured_outputs))
            if self.ignore_eos or self.min_tokens:
                # a finished grammar allows only EOS: neither could be honoured
                raise InvalidRequestError("structured outputs end where the grammar does: not "
                                          "with ignore_eos or min_tokens")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                      f"got {self.repetition_penalty!r}")

    def _check_types(self) -> None:
        """Numbers of the right kind, so that a bad value from any caller (an offline input
        file, a test) is a clear error here rather than a crash in the sampler mid-batch."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL_FIELDS) and \
                    (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                    not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise InvalidRequestError(f"seed must be {INT64_TEXT}, got {self.seed}")
        for name in ("ignore_eos", "max_tokens_default"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, "
                                          f"got {getattr(self, name)!r}")

    def fit_context(self, num_prompt: int, max_model_len: int) -> "SamplingParams":
        """These params for a prompt of `num_prompt` tokens in a context of `max_model_len`
        (a scheduler's): a default max_tokens cut to the rest of it; an asked-for one that
        does not fit is refused (InvalidRequestError, one line naming both): past the context
        the answer was cut short with "length" without a word (vLLM's server refuses it)."""
        room = max_model_len - num_prompt
        if self.max_tokens <= room or room < 1:      # a prompt that fills it: refused apart
            return self
        if self.max_tokens_default:
            return replace(self, max_tokens=room, min_tokens=min(self.min_tokens, room))
        raise InvalidRequestError(
            f"prompt {num_prompt} + max_tokens {self.max_tokens} = {num_prompt + self.max_tokens}"
            f" tokens, more than this scheduler's --max-model-len {max_model_len}: give the "
            "gateway and every scheduler the same --max-model-len")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits first (a bias, a penalty, a set
        of allowed ids, bad words)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or
                    self.repetition_penalty != 1.0 or self.allowed_token_ids or
                    self.bad_words_token_ids)

    def suppressed(self, output_index: int, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
        """The ids the sampler must not draw as output token `output_index` (0-based): before
        min_tokens, every id that would end the request."""
        if output_index >= self.min_tokens:
            return ()
        return self.stop_token_ids + (() if self.ignore_eos else tuple(sorted(eos_token_ids)))

    @property
    def greedy(self) -> bool:
        # a temperature this small is greedy in all but name; dividing by it overflows
        return self.temperature < _GREEDY_BELOW or self.top_k == 1

    def stops_on(self, token_id: int, eos_token_ids: frozenset[int]) -> bool:
        """Whether sampling `token_id` ends the request by itself (a stop token, or EOS unless
        ignored). The scheduler applies it with the length limits (`stop_status`); a worker
        applies it alone, to skip the rows a plan made ahead gave a request that had already
        stopped (docs/design.md#overlap)."""
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_token_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        d["allowed_token_ids"] = list(self.allowed_token_ids)
        d["bad_words_token_ids"] = [list(seq) for seq in self.bad_words_token_ids]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _token_ids(name: str, ids) -> tuple[int, ...]:
    """A list of token ids from any caller (a line of an offline prompts file too): integers
    >= 0, so that 1.7 or true is refused by name rather than read as token 1."""
    if not isinstance(ids, (list, tuple)) or not all(map(_is_token_id, ids)):
        raise InvalidRequestError(f"{name} must be a list of token ids (integers >= 0), "
                                  f"got {ids!r:.100}")
    return tuple(ids)


def token_id_key(key: str) -> int | None:
    """The token id a JSON object's key names (logit_bias'), or None: ASCII digits only ("7",
    "07"). int() reads " 7", "+7", "-0", "1_0" and a full-width or Arabic-Indic 7 as numbers
    too: a bias on a token the client may not have meant."""
    if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
        return None
    return int(key)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"id": bias} (offline input) or (id, bias) pairs, sorted by id; the bias a
    number (its range is checked by the caller)."""
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    try:
        pairs = [(token_id_key(t) if isinstance(t, str) else t, b) for t, b in pairs]
    except (TypeError, ValueError):             # not pairs
        pairs = [(None, None)]
    if not all(_is_token_id(t) and isinstance(b, (int, float)) and not isinstance(b, bool)
               for t, b in pairs):
        raise InvalidRequestError(f'logit_bias must map token ids to numbers ({{"id": bias}} '
                                  f'or [[id, bias], ...]), got {bias!r:.100}')
    pairs = sorted((t, float(b)) for t, b in pairs)
    twice = next((t for (t, _), (u, _) in zip(pairs, pairs[1:]) if t == u), None)
    if twice is not None:               # the biases would add up, past their bounds
        raise InvalidRequestError(f"logit_bias names token {twice} twice")
    return tuple(pairs)


def token_id_set(ids: Iterable[int] | int | None) -> frozenset[int]:
    """EOS ids as a set, from a model config's tuple, a single id, or None."""
    if ids is None:
        return frozenset()
    if isinstance(ids, int):
        return frozenset((ids,))
    return frozenset(int(i) for i in ids)
