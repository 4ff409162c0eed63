"""`pacer generate` end to end as a user runs it (a real subprocess), and its bad-input
contract: one clear line naming the problem and the offending input, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType

from tests.helpers_tiny_model import SENTENCEPIECE_TOKENS, write_tiny_gguf, write_tiny_llama

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def pacer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0)


def write_lines(path, lines) -> str:
    path.write_text("".join(l if isinstance(l, str) else json.dumps(l) + "\n" for l in lines))
    return str(path)


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pacer: error:"), proc.stderr
    for n in needles:
        assert n in last, (n, last)


def test_generate_every_input_kind_in_order(tiny, tmp_path):
    prompts = write_lines(tmp_path / "in.jsonl", [
        {"prompt": "hello world"},
        {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3},
        {"prompt_token_ids": [5, 6, 7, 8], "temperature": 0.7, "seed": 3, "ignore_eos": True,
         "logit_bias": {"9": 3.5}, "presence_penalty": 0.5, "repetition_penalty": 1.1,
         "min_tokens": 2, "min_p": 0.05, "prompt_logprobs": 0},
    ])
    # saved with a byte-order mark (as some Windows editors do): read past it, as text
    (tmp_path / "in.jsonl").write_text("\ufeff" + (tmp_path / "in.jsonl").read_text())
    out = tmp_path / "out.jsonl"
    proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output", str(out),
                 "--max-tokens", "6", "--max-num-batched-tokens", "4", "--num-kv-blocks", "64")
    assert proc.returncode == 0, proc.stderr
    assert "output tok/s" in proc.stderr
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) >= {"index", "prompt_tokens", "token_ids", "text", "finish_reason"}
    assert rows[2]["prompt_tokens"] == 4
    assert len(rows[1]["token_ids"]) <= 3 and len(rows[2]["token_ids"]) == 6
    assert rows[2]["finish_reason"] == "length"
    lps = rows[2]["prompt_logprobs"]
    assert lps[0] is None and len(lps) == 4 and all(lp < 0 for lp in lps[1:])
    assert "prompt_logprobs" not in rows[0]
    for r in rows:
        assert r["finish_reason"] in ("stop", "length")


def test_a_stop_string_ends_the_text_before_it_and_the_request_there(tiny, tmp_path):
    """The gateway's rule offline: the first stop string in the output ends its text just
    before it, finish_reason "stop", and the request stops being computed."""
    line = {"prompt_token_ids": [9, 10, 11], "ignore_eos": True}
    out = tmp_path / "free.jsonl"
    proc = pacer("generate", "--model", tiny, "--prompts", write_lines(tmp_path / "a.jsonl", [line]),
                 "--output", str(out), "--max-tokens", "24", "--num-kv-blocks", "64")
    assert proc.returncode == 0, proc.stderr
    free = json.loads(out.read_text())
    stop = free["text"][len(free["text"]) // 3:][:3]           # some text a third of the way in
    assert stop.strip(), free["text"]
    out = tmp_path / "stopped.jsonl"
    proc = pacer("generate", "--model", tiny, "--prompts",
                 write_lines(tmp_path / "b.jsonl", [{**line, "stop": stop}]),
                 "--output", str(out), "--max-tokens", "24", "--num-kv-blocks", "64")
    assert proc.returncode == 0, proc.stderr
    stopped = json.loads(out.read_text())
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == free["text"][:free["text"].index(stop)]
    assert len(stopped["token_ids"]) < 24 and \
        stopped["token_ids"] == free["token_ids"][:len(stopped["token_ids"])]


def test_the_text_keeps_the_space_before_its_first_word(tmp_path):
    """A SentencePiece decoder drops the space a sequence starts with; the text is decoded
    after its prompt, as the gateway decodes it, so the space between the prompt and the
    first word stays, with a stop string or without."""
    hf = write_tiny_llama(tmp_path / "spm", vocab_size=len(SENTENCEPIECE_TOKENS))
    gguf = write_tiny_gguf(tmp_path / "spm.gguf", hf, sentencepiece=True)
    words = [SENTENCEPIECE_TOKENS.index(w) for w in ("▁sure", "▁Hello")]
    line = {"prompt": "Hello the world", "max_tokens": 4, "ignore_eos": True,
            "allowed_token_ids": words}
    out = tmp_path / "out.jsonl"
    proc = pacer("generate", "--model", gguf, "--prompts",
                 write_lines(tmp_path / "in.jsonl", [line, {**line, "stop": "never"}]),
                 "--output", str(out), "--num-kv-blocks", "64")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    spelled = "".join(SENTENCEPIECE_TOKENS[t] for t in rows[0]["token_ids"])
    assert [r["text"] for r in rows] == [spelled.replace("▁", " ")] * 2


def test_seeded_line_is_reproducible(tiny, tmp_path):
    line = {"prompt_token_ids": [9, 10, 11], "temperature": 1.0, "seed": 42, "ignore_eos": True}
    outs = []
    for k, extra in enumerate([[], [{"prompt": "other work in the batch"}] * 3]):
        prompts = write_lines(tmp_path / f"in{k}.jsonl", [line, *extra])
        out = tmp_path / f"out{k}.jsonl"
        proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output", str(out),
                     "--max-tokens", "8", "--num-kv-blocks", "64")
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(out.read_text().splitlines()[0])["token_ids"])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("content,needle", [
    ("{not json\n", "line 1 is not valid JSON"),
    ('{"prompt": "a\\ud800"}\n', "line 1 has a string with a lone UTF-16 surrogate"),
    ('{"prompt": "ok", "x": ' + "[" * 2000 + "]" * 2000 + "}\n", "line 1 nests arrays"),
    ('{"prompt": "ok"}\n{"text": "x"}\n', "line 2: needs one of"),
    ('{"prompt": "ok", "temperature": -1}\n', "temperature must be >= 0"),
    ('{"prompt_token_ids": [1, 99999999]}\n', "prompt_token_ids"),
    ('{"prompt_token_ids": [1, true]}\n', "prompt_token_ids must be a non-empty list"),
    ('{"prompt": "ok", "logit_bias": {"99999999": 1}}\n', "logit_bias"),
    ('{"prompt": "ok", "allowed_token_ids": [99999999]}\n', "allowed_token_ids"),
    ('{"prompt": "ok", "prompt_token_ids": [5]}\n', "give one of 'prompt'"),
    ('{"prompt": "a"}\n{"prompt": "b", "logprobs": 1.5}\n', "line 2: logprobs must be an integer"),
    ('{"prompt": "ok", "top_k": 2.5}\n', "top_k must be an integer"),
    ('{"prompt": "ok", "seed": "x"}\n', "seed must be an integer"),
    # 2**64 gave seed 0's tokens (the sampler hashes 64 bits), silently
    ('{"prompt": "ok", "seed": 18446744073709551616}\n', "seed must be a 64-bit integer"),
    ('{"prompt": "ok", "temperature": "hot"}\n', "temperature must be a finite number"),
    ('{"prompt": "ok", "stops": ["."]}\n', "unknown field 'stops'"),
    # the gateway's marker for the schedulers is not a user's field
    ('{"prompt": "ok", "max_tokens_default": true}\n', "unknown field 'max_tokens_default'"),
    ('{"prompt": "ok", "stop": [1]}\n', "stop must be a string or a list of strings"),
    # these were read as token 1, a stop id that never matches, or a bare Python message
    ('{"prompt": "ok", "stop_token_ids": [1.7]}\n', "stop_token_ids must be a list of token ids"),
    ('{"prompt": "ok", "stop_token_ids": [-1]}\n', "stop_token_ids must be a list of token ids"),
    ('{"prompt": "ok", "stop_token_ids": 5}\n', "stop_token_ids must be a list of token ids"),
    ('{"prompt": "ok", "allowed_token_ids": [true]}\n', "allowed_token_ids must be a list"),
    ('{"prompt": "ok", "bad_words_token_ids": [[1.5]]}\n', "bad_words_token_ids[0] must be"),
    ('{"prompt": "ok", "logit_bias": {"x": 1}}\n', "logit_bias must map token ids to numbers"),
    ('{"prompt": "ok", "logit_bias": [1]}\n', "logit_bias must map token ids to numbers"),
    ("", "has no prompts"),
])
def test_malformed_prompts_file(tiny, tmp_path, content, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    proc = pacer("generate", "--model", tiny, "--prompts", str(p), "--output", str(tmp_path / "o"))
    assert_one_line_error(proc, needle, str(p))


def test_prompt_longer_than_context(tiny, tmp_path):
    prompts = write_lines(tmp_path / "long.jsonl", [{"prompt_token_ids": [5] * 6},
                                                   {"prompt_token_ids": [5] * 600}])
    proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output", str(tmp_path / "o"),
                 "--max-model-len", "512")
    assert_one_line_error(proc, "line 2: the prompt has 600 tokens", "512")


def test_missing_prompts_file(tiny, tmp_path):
    proc = pacer("generate", "--model", tiny, "--prompts", str(tmp_path / "nope.jsonl"),
                 "--output", str(tmp_path / "o"))
    assert_one_line_error(proc, "nope.jsonl")


def test_an_output_or_a_flag_that_cannot_serve_is_refused_before_the_model_loads(tiny, tmp_path):
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    proc = pacer("generate", "--model", tiny, "--prompts", prompts,
                 "--output", str(tmp_path / "no-folder" / "o.jsonl"))
    assert_one_line_error(proc, "--output", "no folder")
    assert "generate:" not in proc.stderr           # no progress bar: nothing was generated
    # the prompts file as the output: it was replaced by the results, the prompts lost
    before = open(prompts).read()
    proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output",
                 str(tmp_path / "." / "p.jsonl"))
    assert_one_line_error(proc, "is the prompts file")
    assert open(prompts).read() == before
    proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output",
                 str(tmp_path / "o"), "--max-tokens", "0")
    assert_one_line_error(proc, "--max-tokens: max_tokens must be")
    # the CPU kernels take bfloat16 or float32: it failed at the first forward, after the load
    proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output",
                 str(tmp_path / "o"), "--dtype", "float16")
    assert_one_line_error(proc, "--dtype float16 is not served on CPU")


def test_an_output_that_cannot_be_opened_is_refused_before_the_model_loads(tiny, tmp_path):
    """A name the folder check passed but open() refuses (a trailing slash, a name longer than
    the file system takes; for a user other than root, a read-only file) was found only when
    the results were written, after the whole run: the work lost."""
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    bad = [(str(tmp_path / "o.jsonl") + "/", "Is a directory"),
           (str(tmp_path / ("o" * 300)), "File name too long")]
    if os.geteuid() != 0:              # root may write a read-only file
        (tmp_path / "ro.jsonl").write_text("kept\n")
        (tmp_path / "ro.jsonl").chmod(0o444)
        bad.append((str(tmp_path / "ro.jsonl"), "Permission denied"))
    for output, why in bad:
        proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output", output)
        assert_one_line_error(proc, "--output", "cannot be written", why)
        assert "generate:" not in proc.stderr       # no progress bar: nothing was generated
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["p.jsonl"] + (["ro.jsonl"] if len(bad) > 2 else []))     # nothing left behind
    # a new file's check leaves no file behind; an existing one is not truncated by it
    from shared.json_file import check_output_path
    check_output_path(str(tmp_path / "new.jsonl"), "--output")
    check_output_path(prompts, "--output")
    assert not (tmp_path / "new.jsonl").exists() and json.loads(open(prompts).read())


@pytest.mark.parametrize("pool", [[], ["--kv-cache-memory", "64MiB"]])
def test_a_cuda_device_that_is_not_there_is_named(tiny, tmp_path, pool):
    """A GPU this torch cannot use (none built in, or not that many) is named with the way out.
    It said "give --kv-cache-memory or --num-kv-blocks", and given one, an AssertionError
    traceback came from torch as the model loaded."""
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    proc = pacer("generate", "--model", tiny, "--prompts", prompts, "--output",
                 str(tmp_path / "o"), "--device", "cuda:99", *pool)
    assert_one_line_error(proc, "--device cuda:99")
    assert "--kv-cache-memory" not in proc.stderr


def test_unknown_model_path(tmp_path):
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    proc = pacer("generate", "--model", str(tmp_path / "no-such-model"), "--prompts", prompts,
                 "--output", str(tmp_path / "o"))
    assert_one_line_error(proc, "no-such-model")


def test_gguf_with_unsupported_quantization(tmp_path):
    wide = write_tiny_llama(tmp_path / "wide", hidden_size=256, intermediate_size=256,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    gguf = write_tiny_gguf(tmp_path / "q.gguf", wide,
                           tensor_types={"blk.0.attn_q.weight": GGMLQuantizationType.IQ4_NL})
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    proc = pacer("generate", "--model", gguf, "--prompts", prompts, "--output", str(tmp_path / "o"))
    assert_one_line_error(proc, "IQ4_NL", "blk.0.attn_q.weight")


def test_gguf_with_unsupported_architecture(tiny, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "a.gguf", tiny, arch="gpt2")
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    proc = pacer("generate", "--model", gguf, "--prompts", prompts, "--output", str(tmp_path / "o"))
    assert_one_line_error(proc, "gpt2")


def test_quantized_gguf_generates(tiny, tmp_path):
    """Q8_0 / Q4_0 / Q4_1 files load (quantized: --quantization auto) and generate."""
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        gguf = write_tiny_gguf(tmp_path / f"{qtype.name}.gguf", tiny, tensor_type=qtype)
        prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "hello"}])
        out = tmp_path / "o.jsonl"
        proc = pacer("generate", "--model", gguf, "--prompts", prompts, "--output", str(out),
                     "--max-tokens", "4")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(out.read_text())["token_ids"]


def test_ctrl_c_keeps_the_requests_that_ended(tiny, tmp_path):
    """SIGINT mid-run writes a line for each request that ended, with its input's index, and
    exits 130 saying so (it exited 130 silently and wrote nothing: every finished result was
    lost)."""
    import re
    import signal
    import threading

    quick = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    slow = {"prompt_token_ids": [9, 10, 11], "max_tokens": 1000, "ignore_eos": True}
    prompts = write_lines(tmp_path / "in.jsonl", [quick] * 3 + [slow] * 200)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "generate", "--model", tiny, "--prompts", prompts,
         "--output", str(out), "--max-num-seqs", "2", "--num-kv-blocks", "256"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr, three_ended = [], threading.Event()

    def read_stderr():
        for chunk in iter(lambda: proc.stderr.read(64), ""):
            stderr.append(chunk)
            done = re.findall(r"generate:.*?(\d+)/203", "".join(stderr)[-400:])
            if done and int(done[-1]) >= 3:
                three_ended.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert three_ended.wait(120), "".join(stderr)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, "".join(stderr)
    finally:
        proc.kill()
    reader.join(10)
    err = "".join(stderr)
    assert "Traceback" not in err, err
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert f"interrupted (Ctrl-C): the {len(rows)} of 203 requests that ended are written" in err
    assert 3 <= len(rows) < 203
    assert [r["index"] for r in rows[:3]] == [0, 1, 2]
    assert sorted({r["index"] for r in rows}) == [r["index"] for r in rows]
    for r in rows:
        assert r["finish_reason"] == "length"
        assert len(r["token_ids"]) == (2 if r["index"] < 3 else 1000)
