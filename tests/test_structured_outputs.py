"""Structured outputs: the constraint's forms and errors, the worker's token masks, and greedy
output of the default model under a JSON schema and a choice equal to transformers' with the
same grammar masking its logits (float32; a big budget, 16-row chunks, a preempting pool)."""
from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.structured import Grammars, mask_rows
from shared.errors import InvalidRequestError
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from shared.structured import ANY_JSON_OBJECT, closed_schema, structured_pair
from shared.tokenizer import load_tokenizer
from tests.hf_reference import assert_same_tokens
from services.engine import EngineArgs, LLMEngine
from tests.test_engine_parity import CONFIGS

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "population_millions"]}
QUESTION = "What is the capital of France, and how many million people live there? Answer in JSON."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def test_the_constraint_forms():
    assert structured_pair({"json": SCHEMA}) == ("json", json.dumps(SCHEMA))
    assert structured_pair({"json": '{"type": "string"}'}) == ("json", '{"type": "string"}')
    assert structured_pair({"json_object": True}) == ("json", ANY_JSON_OBJECT)
    assert structured_pair({"choice": ["yes", "no"], "regex": None}) == ("choice", '["yes", "no"]')
    assert structured_pair(["regex", "[0-9]+"]) == ("regex", "[0-9]+")     # the wire's form
    p = SamplingParams.from_dict(SamplingParams(structured_outputs={"regex": "a+"}).to_dict()
                                 | {"structured_outputs": ["regex", "a+"]})
    assert p.structured_outputs == ("regex", "a+")


def test_vllm_s_json_options_are_written_into_the_schema():
    nested = {"type": "object", "properties": {"inner": {"type": "object"},
                                               "list": {"type": "array",
                                                        "items": {"type": "object"}}}}
    kind, text = structured_pair({"json": nested, "disable_any_whitespace": True,
                                  "disable_additional_properties": True})
    schema = json.loads(text)
    assert kind == "json" and schema["x-guidance"] == {"whitespace_flexible": False}
    assert schema["additionalProperties"] is False
    assert schema["properties"]["inner"]["additionalProperties"] is False
    assert schema["properties"]["list"]["items"]["additionalProperties"] is False
    # wherever JSON Schema puts a subschema: a list of items, contains, dependentSchemas
    elsewhere = {"type": "array", "items": [{"type": "object"}], "contains": {"type": "object"},
                 "dependentSchemas": {"a": {"properties": {"b": {}}}}}
    closed = closed_schema(elsewhere)
    assert closed["items"][0]["additionalProperties"] is False
    assert closed["contains"]["additionalProperties"] is False
    assert closed["dependentSchemas"]["a"]["additionalProperties"] is False
    # an object that may also be null is closed too
    assert closed_schema({"type": ["object", "null"]})["additionalProperties"] is False
    assert json.loads(structured_pair({"json_object": True, "whitespace_pattern": " ?"})[1]) == \
        {"type": "object", "x-guidance": {"whitespace_pattern": " ?"}}
    # only JSON has them; a regex is unchanged
    assert structured_pair({"regex": "a+", "disable_any_whitespace": True}) == ("regex", "a+")
    # vLLM's options alone in structured_outputs, for response_format's schema
    from gateway.openai_schema import APIError, parse_chat
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    compact = parse_chat({**chat, "response_format": {"type": "json_object"},
                          "structured_outputs": {"disable_any_whitespace": True}})
    assert json.loads(compact.structured_outputs[1])["x-guidance"] == {"whitespace_flexible": False}
    with pytest.raises(APIError, match="apply to a JSON schema, not to guided_regex"):
        parse_chat({**chat, "guided_regex": "a+",
                    "structured_outputs": {"disable_any_whitespace": True}})


@pytest.mark.slow
def test_no_whitespace_beyond_the_separators_when_asked():
    """The default model spreads an object over lines; with disable_any_whitespace it does
    not (greedy, in process)."""
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs

    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), progress=False)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    texts = {}
    for compact in (False, True):
        [out] = engine.generate([prompt], [SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0,
            structured_outputs={"json": SCHEMA, "disable_any_whitespace": compact})])
        texts[compact] = engine.tokenizer.decode(out.token_ids)
    assert "\n" in texts[False] and "\n" not in texts[True]
    assert json.loads(texts[True])["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("value,says", [
    ({"json": '{"type": "objecx"}'}, "not valid"),
    ({"json": "{not json"}, "not valid"),
    ({"regex": "[a-"}, "unclosed character class"),
    ({"grammar": "start: undefined_rule"}, "not valid"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"xml": "<a/>"}, "does not take 'xml'"),
    ({"json": "{not json", "disable_any_whitespace": True}, "not valid JSON"),
    # nested past Python's JSON parser's depth (a RecursionError there) and past the limit
    ({"json": '{"items": ' * 5000 + "{}" + "}" * 5000, "disable_any_whitespace": True},
     "structured_outputs.json nests arrays and objects more than 128 deep"),
    ({"json": '{"items": ' * 200 + "{}" + "}" * 200, "disable_any_whitespace": True},
     "more than 128 deep"),
    ({"disable_any_whitespace": True}, "exactly one"),
    ({"regex": ""}, "characters"),
    ("json", "must be"),
])
def test_a_bad_constraint_is_refused_saying_why(value, says):
    with pytest.raises(InvalidRequestError, match=says):
        SamplingParams(structured_outputs=value)


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 2, "max_tokens": 4}])
def test_constraints_that_could_not_be_honoured_together_are_refused(extra):
    with pytest.raises(InvalidRequestError, match="end where the grammar does"):
        SamplingParams(structured_outputs={"regex": "a"}, **extra)


def test_a_tokenizer_wider_than_the_logits_is_masked_too(tokenizer):
    """A tokenizer with tokens past the model's logits (added tokens): the matchers cover the
    wider vocabulary, and the mask buffer llguidance fills must be of that width (one of the
    logits' width was refused: "Invalid buffer size")."""
    narrow = tokenizer.vocab_size - 40
    grammars = Grammars(resolve_model(None), narrow, [tokenizer.eos_token_id])
    assert grammars.n_vocab == tokenizer.vocab_size
    digits = SamplingParams(structured_outputs={"regex": "[0-9]{2}"})
    logits = torch.zeros(1, narrow)
    mask_rows(logits, [0], [grammars.matcher("a", digits, [])], grammars.n_vocab)
    allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)


def test_the_mask_leaves_only_what_the_grammar_allows(tokenizer):
    vocab = tokenizer.vocab_size
    grammars = Grammars(resolve_model(None), vocab, [tokenizer.eos_token_id])
    digits = SamplingParams(structured_outputs={"regex": "[0-9]{2}"})
    words = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    free = grammars.matcher("free", SamplingParams(), [])
    assert free is None
    first = tokenizer.encode("4")
    after_one = grammars.matcher("a", digits, first)         # one digit out: one more to go
    logits = torch.zeros(3, vocab)
    mask_rows(logits, [0, 2], [after_one, grammars.matcher("b", words, [])], grammars.n_vocab)
    allowed = [set((row > float("-inf")).nonzero().flatten().tolist()) for row in logits]
    assert allowed[1] == set(range(vocab))                    # an unconstrained row untouched
    assert allowed[0] and all(tokenizer.decode([t]).isdigit() and len(tokenizer.decode([t])) == 1
                              for t in allowed[0])
    texts = {tokenizer.decode([t]) for t in allowed[2]}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    done = grammars.matcher("c", digits, tokenizer.encode("42"))
    logits = torch.zeros(1, vocab)
    mask_rows(logits, [0], [done], grammars.n_vocab)
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_a_whitespace_pattern_is_followed_even_empty_and_in_its_older_spelling(tokenizer):
    """whitespace_pattern "" (no whitespace between JSON's tokens) was dropped as if not
    given, and vLLM's guided_whitespace_pattern ignored: the output kept its newlines."""
    from gateway.openai_schema import APIError, parse_chat
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    empty = parse_chat({**chat, "structured_outputs": {"whitespace_pattern": ""}})
    older = parse_chat({**chat, "guided_whitespace_pattern": ""})
    assert json.loads(empty.structured_outputs[1])["x-guidance"] == {"whitespace_pattern": ""}
    assert older.structured_outputs == empty.structured_outputs
    grammars = Grammars(resolve_model(None), tokenizer.vocab_size, [tokenizer.eos_token_id])
    matcher = grammars.matcher("a", SamplingParams(structured_outputs=older.structured_outputs),
                               tokenizer.encode("{"))
    logits = torch.zeros(1, tokenizer.vocab_size)
    mask_rows(logits, [0], [matcher], grammars.n_vocab)
    allowed = {tokenizer.decode([t]) for t in (logits[0] > float("-inf")).nonzero().flatten()}
    assert allowed and not any(text[:1].isspace() for text in allowed)
    with pytest.raises(APIError, match="guided_whitespace_pattern: whitespace_pattern apply "
                                       "to a JSON schema, not to guided_regex") as e:
        parse_chat({**chat, "guided_json": None, "guided_regex": "a+",
                    "guided_whitespace_pattern": " "})
    assert e.value.param == "guided_whitespace_pattern"


def test_a_matcher_the_output_does_not_match_is_kept_failed(tokenizer):
    """A request whose output so far its grammar does not take (a worker's matcher built
    again after a recompute or a hand-off) keeps a matcher in its error state, which the
    runner turns into no token and an error, never into unconstrained output."""
    grammars = Grammars(resolve_model(None), tokenizer.vocab_size, [tokenizer.eos_token_id])
    digits = SamplingParams(structured_outputs={"regex": "[0-9]{2}"})
    assert not grammars.matcher("ok", digits, tokenizer.encode("4")).is_error()
    assert grammars.matcher("off", digits, tokenizer.encode("ab")).is_error()


def test_a_grammar_the_engine_gives_up_on_ends_the_request_with_an_error():
    """Constraints that pass every check and that the grammar engine gives up on at the first
    token: a regex past its limits (llguidance: "too many expressions constructed"), a
    schema that allows no output (its mask: EOS alone). Each request ends with an error and
    no token, the one beside them is served, every block comes back."""
    engine = LLMEngine(EngineArgs(model="smollm2-135m", block_size=16, num_kv_blocks=64),
                       progress=False)
    with engine:
        prompt = engine.tokenizer.encode("num:")
        hostile = [SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=spec)
                   for spec in ({"regex": "(x{1000}){1000}"}, {"json": {"$ref": "#"}})]
        plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = engine.generate([prompt] * 3, [*hostile, plain])
        for failed in out[:2]:
            assert (failed.finish_reason, failed.token_ids) == ("error", [])
            assert "grammar engine could not follow" in failed.error
        assert (out[2].finish_reason, len(out[2].token_ids)) == ("length", 8)
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks


@pytest.fixture(scope="module")
def constrained_refs(default_hf, tokenizer):
    """transformers' greedy output with llguidance's mask on its logits, for each prompt and
    constraint (the same grammar and vocabulary the worker uses)."""
    from transformers import LogitsProcessorList
    cases = [(QUESTION, {"json": SCHEMA}), (QUESTION, {"json_object": True}),
             ("Is the sea salty? Answer yes or no.", {"choice": ["yes", "no", "maybe"]}),
             ("Give a date in ISO form.", {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})]
    grammars = Grammars(resolve_model(None), default_hf.config.vocab_size,
                        [tokenizer.eos_token_id])
    refs = []
    for text, spec in cases:
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec)
        state = {"matcher": grammars.matcher("ref", params, []), "seen": len(prompt)}

        def constrain(input_ids, scores, state=state):
            for t in input_ids[0, state["seen"]:].tolist():
                assert state["matcher"].consume_token(t)
            state["seen"] = input_ids.shape[1]
            scores = scores.clone()
            mask_rows(scores, [0], [state["matcher"]], grammars.n_vocab)
            return scores

        out = default_hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id, top_p=None, top_k=None, temperature=None,
            logits_processor=LogitsProcessorList([constrain]), output_scores=True,
            return_dict_in_generate=True)
        refs.append((prompt, params, out.sequences[0, len(prompt):].tolist(),
                     torch.stack(out.scores)[:, 0]))
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,expect_preemption", CONFIGS)
def test_greedy_structured_output_matches_transformers(constrained_refs, tokenizer, name,
                                                       overrides, expect_preemption):
    """The four constraints in one batch, each prompt twice (a prefix-cache hit)."""
    prompts = [prompt for prompt, *_ in constrained_refs] * 2
    params = [p for _, p, *_ in constrained_refs] * 2
    # preempting: room for the longest request alone, with its whole budget
    blocks = overrides["num_kv_blocks"] or -(-(max(map(len, prompts)) + MAX_TOKENS) // 16)
    engine = LLMEngine(EngineArgs(model="smollm2-135m", block_size=16, dtype="float32",
                                  quantization="none", **{**overrides, "num_kv_blocks": blocks}),
                       progress=False)
    ours = [r.token_ids for r in engine.generate(prompts, params)]
    assert not expect_preemption or engine.scheduler.num_preemptions_total > 0
    for k, (_, p, ref, logits) in enumerate(constrained_refs * 2):
        assert_same_tokens(ours[k], ref, logits, f"{p.structured_outputs[0]} {name}")
    for o, (_, p, *_) in zip(ours, constrained_refs):
        assert o[-1] == tokenizer.eos_token_id, "the grammar ended within the budget"
        text = tokenizer.decode(o)
        kind, spec = p.structured_outputs
        if spec == ANY_JSON_OBJECT:
            assert isinstance(json.loads(text), dict)
        elif kind == "json":
            answer = json.loads(text)
            assert set(answer) == {"city", "population_millions"}
            assert answer["city"] in ("Paris", "Rome")
        elif kind == "choice":
            assert text in json.loads(spec)
        else:
            assert len(text) == 10 and text[4] == text[7] == "-"



TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_tool_choice_becomes_the_constraint_of_its_calls():
    from gateway.openai_schema import parse_chat
    named = parse_chat({**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert named.tool_choice == "get_weather" and named.tools == (TOOL,)
    assert json.loads(named.structured_outputs[1]) == TOOL["function"]["parameters"]
    required = parse_chat({**CHAT, "tools": [TOOL], "tool_choice": "required",
                           "parallel_tool_calls": False})
    calls = json.loads(required.structured_outputs[1])
    assert calls["type"] == "array" and calls["maxItems"] == 1
    [call] = calls["items"]["anyOf"]
    assert call["properties"]["name"]["enum"] == ["get_weather"]
    ref = call["properties"]["parameters"]["$ref"]
    assert calls["$defs"][ref.removeprefix("#/$defs/")] == TOOL["function"]["parameters"]
    # "none": the tools shown to the template (OpenAI's and vLLM's default), no call made
    none = parse_chat({**CHAT, "tools": [TOOL], "tool_choice": "none"})
    assert (none.tools, none.tool_choice, none.structured_outputs) == ((TOOL,), None, None)
    # "auto" (the default with tools) where a parser of the model's format is configured:
    # the tools shown, nothing constrained
    auto = parse_chat({**CHAT, "tools": [TOOL]}, auto_tools=True)
    assert (auto.tools, auto.tool_choice, auto.structured_outputs) == ((TOOL,), "auto", None)


def test_a_tool_whose_optional_fields_are_null_is_one_without_them():
    """Clients that write every optional field (pydantic's dumps) send `"parameters": null`
    for a function of no arguments, as vLLM takes it: the calls' arguments are an object."""
    from gateway.openai_schema import APIError, parse_chat
    from gateway.responses_api import chat_body
    tool = {"type": "function", "function": {"name": "now", "description": None,
                                             "parameters": None, "strict": None}}
    for choice in ("required", {"type": "function", "function": {"name": "now"}}):
        req = parse_chat({**CHAT, "tools": [tool], "tool_choice": choice})
        assert req.tools == (tool,) and "object" in req.structured_outputs[1]
    chat, _ = chat_body({"model": "m", "input": "hi", "tool_choice": "required", "tools": [
        {"type": "function", "name": "now", "parameters": None}]})
    assert json.loads(parse_chat(chat).structured_outputs[1])["$defs"]["tool-now"] == \
        {"type": "object"}
    with pytest.raises(APIError, match=r"tools\[0\] must be"):      # no schema, and not null
        parse_chat({**CHAT, "tools": [{"type": "function", "function": {
            "name": "now", "parameters": []}}], "tool_choice": "required"})


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "pop": {"type": "integer"}},
        "required": ["city", "pop"]}


def test_strict_schemas_and_tools_name_every_key_the_output_may_have():
    """OpenAI's `strict: true` (a json_schema response format, a function tool, a Responses
    tool): no key beyond those the schema names, as vLLM's default backend does; without it
    JSON Schema's default (other keys allowed) holds."""
    from gateway.openai_schema import parse_chat
    from gateway.responses_api import chat_body

    def schema(**fields):
        return json.loads(parse_chat({**CHAT, **fields}).structured_outputs[1])

    def response_format(strict):
        return {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY,
                                                       **({} if strict is None else {"strict": strict})}}
    assert schema(response_format=response_format(True))["additionalProperties"] is False
    for loose in (None, False):
        assert "additionalProperties" not in schema(response_format=response_format(loose))
    strict_tool = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    assert schema(tools=[strict_tool], tool_choice="required")[
        "$defs"]["tool-get_weather"]["additionalProperties"] is False
    assert schema(tools=[strict_tool], tool_choice={"type": "function", "function": {
        "name": "get_weather"}})["additionalProperties"] is False
    assert "additionalProperties" not in schema(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    chat, _ = chat_body({"model": "m", "input": "hi", "tool_choice": "required", "tools": [
        {"type": "function", "name": "get_weather", "strict": True,
         "parameters": TOOL["function"]["parameters"]}]})
    assert parse_chat(chat).tools[0]["function"]["strict"] is True
    # a strict that is no boolean is refused, naming the field
    from gateway.openai_schema import APIError
    bad_format = {"type": "json_schema", "json_schema": {"schema": CITY, "strict": "yes"}}
    with pytest.raises(APIError, match=r"response_format.json_schema.strict must be a boolean"):
        parse_chat({**CHAT, "response_format": bad_format})
    bad_tool = {"type": "function", "function": {**TOOL["function"], "strict": 1}}
    with pytest.raises(APIError, match=r"tools\[0\].function.strict must be a boolean"):
        parse_chat({**CHAT, "tools": [bad_tool], "tool_choice": "required"})
    with pytest.raises(APIError, match=r"tools\[0\].strict must be a boolean"):
        chat_body({"model": "m", "input": "hi", "tools": [
            {"type": "function", "name": "f", "strict": "no"}]})


@pytest.mark.slow
def test_a_strict_schema_ends_the_object_at_its_last_key(tokenizer):
    """Left open, the default model goes on adding keys to the city object until max_tokens
    (no JSON at all); strict, it closes the object after the two keys (greedy, in process)."""
    from gateway.openai_schema import parse_chat
    engine = LLMEngine(EngineArgs(model="smollm2-135m", dtype="float32", quantization="none",
                                  num_kv_blocks=64, max_model_len=512), progress=False)
    prompt = tokenizer.encode_chat([{"role": "user",
                                     "content": "Which city is the capital of France?"}])
    spec = parse_chat({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "strict": True, "schema": CITY}}}).structured_outputs
    [out] = engine.generate([prompt], [SamplingParams(max_tokens=64, temperature=0.0,
                                                      structured_outputs=spec)])
    assert set(json.loads(tokenizer.decode(out.token_ids[:-1]))) == {"city", "pop"}


@pytest.mark.parametrize("fields,param,says", [
    ({"tools": [TOOL]}, "tool_choice", "--tool-call-parser"),   # auto, the default: no parser
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "must name one of the tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
     "tools", "tools\\[0\\] must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "one constraint"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools", "the tools' parameters are not a schema"),
    ({"tools": [TOOL, TOOL], "tool_choice": "required"}, "tools", "'get_weather' twice"),
    # a response format says what it is, as OpenAI asks (not taken as text)
    ({"response_format": {}}, "response_format", "response_format.type must be .* got nothing"),
    ({"response_format": {"type": "xml"}}, "response_format", "got 'xml'"),
])
def test_a_request_that_cannot_be_served_says_why(fields, param, says):
    from gateway.openai_schema import APIError, parse_chat
    with pytest.raises(APIError, match=says) as e:
        parse_chat({**CHAT, **fields})
    assert e.value.param == param


# parameters that point into themselves, as pydantic writes them ($defs) and as a tree does
LOCATED = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
           "additionalProperties": False, "$defs": {"Loc": {
               "type": "object", "properties": {"city": {"type": "string"}},
               "required": ["city"], "additionalProperties": False}}}
TREE = {"type": "object", "properties": {"name": {"type": "string"}, "children": {
    "type": "array", "items": {"$ref": "#"}}}, "required": ["name"], "additionalProperties": False}


def test_required_calls_keep_each_tools_own_refs(tokenizer):
    """Under "required" each tool's parameters are one branch of a list's schema: a `$ref`
    inside them ("#", "#/$defs/X") must still point into them, not at the list (which gave a
    400 for pydantic's $defs, and let "#" take a list of calls as a tree's child)."""
    from gateway.openai_schema import parse_chat
    tools = [{"type": "function", "function": {"name": name, "parameters": params}}
             for name, params in (("locate", LOCATED), ("tree", TREE))]
    spec = parse_chat({**CHAT, "tools": tools, "tool_choice": "required"}).structured_outputs
    grammars = Grammars(resolve_model(None), tokenizer.vocab_size, [tokenizer.eos_token_id])

    def accepts(output: str) -> bool:
        matcher = grammars.matcher("r", SamplingParams(structured_outputs=spec),
                                   tokenizer.encode(output))
        return not matcher.is_error() and matcher.is_accepting()
    assert accepts('[{"name": "locate", "parameters": {"loc": {"city": "Oslo"}}}]')
    assert not accepts('[{"name": "locate", "parameters": {"loc": {"town": "Oslo"}}}]')
    assert accepts('[{"name": "tree", "parameters": {"name": "a", "children": '
                   '[{"name": "b", "children": []}]}}]')
    assert not accepts('[{"name": "tree", "parameters": {"name": "a", "children": '
                       '[[{"name": "tree", "parameters": {"name": "b"}}]]}}]')


def test_tool_calls_read_from_the_output():
    from gateway.openai_schema import tool_calls
    [call] = tool_calls("get_weather", '{"city": "Oslo"}')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    calls = tool_calls("required", '[{"name": "a", "parameters": {"x": 1}}, '
                                   '{"name": "b", "parameters": {}}]')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("a", '{"x": 1}'), ("b", "{}")]
    assert len({c["id"] for c in calls}) == 2
    assert tool_calls("required", '[{"name": "a", "param') is None        # cut short
    # cut short after whole calls (a small model may go on adding calls up to max_tokens):
    # those made whole are calls still
    cut = tool_calls("required", '[{"name": "a", "parameters": {"x": 1}},\n {"name": "b", '
                                 '"parameters": {}}\n\n,\n{"name": "a", "parameters": {"x"')
    assert [c["function"]["name"] for c in cut] == ["a", "b"]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("spec", [
    {"regex": "(a|aa)*(b|bb)*c{1000}"}, {"regex": "[a-z]{1,90000}"},
    {"json": {"type": "string", "pattern": "^(a+)+$"}}, {"json": _nested(300)},
    {"json": {"type": "string", "enum": [f"w{i}" for i in range(5000)]}},
    {"grammar": 'start: x\nx: x x | "a"'}, {"choice": [f"option {i}" for i in range(20000)]},
])
def test_a_hostile_constraint_is_refused_or_served(tokenizer, spec):
    """Backtracking regexes, huge repetitions, deep nesting, ambiguous grammars: each is
    either a clear refusal or a matcher that gives a mask (each took 0.2-1.7 ms here, by
    hand; a stalled one would meet the test timeout)."""
    try:
        params = SamplingParams(structured_outputs=spec)
    except InvalidRequestError as e:
        assert "structured_outputs" in str(e)
        return
    grammars = Grammars(resolve_model(None), tokenizer.vocab_size, [tokenizer.eos_token_id])
    matcher = grammars.matcher("hostile", params, [])
    logits = torch.zeros(1, tokenizer.vocab_size)
    mask_rows(logits, [0], [matcher], grammars.n_vocab)
    assert (logits[0] > float("-inf")).any()
