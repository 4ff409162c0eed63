"""The gateway's OpenAPI 3.0 description, served at /openapi.json.

Written by hand to match what `openai_schema.py` accepts, field for field and bound for bound,
so that a fuzzer generating "valid" requests from it gets 2xx answers and one generating
invalid ones gets 4xx: never a 5xx and never a hung request. Model-dependent bounds (the
served name, the context length, the vocabulary) come from the running server.
"""
from __future__ import annotations

from typing import Any

from gateway.openai_schema import (CHAT_ROLES, INT_BOUND, MAX_CHOICES, MAX_LOGPROBS,
                                   MAX_BAD_WORD_CHARS, MAX_REQUEST_ID_CHARS, MAX_STOP_CHARS,
                                   MAX_STOP_STRINGS,
                                   MAX_TIMEOUT_S, REQUEST_ID_HEADER)
from shared.sampling import (MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                             MAX_TOKEN_IDS)

_INT64 = {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND - 1}
_STOP = {"oneOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "maxLength": MAX_STOP_CHARS}}]}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": "string", "nullable": True},
                   "code": {"type": "string", "nullable": True}}}}}


def _sampling_fields(max_model_len: int, vocab_size: int) -> dict[str, Any]:
    """The fields both generation endpoints share (see `openai_schema._common`)."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    return {
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1,
                       "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                  "nullable": True},
        "top_k": {"type": "integer", "minimum": -1, "maximum": vocab_size, "nullable": True},
        "seed": {**_INT64, "nullable": True},         # any int64, as vLLM takes
        "presence_penalty": {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY,
                             "nullable": True},
        "frequency_penalty": {"type": "number", "minimum": -MAX_PENALTY,
                              "maximum": MAX_PENALTY, "nullable": True},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                               "maximum": MAX_REPETITION_PENALTY, "nullable": True,
                               "description": "vLLM's extension: a logit of a token in the "
                                              "prompt or the output is divided by it (if "
                                              "positive) or multiplied (if negative)"},
        "logit_bias": {"type": "object", "nullable": True, "maxProperties": 16,
                       # ids with fewer digits than the vocabulary's size: all inside it
                       "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,%d})$"
                                         % max(0, len(str(vocab_size)) - 2)},
                       "additionalProperties": {"type": "number",
                                                "minimum": -MAX_LOGIT_BIAS,
                                                "maximum": MAX_LOGIT_BIAS},
                       "description": "token id (a string) -> bias added to its logit; "
                                      "ids past the vocabulary are refused"},
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": max_model_len - 1,
                       "nullable": True,
                       "description": "vLLM's extension: no EOS, stop token or stop string "
                                      "before this many tokens; at most max_tokens"},
        "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                            "nullable": True,
                            "description": "vLLM's extension: the prompt's log-probabilities "
                                           "(with the top N) in the answer; not with stream"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True,
                  "description": "vLLM's extension: tokens less likely than min_p times the "
                                 "most likely one are not drawn"},
        "stop": {**_STOP, "nullable": True},
        "stop_token_ids": {"type": "array", "items": token_id, "nullable": True,
                           "maxItems": MAX_TOKEN_IDS},
        "allowed_token_ids": {"type": "array", "items": token_id, "nullable": True,
                              "minItems": 1, "maxItems": MAX_TOKEN_IDS,
                              "description": "vLLM's: only these ids may be drawn"},
        "bad_words": {"type": "array", "nullable": True, "maxItems": MAX_BAD_WORDS,
                      "items": {"type": "string", "pattern": "\\S",
                                "maxLength": MAX_BAD_WORD_CHARS},
                      "description": "vLLM's: words the output never completes"},
        "include_stop_str_in_output": {"type": "boolean", "nullable": True,
                                       "description": "vLLM's: the text ends with the stop "
                                                      "string, not before it"},
        "truncate_prompt_tokens": {"type": "integer", "minimum": -1, "nullable": True,
                                   "description": "vLLM's: only the prompt's last N tokens "
                                                  "(-1: the model's context)"},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "skip_special_tokens": {"type": "boolean", "nullable": True,
                                "description": "vLLM's: special tokens left out of the text "
                                               "(the default) or written in it"},
        "return_tokens_as_token_ids": {"type": "boolean", "nullable": True,
                                       "description": "vLLM's: logprobs name each token "
                                                      "\"token_id:N\", not by its text"},
        "add_special_tokens": {"type": "boolean", "nullable": True,
                               "description": "vLLM's: the tokenizer's special tokens (a BOS) "
                                              "before the prompt; completions true, chat "
                                              "false (its template writes its own)"},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "nullable": True,
              "description": f"choices per prompt; at most {MAX_CHOICES} over all prompts"},
        # accepted only at the values that change nothing (openai_schema refuses the rest)
        "best_of": {"type": "integer", "enum": [1], "nullable": True,
                    "description": "equal to n, or absent: no ranking of candidates here"},
        "response_format": {"type": "object", "nullable": True, "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"},
                "strict": {"type": "boolean", "nullable": True}}}}},
        "structured_outputs": {
            "type": "object", "nullable": True, "minProperties": 1,
            "description": "vLLM's: what the output must match, one of a JSON schema, a "
                           "regular expression, a list of choices, a Lark or GBNF grammar",
            "properties": {"json": {"oneOf": [{"type": "object"}, {"type": "string"}]},
                           "regex": {"type": "string"}, "grammar": {"type": "string"},
                           "choice": {"type": "array", "minItems": 1,
                                      "items": {"type": "string", "minLength": 1}},
                           "json_object": {"type": "boolean"},
                           "disable_any_whitespace": {"type": "boolean"},
                           "disable_additional_properties": {"type": "boolean"},
                           "whitespace_pattern": {"type": "string"}}},
        # vLLM's older spellings of structured_outputs' kinds and its whitespace_pattern
        "guided_json": {"oneOf": [{"type": "object"}, {"type": "string"}], "nullable": True},
        "guided_regex": {"type": "string", "nullable": True},
        "guided_choice": {"type": "array", "minItems": 1, "nullable": True,
                          "items": {"type": "string", "minLength": 1}},
        "guided_grammar": {"type": "string", "nullable": True},
        "guided_whitespace_pattern": {"type": "string", "nullable": True},
        "functions": {"type": "array", "maxItems": 0, "nullable": True},
        "suffix": {"type": "string", "maxLength": 0, "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean"},
                                          "continuous_usage_stats": {"type": "boolean"}}},
        "timeout": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                    "maximum": MAX_TIMEOUT_S, "nullable": True,
                    "description": "pacer's extension: seconds before the request is ended "
                                   "with a timeout_error"},
    }


def _completion_request(model: str, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    ids = {"type": "array", "minItems": 1,
           "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    return {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": {"type": "string", "enum": [model]},
        "prompt": {"oneOf": [
            {"type": "string"}, ids,
            {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string"}},
            {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": ids}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS, "nullable": True},
        "echo": {"type": "boolean", "nullable": True,
                 "description": "the prompt before the output; with logprobs, its tokens' "
                                "too (the first has none); with max_tokens 0, the prompt alone"},
        **_sampling_fields(max_model_len, vocab_size),
        "max_tokens": {"type": "integer", "minimum": 0, "maximum": max_model_len - 1,
                       "nullable": True, "description": "0 only with echo"}}}


def _chat_request(model: str, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]},
                           "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}],
                    "nullable": True}}}
    return {"type": "object", "required": ["model", "messages"], "properties": {
        "model": {"type": "string", "enum": [model]},
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1,
                                  "nullable": True},
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                         "nullable": True},
        **CHAT_FORMAT_FIELDS, **CHAT_TOOL_FIELDS,
        **_sampling_fields(max_model_len, vocab_size)}}


# chat's function tools; /v1/responses takes the same choices with its flatter tool shape
CHAT_TOOL_FIELDS = {
    "tools": {"type": "array", "nullable": True, "items": {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"}}}}}},
    "tool_choice": {
        "nullable": True,
        "description": "'required' or a named function: calls made by constrained "
                       "decoding; 'auto' needs the server's --tool-call-parser",
        "oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                  {"type": "object", "required": ["type", "function"], "properties": {
                      "type": {"type": "string", "enum": ["function"]},
                      "function": {"type": "object", "required": ["name"],
                                   "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": "boolean", "nullable": True},
}

# vLLM's: how the chat template ends the prompt; not both true
CHAT_FORMAT_FIELDS = {
    "add_generation_prompt": {"type": "boolean", "nullable": True,
                              "description": "the template opens the answer's turn (default)"},
    "continue_final_message": {"type": "boolean", "nullable": True,
                               "description": "the final message is left open and the answer "
                                              "goes on with it; needs add_generation_prompt "
                                              "false"}}


def _responses_request(model: str, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["input_text", "output_text"]},
                           "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["user", "system", "developer", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}}}
    fmt = {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "name": {"type": "string"}, "schema": {"type": "object"}}}
    sampling = _sampling_fields(max_model_len, vocab_size)
    for name in ("max_tokens", "n", "best_of", "logprobs", "stream_options", "response_format",
                 "prompt_logprobs", "functions", "suffix"):
        sampling.pop(name, None)       # chat's spellings, or not taken here
    return {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string", "enum": [model]},
        "input": {"oneOf": [{"type": "string"},
                            {"type": "array", "minItems": 1, "items": message}]},
        "instructions": {"type": "string", "nullable": True},
        "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1,
                              "nullable": True},
        "text": {"type": "object", "properties": {"format": fmt}},
        "store": {"type": "boolean"},
        "truncation": {"type": "string", "enum": ["disabled", "auto"]},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        "include": {"type": "array",
                    "items": {"type": "string", "enum": ["message.output_text.logprobs"]}},
        "tools": {"type": "array", "items": {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "parameters": {"type": "object"}}}},
        "tool_choice": {"oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "name"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "name": {"type": "string"}}}]},
        "parallel_tool_calls": {"type": "boolean"},
        **CHAT_FORMAT_FIELDS,
        **sampling}}


def _tokenize_request(model: str, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    """A prompt, or chat messages (with any tools) as generation renders them."""
    chat = _chat_request(model, max_model_len, vocab_size)["properties"]
    return {"type": "object", "properties": {
        "model": {"type": "string", "enum": [model], "nullable": True},
        "prompt": {"type": "string"},
        "messages": chat["messages"], "tools": CHAT_TOOL_FIELDS["tools"],
        **CHAT_FORMAT_FIELDS,
        "add_special_tokens": {"type": "boolean", "nullable": True},
        "return_token_strs": {"type": "boolean", "nullable": True,
                              "description": "vLLM's: each token's vocabulary entry too"}},
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}


def _detokenize_request(model: str, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    return {"type": "object", "required": ["tokens"], "properties": {
        "model": {"type": "string", "enum": [model], "nullable": True},
        "tokens": {"type": "array", "maxItems": max_model_len, "items": {
            "type": "integer", "minimum": 0, "maximum": vocab_size - 1}}}}


def _post(summary: str, schema_ref: str, responses: dict[str, Any], **more) -> dict[str, Any]:
    return {"post": {"summary": summary, **more,
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": schema_ref}}}},
                     "responses": responses}}


def _errors(*pairs: tuple[int, str]) -> dict[str, Any]:
    return {str(s): {"description": d, "content": {"application/json": {"schema": _ERROR}}}
            for s, d in pairs}


def _tokenizer_path(summary: str, schema_ref: str) -> dict[str, Any]:
    return _post(summary, schema_ref, {"200": {"description": summary},
                                       **_errors((400, "invalid request"),
                                                 (404, "unknown model"))})


def _generation_path(summary: str, schema_ref: str) -> dict[str, Any]:
    request_id = {"name": REQUEST_ID_HEADER, "in": "header", "required": False,
                  "description": "the client's id for the request: logged, sent back",
                  "schema": {"type": "string", "minLength": 1,
                             "maxLength": MAX_REQUEST_ID_CHARS, "pattern": "^[ -~]+$"}}
    ok = {"description": "the completion, or an SSE stream with \"stream\": true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return _post(summary, schema_ref, {"200": ok, **_errors(
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
        (408, "the request's deadline passed"), (413, "body too large"),
        (429, "queue full; see Retry-After"),
        (503, "shutting down, Redis unreachable (see Retry-After), or a scheduler of another "
              "protocol version beating"))},
        parameters=[request_id])


def _get(summary: str, statuses: tuple[str, ...] = ("200",)) -> dict[str, Any]:
    return {"get": {"summary": summary,
                    "responses": {s: {"description": summary} for s in statuses}}}


def openapi_spec(model: str, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "pacer", "version": "1",
                 "description": "OpenAI-compatible completions, chat completions and responses"},
        "paths": {
            "/v1/completions": _generation_path("text completion",
                                                "#/components/schemas/CompletionRequest"),
            "/v1/chat/completions": _generation_path(
                "chat completion", "#/components/schemas/ChatCompletionRequest"),
            "/v1/responses": _generation_path(
                "a response (OpenAI's Responses API: text in and out, nothing stored)",
                "#/components/schemas/ResponsesRequest"),
            "/v1/models": _get("the served model"),
            "/v1/models/{model}": {"get": {
                "summary": "the served model's entry, or a 404",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model"},
                              "404": {"description": "no such model"}}}},
            "/version": _get("this server's version (vLLM's)"),
            "/tokenize": _tokenizer_path("a prompt's token ids (vLLM's)",
                                         "#/components/schemas/TokenizeRequest"),
            "/detokenize": _tokenizer_path("token ids' text (vLLM's)",
                                           "#/components/schemas/DetokenizeRequest"),
            "/health": _get("200 while a scheduler and every worker rank are alive",
                            ("200", "503")),
            "/openapi.json": _get("this description"),
        },
        "components": {"schemas": {
            "CompletionRequest": _completion_request(model, max_model_len, vocab_size),
            "ChatCompletionRequest": _chat_request(model, max_model_len, vocab_size),
            "ResponsesRequest": _responses_request(model, max_model_len, vocab_size),
            "TokenizeRequest": _tokenize_request(model, max_model_len, vocab_size),
            "DetokenizeRequest": _detokenize_request(model, max_model_len, vocab_size),
        }},
    }
