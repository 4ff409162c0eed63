"""The model's tokenizer as a `tokenizers.Tokenizer`, plus its special tokens and chat template.

HF directories ship a tokenizer.json; a GGUF ships vocabulary, merges and token types as
metadata, from which we rebuild the same byte-level BPE (see `_gguf_pre_tokenizer` for how
the pre-tokenizer is chosen). No transformers at runtime: it takes seconds to import.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

from gguf import GGUFReader
from tokenizers import (AddedToken, Regex, decoders, models, normalizers, pre_tokenizers,
                        processors)
from tokenizers import Tokenizer as _Backend

from shared.chat_template import check_chat_template, render_chat_template
from shared.errors import InvalidRequestError, ModelLoadError
from shared.model_config import (eos_token_ids, gguf_token_id, gguf_value, load_model_config,
                                 open_gguf, read_json_object, read_text,
                                 special_token_text)
from shared.model_source import ModelSource

_CONTROL, _USER_DEFINED = 3, 4     # llama.cpp token types
_REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is written as one printable character,
    the printable Latin-1 bytes as themselves and the rest as 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL_DECODER = _byte_level_decoder()


class Tokenizer:
    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._eos_token_ids = () if eos_token_id is None else (eos_token_id,)
        self.chat_template = chat_template

    def add_eos_token_ids(self, ids: tuple[int, ...]) -> None:
        """More ids that end generation (end-of-turn ids, generation_config.json's list)."""
        self._eos_token_ids = tuple(dict.fromkeys(self._eos_token_ids + tuple(ids)))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (eos, and end-of-turn ids the model declares)."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int, text: str | None = None) -> bytes:
        """The bytes a token stands for, also where it is part of a character (what OpenAI's
        logprobs `bytes` carry, so that a client can join them into the text): its text, or
        for a token whose text alone is not whole UTF-8, the bytes under its vocabulary entry
        (a byte-level BPE entry, or a byte-fallback `<0xNN>`). `text`: the token's own text,
        where the caller decoded it already."""
        if text is None:
            text = self.token_text(token_id)
        if _REPLACEMENT not in text:
            return text.encode("utf-8")
        entry = self.id_to_token(token_id) or ""
        if (m := _BYTE_FALLBACK.fullmatch(entry)) is not None:
            return bytes([int(m.group(1), 16)])
        if entry and all(c in _BYTE_LEVEL_DECODER for c in entry):
            return bytes(_BYTE_LEVEL_DECODER[c] for c in entry)
        return text.encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """A token's text as it stands inside a text (logprobs' `token`), special tokens
        written out. Decoded alone, a SentencePiece token loses its leading space (its decoder
        strips the one a sequence starts with: "▁Hello" is "Hello"), so it is decoded after
        itself and the second copy's text taken: " Hello"."""
        once = self.decode([token_id], skip_special_tokens=False)
        return self.decode([token_id, token_id], skip_special_tokens=False)[len(once):]

    @functools.cached_property
    def most_chars_per_token(self) -> int:
        """The longest vocabulary entry's length: no token covers more characters of a text
        (a byte-level or byte-fallback entry is at least as long as its text), so a text of n
        characters is at least n / this many tokens, whatever it says."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) are always recognised;
        add_special_tokens adds what the model's post-processor adds (BOS, if the model asks).
        The batch call lets go of the GIL while it works (a megabyte of text takes ~0.5 s, in
        which a server's event loop must go on) and skips the offsets nothing here uses."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            continue_final_message: bool = False) -> str:
        """`tools`: OpenAI's function definitions, for a template that shows them;
        `continue_final_message`: the last message left open, for the model to go on with."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        return render_chat_template(
            self.chat_template, messages, bos_token=self._token_text(self._bos_token_id),
            eos_token=self._token_text(self._eos_token_id),
            add_generation_prompt=add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        # the template writes every special token itself (transformers does the same)
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools,
                                                    continue_final_message),
                           add_special_tokens=False)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.id_to_token(token_id) or "")


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.kind == "gguf":    # the model's vocabulary is this token list: they always fit
        tokenizer = _from_gguf(source.path)
    else:
        tokenizer = _from_hf_dir(source.path)
        _check_fits_model(tokenizer, source)
    if tokenizer.chat_template is not None:
        check_chat_template(tokenizer.chat_template, source.path)
    tokenizer.add_eos_token_ids(eos_token_ids(source))
    return tokenizer


def _check_fits_model(tokenizer: Tokenizer, source: ModelSource) -> None:
    """A tokenizer with more tokens than the model's embedding has rows makes ids the model
    cannot look up (a forward fails on the first prompt that holds one), so it is refused here
    as vLLM does. The model having more rows than the tokenizer has tokens is common (padded
    to a multiple of 64, say) and fine."""
    vocab_size = load_model_config(source).vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ModelLoadError(f"{source.path}: the tokenizer has {tokenizer.vocab_size} tokens, "
                             f"more than the model's vocab_size of {vocab_size}: it is not "
                             f"this model's tokenizer")


# ---- HF directory -------------------------------------------------------------------------

def _from_hf_dir(path: str) -> Tokenizer:
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ModelLoadError(f"model directory {path}: has no tokenizer.json")
    try:
        backend = _Backend.from_file(file)
    except Exception as e:  # the Rust side raises plain Exception on a malformed file
        raise ModelLoadError(f"{file}: cannot load it: {e}") from e
    config_file = os.path.join(path, "tokenizer_config.json")
    cfg = read_json_object(config_file) if os.path.isfile(config_file) else {}
    return Tokenizer(backend, bos_token_id=_special_id(backend, cfg.get("bos_token")),
                     eos_token_id=_special_id(backend, cfg.get("eos_token")),
                     chat_template=_hf_chat_template(path, cfg))


def _special_id(backend: _Backend, token: Any) -> int | None:
    text = special_token_text(token)
    return None if text is None else backend.token_to_id(text)


def _hf_chat_template(path: str, cfg: dict) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")   # where transformers >= 4.43 saves it
    if os.path.isfile(jinja_file):
        return read_text(jinja_file)
    template = cfg.get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": "default", "template": ...}]
        if not all(isinstance(t, dict) for t in template):
            raise ModelLoadError(f"{path}: tokenizer_config.json's chat_template is a list of "
                                 f"something other than {{name, template}} objects: "
                                 f"{template!r:.80}")
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


# ---- GGUF ---------------------------------------------------------------------------------

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) whose splitting we reproduce.
# "smollm" and the others in its llama.cpp group first isolate every number code point
# (regex \p{N}), then apply the GPT-2 regex: exactly SmolLM2's tokenizer.json, which is
# Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2 = {"gpt-2"}
# Llama 3's (tiktoken's cl100k-style) split, then bytes to the byte-level alphabet: Llama 3's
# tokenizer.json, Sequence[Split(this regex, isolated), ByteLevel(use_regex=False)]. Numbers
# go in runs of up to three digits, contractions case-insensitively.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = {"llama-bpe", "llama3", "llama-v3"}
# Qwen2's: the same but for numbers, one digit at a time (its tokenizer.json's Split)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_THEN_BYTES = {**{pre: _LLAMA3_SPLIT for pre in _LLAMA3}, "qwen2": _QWEN2_SPLIT}


def _gguf_pre_tokenizer(pre: str, path: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    if pre in _SPLIT_THEN_BYTES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_THEN_BYTES[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ModelLoadError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(sorted(_DIGITS_THEN_GPT2 | _GPT2 | set(_SPLIT_THEN_BYTES)))})")


def _from_gguf(path: str) -> Tokenizer:
    reader = open_gguf(path)
    kind = gguf_value(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(f"{path}: GGUF tokenizer model {kind!r} is not supported "
                             "(only 'gpt2', byte-level BPE, and 'llama', SentencePiece BPE)")
    backend = _gguf_backend(reader, path, kind)
    return Tokenizer(backend, bos_token_id=gguf_token_id(reader, "bos_token_id", path),
                     eos_token_id=gguf_token_id(reader, "eos_token_id", path),
                     chat_template=gguf_value(reader, "tokenizer.chat_template"))


def _gguf_backend(reader: GGUFReader, path: str, kind: str) -> _Backend:
    tokens = gguf_value(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelLoadError(f"{path}: the GGUF has no token list (tokenizer.ggml.tokens): "
                             "it holds no tokenizer to serve it with")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{path}: the GGUF token list spells some tokens twice")
    if kind == "llama":
        backend = _sentencepiece_backend(vocab, gguf_value(reader, "tokenizer.ggml.scores"), path)
    else:
        merges = gguf_value(reader, "tokenizer.ggml.merges")
        if not isinstance(merges, list):    # each byte its own token: text the model never saw
            raise ModelLoadError(f"{path}: a byte-level BPE GGUF without its merges "
                                 "(tokenizer.ggml.merges)")
        bad = next((m for m in merges if not isinstance(m, str) or " " not in m), None)
        if bad is not None:
            raise ModelLoadError(f"{path}: tokenizer.ggml.merges holds {bad!r:.40}, not two "
                                 "tokens split by a space")
        merges = [tuple(m.split(" ", 1)) for m in merges]
        backend = _Backend(models.BPE(vocab=vocab, merges=merges))
        pre = gguf_value(reader, "tokenizer.ggml.pre", "gpt-2")
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre, path)
        if pre == "qwen2":          # Qwen2's tokenizer.json composes the text (NFC) first
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
    # Added tokens are matched whole in the text before BPE runs; their ids are their vocab ids.
    types = gguf_value(reader, "tokenizer.ggml.token_type", [])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    # llama.cpp gives a SentencePiece vocabulary BOS unless the file says otherwise
    backend.post_processor = _gguf_post_processor(reader, tokens, add_bos=kind == "llama")
    return backend


def _sentencepiece_backend(vocab: dict[str, int], scores: list[float] | None,
                           path: str) -> _Backend:
    """A SentencePiece vocabulary (Llama 2's, Mistral's, TinyLlama's GGUF) as the BPE that
    transformers' LlamaTokenizer builds from it: `▁` for a space, one prepended to the text,
    bytes (`<0x0A>`) for what no piece covers. A GGUF lists pieces and scores, no merges; each
    piece's merges are its splits into two pieces, the best-scored piece's first."""
    if scores is None or len(scores) != len(vocab):
        raise ModelLoadError(f"{path}: a SentencePiece GGUF without one score per token")
    found = []
    for piece, score in zip(vocab, scores):
        splits = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        found.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    backend = _Backend(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in found],
                                  fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return backend


def _gguf_post_processor(reader: GGUFReader, tokens: list[str],
                         add_bos: bool) -> processors.PostProcessor:
    """BOS/EOS added by encode(add_special_tokens=True), as far as the file asks for them;
    `add_bos` where it does not say."""
    def flagged(role: str) -> list[tuple[str, int]]:
        token_id = gguf_value(reader, f"tokenizer.ggml.{role}_token_id")
        wanted = gguf_value(reader, f"tokenizer.ggml.add_{role}_token",
                            add_bos and role == "bos")
        return [(tokens[token_id], token_id)] if wanted and token_id is not None else []

    bos, eos = flagged("bos"), flagged("eos")
    single = [t for t, _ in bos] + ["$A"] + [t for t, _ in eos]
    return processors.TemplateProcessing(single=single, special_tokens=list(dict(bos + eos).items()))
