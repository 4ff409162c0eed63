"""The tokenizer (GGUF and HF directory), the sandboxed chat template, and incremental
detokenizing, checked against transformers where it is right.

Digits: transformers (5.x) builds a GGUF tokenizer with GPT-2's regex only and ignores
`tokenizer.ggml.pre` ("smollm"). SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-
Instruct) is Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], and
llama.cpp's "smollm" pre-tokenizer isolates every \\p{N} before the GPT-2 regex: the same
thing. They disagree with plain transformers on e.g. "  42" (SmolLM2: "ĠĠ" "4" "2";
transformers: "Ġ" "Ġ" "4" "2") and " ²" (SmolLM2: "Ġ" "Â²"; transformers: "ĠÂ" "²"). So the
reference below is transformers' GGUF tokenizer with SmolLM2's real pre-tokenizer put back.
"""
import os

import pytest
from gguf import GGUFWriter
from tokenizers import pre_tokenizers

from helpers_tiny_model import (CHAT_TEMPLATE, write_sentencepiece_tokenizer, write_tiny_gguf,
                                write_tiny_llama)
from hf_reference import gguf_py_read_faster
from shared.chat_template import render_chat_template, validate_messages
from shared.detokenizer import IncrementalDetokenizer
from shared.errors import InvalidRequestError, ModelLoadError
from shared.model_source import resolve_model
from shared.tokenizer import load_tokenizer

STRINGS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345", "3.14159 and 2,718,281", "  42", " 42 apples", "x² + y² = z²", " ½ cup", "v1.2.3-rc4",
    "def square(x):\n    return x ** 2  # power\n\n\tif x: pass",
    "Hello 👋🏽 world 🚀🔥", "👨‍👩‍👧 family", "日本語のテキストです。", "中文测试，标点符号！",
    "한국어 텍스트", "مرحبا ١٢٣", "naïve café résumé", "   leading and trailing   ",
    "I'm sure they'll've DONE it",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n",
    "a<|im_end|>b<|endoftext|>", "<repo_name>pacer<file_sep>", "",
]


@pytest.fixture(scope="module")
def smol_source(tmp_path_factory):
    source = resolve_model(None)
    # transformers wants a directory and a file name in it
    folder = tmp_path_factory.mktemp("smol")
    os.symlink(source.path, folder / "model.gguf")
    return source, str(folder)


@pytest.fixture(scope="module")
def smol(smol_source):
    return load_tokenizer(smol_source[0])


@pytest.fixture(scope="module")
def reference(smol_source):
    from transformers import AutoTokenizer
    with gguf_py_read_faster():
        ref = AutoTokenizer.from_pretrained(smol_source[1], gguf_file="model.gguf")
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return ref


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny")


# ---- the default model's GGUF tokenizer ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("text", STRINGS)
def test_gguf_tokenizer_matches_smollm2(smol, reference, text):
    ids = smol.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert smol.encode(text, add_special_tokens=True) == reference.encode(text)
    assert smol.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert smol.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_digits_are_split_one_by_one(smol):
    assert [smol.id_to_token(i) for i in smol.encode("12345")] == list("12345")
    assert [smol.id_to_token(i) for i in smol.encode("  42")] == ["ĠĠ", "4", "2"]
    assert [smol.id_to_token(i) for i in smol.encode(" ²")] == ["Ġ", "Â²"]


@pytest.mark.slow
def test_gguf_special_tokens(smol):
    assert (smol.bos_token_id, smol.eos_token_id, smol.eos_token_ids) == (1, 2, (2,))
    assert smol.vocab_size == 49152
    assert smol.id_to_token(1) == "<|im_start|>" and smol.id_to_token(2) == "<|im_end|>"
    assert smol.encode("<|im_start|>user") == [1, smol.encode("user")[0]]
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")   # add_bos_token false
    assert smol.decode([1, *smol.encode("hi"), 2]) == "hi"


@pytest.mark.slow
def test_token_bytes_join_into_the_text(smol):
    """OpenAI's logprobs `bytes`: tokens that each hold part of a character still join into
    its UTF-8 bytes (their text alone is a replacement character)."""
    text = "I love 🎉 and 你好 parties"
    ids = smol.encode(text)
    assert any("\ufffd" in smol.decode([i]) for i in ids)     # some split a character
    assert b"".join(smol.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert smol.token_bytes(2) == b"<|im_end|>"                 # special: its text


def test_sentencepiece_tokens_keep_their_space(tmp_path):
    """A token's own text (logprobs' `token`, and so its `bytes`) is its text inside the
    output: a SentencePiece token keeps the space its decoder strips at a sequence's start,
    so that the tokens join into the text, as the byte-level ones do."""
    tok = load_tokenizer(resolve_model(_write_sentencepiece_gguf(tmp_path / "s.gguf")))
    prompt = tok.encode("Hello the world")
    ids = tok.encode(" I'm sure the 123 and the  in\nthe\tworld")
    assert tok.token_text(ids[2]) == " sure"
    after = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "".join(map(tok.token_text, ids)) == after
    assert b"".join(map(tok.token_bytes, ids)) == after.encode("utf-8")
    assert tok.token_text(2) == "</s>"                  # special: written out


@pytest.mark.slow
def test_gguf_chat_template_matches_transformers(smol, reference):
    for messages in ([{"role": "user", "content": "What is 2+2?"}],
                     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "日本?"}]):
        text = smol.apply_chat_template(messages)
        assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        assert smol.encode_chat(messages) == reference.encode(text, add_special_tokens=False)
    no_prompt = smol.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert no_prompt.endswith("x<|im_end|>\n")


# ---- tiny models: HF directory and GGUF ---------------------------------------------------

def test_hf_dir_tokenizer_matches_transformers(tiny_dir):
    from transformers import AutoTokenizer
    ours, ref = load_tokenizer(resolve_model(tiny_dir)), AutoTokenizer.from_pretrained(tiny_dir)
    for text in STRINGS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    messages = [{"role": "user", "content": "hello there"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ((ours.bos_token_id, ours.eos_token_id, ours.vocab_size)
            == (ref.bos_token_id, ref.eos_token_id, len(ref)))


def test_tiny_gguf_tokenizer_equals_its_hf_dir(tiny_dir, tmp_path):
    hf = load_tokenizer(resolve_model(tiny_dir))
    gguf = load_tokenizer(resolve_model(write_tiny_gguf(tmp_path / "t.gguf", tiny_dir)))
    for text in STRINGS:
        assert gguf.encode(text) == hf.encode(text)
    assert gguf.chat_template == hf.chat_template == CHAT_TEMPLATE


def _converter_tokenizer(tiny_dir: str, pattern: str, nfc: bool):
    """The tiny vocabulary behind the pre-tokenizer (and normalizer) transformers' converter
    gives a model family's tokenizer.json."""
    from tokenizers import Regex, normalizers
    from tokenizers import Tokenizer as Backend
    ref = Backend.from_file(os.path.join(tiny_dir, "tokenizer.json"))
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        ref.normalizer = normalizers.NFC()
    return ref


def _qwen2_pattern() -> str:
    """Qwen2Converter's Split regex, read from its source (it is inline there)."""
    import inspect
    import re

    from transformers.convert_slow_tokenizer import Qwen2Converter
    (pattern,) = re.findall(r'r"""(.*?)"""', inspect.getsource(Qwen2Converter.converted))
    return pattern


@pytest.mark.parametrize("pre,split_12345", [("llama-bpe", ["123", "45"]),
                                             ("qwen2", ["1", "2", "3", "4", "5"])])
def test_gguf_split_pre_tokenizers_are_their_tokenizer_jsons(tiny_dir, tmp_path, pre,
                                                             split_12345):
    """A GGUF of Llama 3 (`tokenizer.ggml.pre` llama-bpe) or Qwen2 splits as that model's
    tokenizer.json does: transformers' converter's regex (tiktoken's for Llama 3; Qwen2's,
    composed to NFC first), then bytes without GPT-2's regex."""
    import inspect

    from transformers.convert_slow_tokenizer import TikTokenConverter
    if pre == "qwen2":
        ref = _converter_tokenizer(tiny_dir, _qwen2_pattern(), nfc=True)
    else:
        pattern = inspect.signature(TikTokenConverter.__init__).parameters["pattern"].default
        ref = _converter_tokenizer(tiny_dir, pattern, nfc=False)
    ours = load_tokenizer(resolve_model(write_tiny_gguf(tmp_path / "t.gguf", tiny_dir, pre=pre)))
    smol = load_tokenizer(resolve_model(write_tiny_gguf(tmp_path / "s.gguf", tiny_dir)))
    for text in [*STRINGS, "cafe\u0301 e\u0301te\u0301"]:      # the last one decomposed
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    split = ours.backend.pre_tokenizer.pre_tokenize_str
    # not SmolLM's split: numbers as the family groups them, contractions in any case
    assert [w for w, _ in split("12345 I'LL")] == [*split_12345, "ĠI", "'LL"]
    assert split("1234 I'LL") != smol.backend.pre_tokenizer.pre_tokenize_str("1234 I'LL")


def test_gguf_add_bos_token(tiny_dir, tmp_path):
    tok = load_tokenizer(resolve_model(write_tiny_gguf(tmp_path / "b.gguf", tiny_dir, add_bos_token=True)))
    assert tok.encode("the cat", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("the cat")]
    assert tok.bos_token_id not in tok.encode("the cat")


def _linked_copy(src: str, folder):
    """The tiny model's files, linked into `folder`, to add a file beside them."""
    folder.mkdir()
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), folder / name)
    return folder


def test_chat_template_jinja_file_wins(tiny_dir, tmp_path):
    folder = _linked_copy(tiny_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = load_tokenizer(resolve_model(str(folder)))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_a_chat_template_jinja_file_not_in_utf8_is_named(tiny_dir, tmp_path):
    """It was a UnicodeDecodeError traceback (the gateway's, at start-up)."""
    folder = _linked_copy(tiny_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ModelLoadError, match="cannot read .*chat_template.jinja: 'utf-8' codec"):
        load_tokenizer(resolve_model(str(folder)))


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content ", r"does not parse \(line 1: "),
    ("{% if x %}never closed", "does not parse"),
])
def test_a_chat_template_that_does_not_parse_is_refused_at_load(tiny_dir, tmp_path, template,
                                                                 message):
    """Not accepted at load to fail every chat request after."""
    folder = _linked_copy(tiny_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_text(template)
    with pytest.raises(ModelLoadError, match=f"{folder}: the chat template {message}"):
        load_tokenizer(resolve_model(str(folder)))


def _write_tokenizer_gguf(path, model: str, pre: str = "smollm", tokens: bool = True,
                          merges: tuple[str, ...] | None = ("a b",)) -> str:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    if tokens:
        writer.add_token_list(["a", "b", "ab"])
        writer.add_token_types([1, 1, 1])
    if merges is not None:
        writer.add_token_merges(list(merges))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _write_sentencepiece_gguf(path, add_bos: bool | None = True) -> str:
    writer = GGUFWriter(str(path), "llama")
    write_sentencepiece_tokenizer(writer, add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("add_bos", [True, None])
def test_sentencepiece_gguf_tokenizer_is_transformers(tmp_path, add_bos):
    """A SentencePiece GGUF (Llama 2's, Mistral's kind: pieces and scores, no merges) encodes
    and decodes as transformers' own reading of the file: merges from the scores, `▁` for a
    space, bytes for what no piece covers, BOS unless the file says otherwise."""
    from transformers import AutoTokenizer
    path = _write_sentencepiece_gguf(tmp_path / "spm.gguf", add_bos)
    ours = load_tokenizer(resolve_model(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in [*STRINGS, "Hello world, I'm sure the 123 and the  in\nthe\tworld",
                 "Hello</s>the world<s> x"]:       # after a special token: no ▁ prepended
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == \
            ref.encode(text, add_special_tokens=True), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.encode("Hello the world") == [ref.convert_tokens_to_ids(t) for t in
                                              ("▁Hello", "▁the", "▁world")]


def test_unsupported_gguf_tokenizers(tmp_path):
    wordpiece = _write_tokenizer_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(ModelLoadError,
                       match=f"{wordpiece}: GGUF tokenizer model 'bert' is not supported"):
        load_tokenizer(resolve_model(wordpiece))
    odd = _write_tokenizer_gguf(tmp_path / "q.gguf", "gpt2", pre="deepseek-llm")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'deepseek-llm' is not supported"):
        load_tokenizer(resolve_model(odd))
    plain = load_tokenizer(resolve_model(_write_tokenizer_gguf(tmp_path / "p.gguf", "gpt2", "gpt-2")))
    assert plain.encode("abab") == [2, 2]


def test_a_gguf_without_its_token_list_or_merges_is_refused(tmp_path):
    """No token list, or a merge that is not two tokens, was a TypeError traceback; a
    byte-level BPE without its merges was served, every byte a token of its own: prompts the
    model never saw in training, silently."""
    path = _write_tokenizer_gguf(tmp_path / "none.gguf", "gpt2", "gpt-2", tokens=False)
    with pytest.raises(ModelLoadError, match="has no token list"):
        load_tokenizer(resolve_model(path))
    path = _write_tokenizer_gguf(tmp_path / "bytes.gguf", "gpt2", "gpt-2", merges=None)
    with pytest.raises(ModelLoadError, match="without its merges"):
        load_tokenizer(resolve_model(path))
    path = _write_tokenizer_gguf(tmp_path / "odd.gguf", "gpt2", "gpt-2", merges=("ab",))
    with pytest.raises(ModelLoadError, match="merges holds 'ab', not two tokens"):
        load_tokenizer(resolve_model(path))


# ---- chat template sandbox and message validation -----------------------------------------

@pytest.mark.parametrize("template, message", [
    ("{{ ''.__class__.__mro__ }}", "__class__"),
    ("{{ messages.__class__ }}", "__class__"),
    ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
    ("{% set x = messages.append({'role': 'x'}) %}", "chat template failed"),
    ("{% for m in messages %}{{ m.role", "chat template failed"),
    ("{{ messages[0]['content'] + 1 }}", "chat template failed"),
])
def test_bad_templates_are_request_errors(template, message):
    with pytest.raises(InvalidRequestError, match=message):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_template_globals():
    text = render_chat_template(
        "{{ bos_token }}{{ strftime_now('%Y') | length }}{{ messages | tojson }}{{ tools is none }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
        "{{ eos_token if add_generation_prompt }}",
        [{"role": "user", "content": "é"}, {"role": "assistant", "content": "x"}],
        bos_token="<s>", eos_token="</s>")
    assert text == '<s>4[{"role": "user", "content": "é"}, {"role": "assistant", "content": "x"}]Trueuser</s>'


def test_earlier_tool_calls_reach_the_template_with_their_arguments_parsed():
    """As vLLM hands them over: a template that writes `arguments | tojson` (Qwen's, Llama
    3.1's) writes the object, not a JSON string of it."""
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]
    text = render_chat_template(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}",
        [{"role": "user", "content": "w"},
         {"role": "assistant", "content": "", "tool_calls": calls}])
    assert text == '{"city": "Oslo"}'
    for bad, says in (("garbage", "must be a list"), ([5], r"tool_calls\[0\] must be"),
                      ([{"function": {"name": "f", "arguments": "{oops"}}], "not valid JSON")):
        with pytest.raises(InvalidRequestError, match=says):
            validate_messages([{"role": "assistant", "content": "", "tool_calls": bad}])


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\].role"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\].content must be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\].content\[0\]"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\].content\[0\]"),
])
def test_invalid_messages(messages, message):
    with pytest.raises(InvalidRequestError, match=message):
        validate_messages(messages)


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert validate_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "first\nsecond"}]


def test_model_without_template(tiny_dir):
    tok = load_tokenizer(resolve_model(tiny_dir))
    tok.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- incremental detokenizing -------------------------------------------------------------

STREAM_TEXTS = ["Hello 👋🏽 world 🚀🔥!", "日本語のテキストです。中文测试", "naïve café 👨‍👩‍👧 done",
                "mixed: 한국어 and مرحبا 123 ½", "<|im_start|>assistant\nsure 😀<|im_end|>"]


def _stream(tok, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == detok.text
    return pieces


@pytest.mark.parametrize("which", ["smol", "tiny", "sentencepiece"])
def test_streamed_pieces_join_to_the_decoded_text(which, request, tiny_dir, tmp_path):
    """Byte-level BPE, and SentencePiece (whose decoder drops the text's first space and
    spells unknown characters in byte pieces)."""
    if which == "sentencepiece":
        tok = load_tokenizer(resolve_model(_write_sentencepiece_gguf(tmp_path / "s.gguf")))
    else:
        tok = request.getfixturevalue("smol") if which == "smol" else \
            load_tokenizer(resolve_model(tiny_dir))
    prompt = tok.encode("<|im_start|>user\nsay something<|im_end|>\n")
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            pieces = _stream(tok, ids, prompt_token_ids=prompt, skip_special_tokens=skip)
            # the text the ids add to the prompt's (a SentencePiece decoder drops a sequence's
            # first space: the one between the prompt and the first new word is kept)
            whole = tok.decode(prompt + ids, skip_special_tokens=skip)
            assert "".join(pieces) == whole[len(tok.decode(prompt, skip_special_tokens=skip)):]
            assert not any("\ufffd" in p for p in pieces)


def test_split_character_waits_for_its_last_byte(tiny_dir):
    tok = load_tokenizer(resolve_model(tiny_dir))
    ids = tok.encode("a😀")
    assert len(ids) == 5                      # the tiny vocabulary spells 😀 as its 4 bytes
    assert _stream(tok, ids) == ["a", "", "", "", "😀"]


def test_flush_gives_what_a_truncated_stream_holds(tiny_dir):
    tok = load_tokenizer(resolve_model(tiny_dir))
    ids = tok.encode("ok 😀")[:-1]          # the stream stopped inside the emoji
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in ids)
    assert streamed == "ok "
    assert streamed + detok.flush() == tok.decode(ids)
    assert detok.flush() == "" and detok.text == tok.decode(ids)


@pytest.mark.parametrize("model_vocab", [280, 300])
def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, model_vocab):
    """The tiny tokenizer has 287 tokens: a model of 280 rows could not look up its last
    ones (a forward failed on the first prompt holding one); one of 300 rows (padded) is
    fine."""
    path = write_tiny_llama(tmp_path / "m", vocab_size=model_vocab)
    if model_vocab > 287:
        assert load_tokenizer(resolve_model(path)).vocab_size == 287
        return
    with pytest.raises(ModelLoadError, match="the tokenizer has 287 tokens, more than the "
                                             "model's vocab_size of 280"):
        load_tokenizer(resolve_model(path))
