"""From a validated request to what the scheduler needs: prompt token ids and SamplingParams."""
from __future__ import annotations

import dataclasses
import functools

from gateway.openai_schema import (APIError, GenerationRequest, TokenizeRequest,
                                   check_prompt_length)
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams, choice_seed
from shared.tokenizer import Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


def prompt_token_ids(req: GenerationRequest, tokenizer: Tokenizer,
                     max_model_len: int) -> list[list[int]]:
    """Each prompt's ids (chat: one, its template rendered first), the last
    `truncate_prompt_tokens` of them if asked (-1: as many as the context holds beside the
    answer, `answer_room`). CPU-bound: run it off the event loop."""
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > max_model_len:
        raise APIError(f"'truncate_prompt_tokens' ({req.truncate_prompt_tokens}) is above the "
                       f"model's context length ({max_model_len}); -1 keeps as much as fits",
                       param="truncate_prompt_tokens")
    if req.endpoint == "chat":
        text = chat_prompt(req, tokenizer)
        # the template writes every special token itself (transformers does the same), unless
        # the request asks for the tokenizer's on top (add_special_tokens, vLLM's)
        prompts = [_nonempty(_text_ids(text, tokenizer, req, max_model_len, "messages"),
                             "messages")]
    else:
        prompts = [_nonempty(_text_ids(p, tokenizer, req, max_model_len, "prompt")
                             if isinstance(p, str) else check_vocabulary(p, tokenizer, "prompt"),
                             "prompt") for p in req.prompts]
    if req.truncate_prompt_tokens == -1:
        return [_fit(ids, req, max_model_len) for ids in prompts]
    keep = req.truncate_prompt_tokens
    return prompts if keep is None else [ids[-keep:] for ids in prompts]


def echo_texts(req: GenerationRequest, prompts: list[list[int]],
               tokenizer: Tokenizer) -> list[str]:
    """What `echo` repeats of each prompt: its text as sent, or the text of its ids (a
    token-id prompt; a truncated one: the tokens kept). CPU-bound (a batch of prompts each
    as long as the context: a body's worth of ids, ~1 s to decode): run it off the event
    loop."""
    return [p if isinstance(p, str) and req.truncate_prompt_tokens is None
            else tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
            for p, ids in zip(req.prompts, prompts)]


def chat_prompt(req: GenerationRequest | TokenizeRequest, tokenizer: Tokenizer) -> str:
    """The chat template's text of a request's messages (with its tools); messages it cannot
    take, or a template that fails on them, are a 400 naming 'messages'."""
    try:
        return tokenizer.apply_chat_template(req.messages, req.add_generation_prompt,
                                             list(req.tools) or None, req.continue_final_message)
    except InvalidRequestError as e:
        raise APIError(str(e), param="messages") from None


def _fit(ids: list[int], req: GenerationRequest, max_model_len: int) -> list[int]:
    """`truncate_prompt_tokens: -1` (the Responses API's `truncation: "auto"`): the prompt's
    end, cut only as far as the answer needs room: its max_tokens (or the completions default).
    A chat without max_tokens whose prompt fits keeps it whole and answers in the rest; one that
    does not fit keeps an eighth of the context for the answer."""
    if req.max_tokens is not None:
        room = req.max_tokens
    elif req.endpoint == "completions":
        room = DEFAULT_COMPLETION_MAX_TOKENS
    elif len(ids) < max_model_len:
        return ids
    else:
        room = max_model_len // 8
    keep = max(max_model_len - max(room, req.min_tokens, 1), 1)
    return ids[-keep:]


def _text_ids(text: str, tokenizer: Tokenizer, req: GenerationRequest, max_model_len: int,
              param: str) -> list[int]:
    """A text's ids; one too long to fit the context whatever it says is refused before it is
    tokenized (a few megabytes would take seconds and gigabytes to find out), or with
    truncate_prompt_tokens only its end is tokenized (twice what could fit: what is kept)."""
    fits = max_model_len * tokenizer.most_chars_per_token
    if len(text) > fits:
        if req.truncate_prompt_tokens is None:
            raise APIError(f"This model's maximum context length is {max_model_len} tokens; "
                           f"{len(text)} characters of {param} are more than that many tokens "
                           f"hold (at most {tokenizer.most_chars_per_token} characters a "
                           f"token)", param=param, code="context_length_exceeded")
        text = text[-2 * fits:]
    return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)


def check_vocabulary(ids: list[int], tokenizer: Tokenizer, param: str) -> list[int]:
    """`ids`, or a 400 naming the first that is not a token of this model."""
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise APIError(f"{param}: token id {bad[0]} is outside the vocabulary "
                       f"[0, {tokenizer.vocab_size})", param=param)
    return ids


def _nonempty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise APIError("the prompt is empty", param=param)
    return ids


def _longer_than_served(length: int, max_model_len: int, what: str, param: str) -> APIError:
    return APIError(f"The schedulers serving this model hold at most {length} tokens (their "
                    f"--max-model-len), fewer than this gateway's {max_model_len}; {what}. "
                    "Give the gateway and every scheduler the same --max-model-len",
                    param=param, code="context_length_exceeded")


def choice_sampling(sampling: SamplingParams, j: int) -> SamplingParams:
    """The j-th of a prompt's n choices: a seeded request gives choice j the seed + j (vLLM's
    rule, kept an int64: `choice_seed`), so that the n samples differ and each can be
    reproduced alone."""
    if j == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=choice_seed(sampling.seed, j))


def sampling_params(req: GenerationRequest, num_prompt_tokens: int, max_model_len: int,
                    tokenizer: Tokenizer, served_len: int | None = None) -> SamplingParams:
    """`served_len`: the context a request can have end to end (GatewayState.
    served_max_model_len: at most `max_model_len`; None: `max_model_len`). Where it is
    shorter (a scheduler started by hand with another --max-model-len) it bounds the
    request: past it, the scheduler cut the answer short with "length" without a word; a
    chat without max_tokens takes the rest of it."""
    param = "messages" if req.endpoint == "chat" else "prompt"
    check_prompt_length(num_prompt_tokens, max_model_len, param)
    length = served_len or max_model_len
    if num_prompt_tokens >= length:
        raise _longer_than_served(length, max_model_len, f"the prompt has {num_prompt_tokens} "
                                  "tokens", param)
    room = length - num_prompt_tokens
    max_tokens = req.max_tokens or (DEFAULT_COMPLETION_MAX_TOKENS if req.endpoint == "completions"
                                    else room)
    if req.min_tokens > max_tokens:
        limit = (f"max_tokens ({max_tokens})" if req.max_tokens else
                 f"the output's limit ({max_tokens}, the default when none is given)")
        raise APIError(f"'min_tokens' ({req.min_tokens}) is above {limit}", param="min_tokens")
    if max_tokens > room:
        what = (f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, "
                f"{num_prompt_tokens + max_tokens} in all")
        if length < max_model_len:
            raise _longer_than_served(length, max_model_len, what, "max_tokens")
        raise APIError(f"This model's maximum context length is {max_model_len} tokens; {what}",
                       param="max_tokens", code="context_length_exceeded")
    check_vocabulary([t for t, _ in req.logit_bias], tokenizer, "logit_bias")
    check_vocabulary(list(req.allowed_token_ids), tokenizer, "allowed_token_ids")
    check_vocabulary(list(req.stop_token_ids), tokenizer, "stop_token_ids")
    # the scheduler stops on the primary EOS itself; other end-of-turn ids are stop tokens
    extra_eos = () if req.ignore_eos else tuple(
        t for t in tokenizer.eos_token_ids if t != tokenizer.eos_token_id)
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed,
                          stop_token_ids=tuple(dict.fromkeys(req.stop_token_ids + extra_eos)),
                          ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                          presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty,
                          logit_bias=req.logit_bias, min_tokens=req.min_tokens, min_p=req.min_p,
                          allowed_token_ids=req.allowed_token_ids,
                          bad_words_token_ids=bad_words_token_ids(req.bad_words, tokenizer),
                          prompt_logprobs=_prompt_logprobs(req),
                          structured_outputs=req.structured_outputs,
                          max_tokens_default=not req.max_tokens and req.endpoint != "completions")


@functools.lru_cache(maxsize=64)
def bad_words_token_ids(words: tuple[str, ...], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it would start the text and as it
    would come after a space (once per word list, whatever the number of prompts)."""
    return tuple(tuple(tokenizer.encode(prefix + w.lstrip())) for w in words
                 for prefix in ("", " "))


def _prompt_logprobs(req: GenerationRequest) -> int | None:
    """How many top prompt log-probabilities the answer needs: echo's with logprobs, vLLM's
    own field's, or none."""
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs)
             if k is not None]
    return max(asked) if asked else None
