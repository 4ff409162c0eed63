"""`pacer generate`: offline batch generation from a JSONL file with the in-process engine."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from shared.config import DEFAULT_OFFLINE_MAX_NUM_BATCHED_TOKENS
from shared.engine_args import EngineArgs
from shared.errors import InvalidRequestError, PacerError
from shared.json_file import check_output_path, parse_user_json
from shared.detokenizer import IncrementalDetokenizer
from shared.sampling import SamplingParams
from shared.text_output import TextOutput

if TYPE_CHECKING:
    from services.engine import Completion

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                        if f.name not in SamplingParams.INTERNAL_FIELDS)
INPUT_FIELDS = ("prompt", "messages", "prompt_token_ids", "stop")


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for a JSONL file of prompts")
    EngineArgs.add_cli_args(p, budget=DEFAULT_OFFLINE_MAX_NUM_BATCHED_TOKENS, target_tbt="off")
    p.add_argument("--prompts", required=True, help="input JSONL: {prompt|messages|prompt_token_ids}")
    p.add_argument("--output", required=True, help="output JSONL, one line per input line")
    # each a default for the lines that do not give their own
    p.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate, for lines without max_tokens (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="for lines without temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="for lines without top_p (default 1.0: all)")
    p.add_argument("--top-k", type=int, default=0,
                   help="for lines without top_k (default 0: all)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="for lines without ignore_eos: go on past EOS to max_tokens")
    p.set_defaults(run=run)


def read_prompts(path: str, tokenizer, defaults: dict, max_model_len: int
                 ) -> tuple[list[list[int]], list[SamplingParams], list[tuple[str, ...]]]:
    """Parse the prompts file: each line's prompt, sampling and stop strings; any bad line
    raises PacerError naming the file and line, before anything runs."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise PacerError(f"cannot read prompts file {path}: {e}") from None
    if not lines:
        raise PacerError(f"prompts file {path} has no prompts")
    prompts, params, stops = [], [], []
    for n, line in lines:
        where = f"{path} line {n}"
        try:
            item = parse_user_json(line)
        except InvalidRequestError as e:
            raise PacerError(f"{where} {e}") from None
        try:
            prompts.append(_tokens_of(item, tokenizer))
            if len(prompts[-1]) >= max_model_len:
                raise InvalidRequestError(f"the prompt has {len(prompts[-1])} tokens, but the "
                                          f"model's context is {max_model_len}")
            unknown = sorted(set(item) - set(SAMPLING_FIELDS) - set(INPUT_FIELDS))
            if unknown:     # a field read by nobody would be an answer that ignores it
                raise InvalidRequestError(
                    f"unknown field {unknown[0]!r} (a line takes {', '.join(INPUT_FIELDS)}"
                    f" and SamplingParams' fields: {', '.join(SAMPLING_FIELDS)})")
            stops.append(_stop_strings(item.get("stop", [])))
            fields = {k: item[k] for k in SAMPLING_FIELDS if k in item}
            params.append(SamplingParams(**{**defaults, **fields}))
            p = params[-1]
            for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]),
                              ("allowed_token_ids", p.allowed_token_ids),
                              ("bad_words_token_ids", [t for w in p.bad_words_token_ids for t in w]),
                              ("stop_token_ids", p.stop_token_ids)):
                if any(t >= tokenizer.vocab_size for t in ids):
                    raise InvalidRequestError(f"{name}: token ids must be < {tokenizer.vocab_size}")
        except (InvalidRequestError, TypeError, ValueError) as e:
            raise PacerError(f"{where}: {e}") from None
    return prompts, params, stops


def _stop_strings(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError("stop must be a string or a list of strings")
    return tuple(s for s in stops if s)


def _tokens_of(item, tokenizer) -> list[int]:
    if not isinstance(item, dict):
        raise InvalidRequestError("each line must be a JSON object")
    if len({"prompt", "messages", "prompt_token_ids"} & set(item)) > 1:
        raise InvalidRequestError("give one of 'prompt', 'messages' or 'prompt_token_ids'")
    if "prompt_token_ids" in item:
        ids = item["prompt_token_ids"]
        if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < tokenizer.vocab_size for t in ids)):
            raise InvalidRequestError(f"prompt_token_ids must be a non-empty list of token ids < {tokenizer.vocab_size}")
        return ids
    if "messages" in item:
        return tokenizer.encode_chat(item["messages"])
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise InvalidRequestError("prompt must be a non-empty string")
        return tokenizer.encode(item["prompt"])
    raise InvalidRequestError("needs one of 'prompt', 'messages' or 'prompt_token_ids'")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from services.engine import LLMEngine
    from shared.engine_layout import engine_layout
    from shared.tokenizer import load_tokenizer

    # a bad prompts file, or an output that cannot be written, is refused before the weights load
    check_output_path(args.output, "--output")
    if os.path.exists(args.output) and os.path.exists(args.prompts) and \
            os.path.samefile(args.output, args.prompts):
        # the results would replace the prompts they came from
        raise PacerError(f"--output {args.output} is the prompts file: name another file")
    layout = engine_layout(EngineArgs.from_cli(args))
    tokenizer = load_tokenizer(layout.source)
    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, ignore_eos=args.ignore_eos)
    for name, value in defaults.items():   # a bad flag is the flag's fault, not the file's
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as e:
            raise PacerError(f"--{name.replace('_', '-')}: {e}") from None
    prompts, params, stops = read_prompts(args.prompts, tokenizer, defaults, layout.max_model_len)
    engine = LLMEngine(layout, tokenizer=tokenizer)
    bar = tqdm(total=len(prompts), desc="generate", unit="req", file=sys.stderr)
    counted = [0]
    start = time.perf_counter()

    # each output's text as the gateway makes it (keyed by the ids engine.generate gives: the
    # input's index): decoded after its prompt, so that it keeps the space a SentencePiece
    # decoder drops at the start of a sequence; ended before the first stop string, the
    # request there
    eos = frozenset(engine.tokenizer.eos_token_ids)
    texts = {str(i): TextOutput(IncrementalDetokenizer(engine.tokenizer, ids), stop, p.min_tokens,
                                ends=functools.partial(p.stops_on, eos_token_ids=eos))
             for i, (ids, p, stop) in enumerate(zip(prompts, params, stops))}

    # the requests that ended (a stop string ends one here, then the engine again), by id
    ended: dict[str, Completion] = {}

    def progress(out, completion):
        counted[0] += len(out.new_tokens)
        text, over = texts[out.request_id], out.finished
        if not text.stopped:
            for token in out.new_tokens:
                text.add(token.token_id)
            if out.finished:
                text.finish()
            elif text.stopped:
                engine.abort(out.request_id)
                over = True
        if over and out.request_id not in ended:
            ended[out.request_id] = completion
            bar.update(1)
            bar.set_postfix(tok_s=f"{counted[0] / (time.perf_counter() - start):.1f}")

    try:
        results = engine.generate(prompts, params, on_output=progress)
    except KeyboardInterrupt:
        # Ctrl-C: the requests that ended are kept, each line with its input's index
        bar.close()
        done = [ended[str(i)] for i in range(len(prompts)) if str(i) in ended]
        _write(args.output, done, texts)
        print(f"pacer generate: interrupted (Ctrl-C): the {len(done)} of {len(prompts)} "
              f"requests that ended are written to {args.output}", file=sys.stderr)
        return 130
    bar.close()
    elapsed = time.perf_counter() - start
    _write(args.output, results, texts)
    n_in = sum(len(p) for p in prompts)
    print(f"{len(results)} requests, {n_in} prompt tokens, {counted[0]} output tokens in "
          f"{elapsed:.2f} s: {counted[0] / elapsed:.1f} output tok/s, "
          f"{(n_in + counted[0]) / elapsed:.1f} total tok/s", file=sys.stderr)
    return 0


def _write(path: str, results: list[Completion], texts: dict[str, TextOutput]) -> None:
    """A line for each result, its index the request id engine.generate gave (the input's)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            for r in results:
                # the text (TextOutput's) leaves out the token that ended the request (EOS, a
                # stop token); a stop string ended it here, the engine saw an abort
                text = texts[r.request_id]
                line = {"index": int(r.request_id), "prompt_tokens": len(r.prompt_token_ids),
                        "token_ids": r.token_ids, "text": text.text,
                        "finish_reason": "stop" if text.stopped else r.finish_reason}
                if r.error is not None:
                    line["error"] = r.error
                if r.tokens and r.tokens[0].logprob is not None:
                    line["logprobs"] = [t.logprob for t in r.tokens]
                    line["top_logprobs"] = [t.top_logprobs for t in r.tokens]
                if r.prompt_logprobs:       # position 0 has none
                    line["prompt_logprobs"] = [None] + [
                        r.prompt_logprobs[p].logprob for p in range(1, len(r.prompt_token_ids))]
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
    except OSError as e:
        raise PacerError(f"cannot write output file {path}: {e}") from None
