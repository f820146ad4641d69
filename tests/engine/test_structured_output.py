"""Structured output: the sampler's token mask against xgrammar's own, and the embedded SmolLM2 held to JSON
schemas, regular expressions, choices and grammars (which it does not follow when unconstrained)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from radiance import SamplingParams
from radiance.engine.structured_output import GrammarBackend, StructuredOutput, StructuredOutputError
from radiance.layers.sampler import LogitAdjustment, SamplingRow, adjust_logits, apply_token_masks, sample
from tests.engine.conftest import tiny_byte_bpe_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "likes_tea": {"type": "boolean"}},
          "required": ["name", "age", "likes_tea"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe Ann, a 31-year-old teacher who loves tea."}]


def check_person(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["name", "age", "likes_tea"]  # required keys, in the schema's order
    assert re.fullmatch("[A-Z][a-z]{1,15}", value["name"])
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150 and isinstance(value["likes_tea"], bool)
    return True


def reference_masked(logits: torch.Tensor, words: list[torch.Tensor | None]) -> torch.Tensor:
    """-inf where bit t % 32 of word t // 32 is clear, bit by bit (rows without words unchanged)."""
    out = logits.clone()
    for r, w in enumerate(words):
        if w is not None:
            for t in range(logits.shape[1]):
                if not (int(w[t // 32]) >> (t % 32)) & 1:
                    out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 1000, 4099])
def test_token_masks_match_the_bits(vocab):
    torch.manual_seed(vocab)
    width = (vocab + 31) // 32
    words = [torch.randint(-2**31, 2**31 - 1, (width,), dtype=torch.int32), None,
             torch.randint(-2**31, 2**31 - 1, (width,), dtype=torch.int32)]
    logits = torch.randn(3, vocab)
    for adj in ([LogitAdjustment(allowed=w) for w in words],  # a row without a mask among masked rows
                [LogitAdjustment(allowed=words[0])]):  # masks only
        got = logits[:len(adj)].clone()
        apply_token_masks(got, adj)
        want = reference_masked(logits[:len(adj)], [a.allowed for a in adj])
        assert torch.equal(got, want)
        assert 0 < torch.isinf(got[0]).sum() < vocab


def test_only_constrained_rows_are_masked_and_bias_still_applies():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5], [3.0, 1.0, 2.0, 0.5], [3.0, 1.0, 2.0, 0.5]])
    allow_1_3 = torch.tensor([0b1010], dtype=torch.int32)
    rows = [SamplingRow(0.0, num_logprobs=0, adjust=LogitAdjustment(allowed=allow_1_3)),
            SamplingRow(0.0),
            SamplingRow(0.0, adjust=LogitAdjustment(bias=((3, 5.0),), allowed=allow_1_3))]
    out = adjust_logits(logits, rows)
    inf = float("-inf")
    assert out.tolist() == [[inf, 1.0, inf, 0.5], [3.0, 1.0, 2.0, 0.5], [inf, 1.0, inf, 5.5]]
    result = sample(logits, rows)
    assert result.token_ids == [1, 0, 3]
    assert result.logprobs[0][0] == pytest.approx(logits[0].log_softmax(-1)[1].item())  # the model's logprob
    only_masks = [SamplingRow(0.0, adjust=LogitAdjustment(allowed=allow_1_3)) for _ in range(2)]
    before = logits.clone()
    assert adjust_logits(logits[:2], only_masks).tolist() == [[inf, 1.0, inf, 0.5]] * 2
    assert torch.equal(logits, before)  # the model's logits stay for logprobs


@pytest.mark.parametrize("kwargs", [dict(), dict(json="{}", regex="a"), dict(choice=()), dict(choice=("a", ""))])
def test_exactly_one_well_formed_constraint(kwargs):
    with pytest.raises(StructuredOutputError):
        StructuredOutput(**kwargs)


def test_a_schema_dict_keeps_its_key_order():
    spec = StructuredOutput(json=PERSON)
    assert list(json.loads(spec.json)["properties"]) == ["name", "age", "likes_tea"] and spec.kind == "json"


CASES = {
    "json": (StructuredOutput(json=PERSON), check_person),
    "json_object": (StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    "regex": (StructuredOutput(regex=r"[A-Z][a-z]+, age [0-9]{2}"),
              lambda t: re.fullmatch(r"[A-Z][a-z]+, age [0-9]{2}", t)),
    "choice": (StructuredOutput(choice=("teacher", "doctor", "pilot")), lambda t: t in ("teacher", "doctor", "pilot")),
    "grammar": (StructuredOutput(grammar='root ::= "Name: " [A-Za-z]{1,12} "; age: " [1-9] [0-9]?'),
                lambda t: re.fullmatch(r"Name: [A-Za-z]{1,12}; age: [1-9][0-9]?", t)),
}


@pytest.mark.slow
def test_constraints_hold_greedy_and_sampled(smollm2):
    free = smollm2.chat(ASK_PERSON, SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0].text
    for name, (spec, valid) in CASES.items():
        assert not valid_quietly(valid, free), name  # not vacuous: unconstrained, the model writes prose
        # room for a long string value: a json_object may hold one (float32 greedy: 48 tokens ended inside it)
        for params in (SamplingParams(max_tokens=128, temperature=0.0, structured_output=spec),
                       SamplingParams(max_tokens=128, temperature=1.0, seed=7, structured_output=spec)):
            out = smollm2.chat(ASK_PERSON, params)[0].outputs[0]
            if name == "json_object" and out.finish_reason == "length":
                # greedy SmolLM2 may write one string value forever (bfloat16 on an AVX2 CPU does): the cut text
                # must still be a prefix that JSON's grammar accepts
                assert out.text.startswith("{") and json_prefix(out.text), out.text
                continue
            assert out.finish_reason == "stop", (name, out.text)
            assert valid(out.text), (name, out.text)


def json_prefix(text: str) -> bool:
    """Whether some JSON value starts with text (xgrammar's built-in JSON grammar, no termination asked)."""
    import xgrammar

    grammar = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"])).compile_builtin_json_grammar()
    return xgrammar.GrammarMatcher(grammar).accept_string(text)


def test_json_prefix_tells_a_cut_value_from_a_broken_one():
    assert json_prefix('{"Ann": "A 31-year') and json_prefix('{"a": tru')
    assert not json_prefix('{"a" 1') and not json_prefix("Ann")


def valid_quietly(valid, text) -> bool:
    try:
        return bool(valid(text))
    except (ValueError, AssertionError):
        return False


@pytest.mark.slow
def test_constrained_and_free_rows_share_a_batch(smollm2):
    prompt = smollm2.apply_chat_template(ASK_PERSON)
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = smollm2.generate(prompt, free)[0].outputs[0].token_ids
    outs = smollm2.generate([prompt] * 3, [SamplingParams(max_tokens=48, temperature=0.0,
                                                          structured_output=CASES["json"][0]), free,
                                           SamplingParams(max_tokens=48, temperature=0.0,
                                                          structured_output=CASES["choice"][0])])
    check_person(outs[0].outputs[0].text)
    assert outs[1].outputs[0].token_ids == alone
    assert outs[2].outputs[0].text in ("teacher", "doctor", "pilot")


@pytest.mark.slow
def test_ignore_eos_still_ends_where_the_constraint_does(smollm2):
    spec = CASES["choice"][0]
    out = smollm2.chat(ASK_PERSON, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                  structured_output=spec))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in spec.choice


def test_bad_constraints_are_refused_up_front(smollm2):
    engine = smollm2.engine
    for spec, message in [(StructuredOutput(json="{not json"), "invalid json constraint: .*JSON"),
                          (StructuredOutput(regex="[a-"), "invalid regex constraint: .*Unclosed"),
                          (StructuredOutput(grammar="root ::= missing"), "invalid grammar constraint: .*missing")]:
        with pytest.raises(StructuredOutputError, match=message):
            engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=spec))
    assert "bad" not in engine.sequences


def test_a_model_without_tokenizer_refuses_structured_output(tiny_llm):
    llm = tiny_llm()
    with pytest.raises(StructuredOutputError, match="needs the model's tokenizer"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(structured_output=StructuredOutput(regex="a+")))


def test_the_backend_warms_on_a_background_thread(tiny_text_llm, tiny_llm):
    engine = tiny_text_llm().engine
    assert engine._grammar_backend is None  # the offline engine builds it on first use
    thread = engine.warm_grammar_backend()
    assert not thread.daemon  # the interpreter waits for it: exiting mid-compile aborted the process (rc 134)
    thread.join(timeout=60)
    backend = engine._grammar_backend
    assert backend is not None and backend.compiler.get_cache_size_bytes() > 0  # the JSON-object grammar too
    assert engine.grammar_backend() is backend  # built once
    assert tiny_llm().engine.warm_grammar_backend() is None  # nothing to warm without a tokenizer


TINY_CASES = [StructuredOutput(json=PERSON), StructuredOutput(regex=r"[a-z]{3,6}( [a-z]{2,5}){2}\."),
              StructuredOutput(choice=("Paris", "Rome", "brown fox"))]


def tiny_valid(spec: StructuredOutput, text: str) -> bool:
    if spec.json is not None:
        return valid_quietly(check_person, text)
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    return text in spec.choice


def test_tiny_random_model_held_to_constraints(tiny_text_llm):
    """A random model with a byte-level BPE tokenizer: its free text is noise, its constrained text valid."""
    llm = tiny_text_llm()
    prompt = llm.tokenizer("Paris is", add_special_tokens=False).input_ids
    free = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0].text
    params = [SamplingParams(max_tokens=80, temperature=t, seed=3, structured_output=spec)
              for spec in TINY_CASES for t in (0.0, 1.0)]
    outs = llm.generate([prompt] * len(params), params)
    for p, out in zip(params, outs):
        spec = p.structured_output
        assert not tiny_valid(spec, free)
        assert out.outputs[0].finish_reason == "stop" and tiny_valid(spec, out.outputs[0].text), (spec, out.outputs[0])


@pytest.mark.gpu
def test_gpu_constrained_tokens_equal_the_cpus(tiny_text_llm):
    """fp32 on both sides: the GPU (graphs, overlapped decode for the free row) picks the CPU's tokens under
    the same masks, and the mask unpacks the same on the device."""
    words = torch.randint(-2**31, 2**31 - 1, (4, 10), dtype=torch.int32)
    logits = torch.randn(4, 300)
    on_gpu = logits.cuda()
    apply_token_masks(on_gpu, [LogitAdjustment(allowed=w) for w in words.cuda()])
    assert torch.equal(on_gpu.cpu(), reference_masked(logits, list(words)))
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = tiny_text_llm()
    gpu = tiny_text_llm(device="cuda", num_gpu_blocks_override=128, max_num_seqs=8, cuda_graph_max_batch=8)
    assert gpu.engine.overlap_decode
    prompt = cpu.tokenizer("Paris is", add_special_tokens=False).input_ids
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured_output=spec) for spec in TINY_CASES]
    params.append(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    want = [o.outputs[0].token_ids for o in cpu.generate([prompt] * len(params), params)]
    got = [o.outputs[0].token_ids for o in gpu.generate([prompt] * len(params), params)]
    assert got == want
    for spec, out in zip(TINY_CASES, gpu.generate([prompt] * 3, params[:3])):
        assert tiny_valid(spec, out.outputs[0].text)
    gpu.generate(prompt, params[-1])
    assert gpu.engine.overlapped_steps > 0


@pytest.mark.parametrize("options", [dict(overlap_decode=True), dict(max_num_batched_tokens=16, overlap_decode=True),
                                     dict(num_gpu_blocks_override=6, max_num_batched_tokens=32, overlap_decode=True)],
                         ids=["overlap", "chunked", "preemption"])
def test_queued_ahead_steps_sample_constrained_rows_as_in_order_steps_do(tiny_text_llm, options):
    """With the overlapped decode the forward is queued before the host has the last token and the sampling
    waits for the mask: same tokens as one step at a time, penalties counting each token once."""
    prompts = [[40 + i for i in range(n)] for n in (5, 23, 9, 14)]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_output=TINY_CASES[0]),
              SamplingParams(max_tokens=60, temperature=0.0, structured_output=TINY_CASES[1],
                             repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, presence_penalty=1.0)]
    want = [o.outputs[0].token_ids for o in tiny_text_llm(max_num_seqs=4).generate(prompts, params)]
    llm = tiny_text_llm(max_num_seqs=4, **options)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.overlapped_steps > 0
    if "num_gpu_blocks_override" in options:
        assert llm.engine.stats().num_preemptions > 0


def test_cli_generate_holds_to_a_schema_file_and_names_bad_options(tmp_path, capsys):
    from radiance.cli import main

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert main(["generate", "Describe Ann.", "--json-schema", str(schema), "--max-tokens", "40", "--device", "cpu"]) == 0
    check_person(capsys.readouterr().out.strip())
    assert main(["generate", "x", "--regex", "[a-", "--device", "cpu"]) == 2
    assert "invalid regex constraint" in capsys.readouterr().err
    assert main(["generate", "x", "--grammar", str(tmp_path / "missing.ebnf"), "--device", "cpu"]) == 2
    assert "--grammar: cannot read" in capsys.readouterr().err


def test_choices_are_matched_literally():
    backend = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])
    spec = StructuredOutput(choice=('say "hi"', "a\\b|c", "(x)*"))
    for text, ok in [('say "hi"', True), ("a\\b|c", True), ("(x)*", True), ("say hi", False), ("a\\b", False),
                     ("xx", False), ("(x)", False)]:
        state = backend.matcher(spec)
        assert (state.matcher.accept_string(text) and state.matcher.is_completed()) == ok, text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
                                              "unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]


@pytest.mark.slow
@pytest.mark.parametrize("named", [None, "get_weather", "get_time"])
def test_forced_hermes_tool_calls_parse_and_follow_the_schema(smollm2, named):
    """The server's forced tool call: the prompt ends with the call's opening, the grammar holds the rest."""
    from radiance.engine.tool_grammars import HERMES, tool_call_grammar
    from radiance.server.tool_parsers import HermesToolParser, parse_tool_calls

    prefix = "<tool_call>\n" + (f'{{"name": "{named}", "arguments": ' if named else "")
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "What is the weather in Rome?"}]) + prefix
    spec = StructuredOutput(grammar=tool_call_grammar(TOOLS, HERMES, named))
    out = smollm2.generate(prompt, SamplingParams(max_tokens=60, temperature=0.0, structured_output=spec))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.endswith("</tool_call>"), out.text
    [call] = parse_tool_calls(HermesToolParser(TOOLS), prefix + out.text).tool_calls
    args = json.loads(call.arguments)
    assert call.name == (named or call.name) and call.name in ("get_weather", "get_time")
    if call.name == "get_weather":
        assert set(args) == {"city", "unit"} and re.fullmatch("[A-Z][a-z]{1,15}", args["city"])
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(args) == {"zone"} and isinstance(args["zone"], str)


@pytest.fixture(scope="module")
def byte_backend():
    return GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])


def matches(backend, grammar: str, text: str) -> bool:
    state = backend.matcher(StructuredOutput(grammar=grammar))
    return state.matcher.accept_string(text) and state.matcher.is_completed()


STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
# the same calls in Qwen3-coder markup, as its chat template writes them (after "<tool_call>\n")
XML_WEATHER = ("<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=unit>\ncelsius\n"
               "</parameter>\n</function>")
XML_TIME = "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>"


def test_forced_required_call_then_parallel_calls(byte_backend):
    from radiance.engine.tool_grammars import HERMES, tool_call_grammar

    after = WEATHER + "\n</tool_call>"  # the prompt ends with "<tool_call>\n"
    more = f"\n<tool_call>\n{TIME}\n</tool_call>"
    parallel, single = tool_call_grammar(TOOLS, HERMES, parallel=True), tool_call_grammar(TOOLS, HERMES)
    assert matches(byte_backend, parallel, after) and matches(byte_backend, parallel, after + more)
    # "required": the answer is its calls, nothing after or between them (the model ends or opens another)
    assert not matches(byte_backend, parallel, after + " Done." + more)
    assert not matches(byte_backend, parallel, after + " Done.")
    assert matches(byte_backend, parallel, after + "\n")  # a newline before the end is no call to force
    assert not matches(byte_backend, parallel, after + "\n\n\n")
    assert not matches(byte_backend, parallel, after + '\n<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>')
    assert not matches(byte_backend, parallel, after + '\n<tool_call>\n{"name": "get_time", "arguments": {"city": 1}}')
    assert matches(byte_backend, single, after) and not matches(byte_backend, single, after + more)
    assert not matches(byte_backend, single, WEATHER.replace(": ", ":" + " " * 3) + "\n</tool_call>")  # bounded spaces


def test_strict_tools_hold_calls_the_model_opens(byte_backend):
    from radiance.engine.tool_grammars import HERMES, strict_tools_grammar

    grammar = strict_tools_grammar(STRICT_TOOLS, HERMES, parallel=True)
    assert matches(byte_backend, grammar, "No call needed, it is sunny.")
    assert matches(byte_backend, grammar, f"Checking. <tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>")
    bad_args = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "unit": "celsius"}}\n</tool_call>'
    assert not matches(byte_backend, grammar, bad_args)  # the strict function's pattern holds
    loose = '<tool_call>\n{"name": "get_time", "arguments": {"anything": [1, 2]}}\n</tool_call>'
    assert matches(byte_backend, grammar, loose)  # a non-strict function takes any JSON object
    assert not matches(byte_backend, grammar, '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>')
    one = strict_tools_grammar(STRICT_TOOLS, HERMES, parallel=False)
    assert matches(byte_backend, one, f"<tool_call>\n{TIME}\n</tool_call>")
    assert not matches(byte_backend, one, f"<tool_call>\n{TIME}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>")


def test_qwen3_coder_calls_are_held_to_the_tools(byte_backend):
    """Qwen3-coder markup (XML parameters): a forced named call's parameters follow the schema (pattern,
    enum, required), a forced "required" call names one of the tools, parallel calls after it are held too,
    and with strict functions the calls the model opens in free text."""
    from radiance.engine.tool_grammars import QWEN3_CODER, strict_tools_grammar, tool_call_grammar

    named = tool_call_grammar(TOOLS, QWEN3_CODER, "get_weather")  # after "<tool_call>\n<function=get_weather>\n"
    params = XML_WEATHER.removeprefix("<function=get_weather>\n").removesuffix("</function>")
    assert matches(byte_backend, named, params + "</function>\n</tool_call>")
    assert not matches(byte_backend, named, params.replace("Rome", "rome") + "</function>\n</tool_call>")
    assert not matches(byte_backend, named, params.replace("celsius", "kelvin") + "</function>\n</tool_call>")
    assert not matches(byte_backend, named, "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")

    required = tool_call_grammar(TOOLS, QWEN3_CODER, parallel=True)  # after "<tool_call>\n"
    after = XML_TIME + "\n</tool_call>"
    assert matches(byte_backend, required, after)
    assert matches(byte_backend, required, after + f"\n<tool_call>\n{XML_WEATHER}\n</tool_call>")
    assert not matches(byte_backend, required, "<function=get_date>\n</function>\n</tool_call>")
    assert not matches(byte_backend, required, after + "\n<tool_call>\n<function=get_date>\n</function>\n</tool_call>")
    assert not matches(byte_backend, tool_call_grammar(TOOLS, QWEN3_CODER), after + f"\n<tool_call>\n{XML_TIME}\n</tool_call>")

    strict = strict_tools_grammar(STRICT_TOOLS, QWEN3_CODER, parallel=False)
    assert matches(byte_backend, strict, "It is sunny.")
    assert matches(byte_backend, strict, f"Let me check.\n<tool_call>\n{XML_WEATHER}\n</tool_call>")
    assert not matches(byte_backend, strict, f"<tool_call>\n{XML_WEATHER.replace('Rome', 'rome')}\n</tool_call>")


# the same calls in GLM-4.5's markup, as its chat template writes them (after "<tool_call>")
GLM_WEATHER = "get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>unit</arg_key>\n" \
              "<arg_value>celsius</arg_value>\n</tool_call>"
GLM_TIME = "get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"


def test_glm45_calls_are_held_to_the_tools(byte_backend):
    """GLM-4.5 markup (xgrammar's glm_xml): a forced named call's values follow the schema (pattern, enum, required),
    GLM-4.7's run-together parts too; a forced "required" call names one of the tools, parallel calls after it are
    held too; with strict functions, the calls the model opens in free text. What the grammar lets through parses."""
    from radiance.engine.tool_grammars import GLM45, strict_tools_grammar, tool_call_grammar
    from radiance.server.tool_parsers import Glm45ToolParser, parse_tool_calls

    named = tool_call_grammar(TOOLS, GLM45, "get_weather")  # after "<tool_call>get_weather\n"
    args = GLM_WEATHER.removeprefix("get_weather\n")
    assert matches(byte_backend, named, args)
    assert matches(byte_backend, named, args.replace("\n", ""))
    assert not matches(byte_backend, named, args.replace("Rome", "rome"))
    assert not matches(byte_backend, named, args.replace("celsius", "kelvin"))
    assert not matches(byte_backend, named, "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>")

    required = tool_call_grammar(TOOLS, GLM45, parallel=True)  # after "<tool_call>"
    assert matches(byte_backend, required, GLM_TIME)
    assert matches(byte_backend, required, GLM_TIME + "\n<tool_call>" + GLM_WEATHER)
    assert not matches(byte_backend, required, "get_date\n</tool_call>")
    assert not matches(byte_backend, tool_call_grammar(TOOLS, GLM45), GLM_TIME + "\n<tool_call>" + GLM_TIME)
    calls = parse_tool_calls(Glm45ToolParser(TOOLS), "<tool_call>" + GLM_TIME + "\n<tool_call>" + GLM_WEATHER).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]

    strict = strict_tools_grammar(STRICT_TOOLS, GLM45, parallel=False)
    assert matches(byte_backend, strict, "It is sunny.")
    assert matches(byte_backend, strict, "Let me check.\n<tool_call>" + GLM_WEATHER)
    assert not matches(byte_backend, strict, "<tool_call>" + GLM_WEATHER.replace("Rome", "rome"))


def test_llama3_json_calls_are_held_to_the_tools(byte_backend):
    """Llama 3.x JSON calls: a forced named call's parameters follow the schema, a forced "required" call
    names one of the tools, and further calls after it (e.g. "; " between them) are held too."""
    from radiance.engine.tool_grammars import LLAMA3_JSON, tool_call_grammar

    named = tool_call_grammar(TOOLS, LLAMA3_JSON, "get_weather")  # after '{"name": "get_weather", "parameters": '
    assert matches(byte_backend, named, '{"city": "Rome", "unit": "celsius"}}')
    assert not matches(byte_backend, named, '{"city": "rome", "unit": "celsius"}}')
    required = tool_call_grammar(TOOLS, LLAMA3_JSON, parallel=True)  # after '{"name": '
    after = '"get_time", "parameters": {"zone": "CET"}}'
    assert matches(byte_backend, required, after)
    assert matches(byte_backend, required, after + '; {"name": "get_weather", "parameters": {"city": "Rome", '
                                                   '"unit": "celsius"}}')
    assert not matches(byte_backend, required, '"get_date", "parameters": {}}')
    assert not matches(byte_backend, required, after + '; {"name": "get_time", "parameters": {"zone": 1}}')


def test_llama3_json_strict_auto_holds_a_call_that_opens_the_answer(byte_backend):
    """Llama 3.x calls are the whole answer: with strict functions under tool_choice auto, an answer that opens
    with "{" is a whole call to one of the tools (a strict function's arguments held to its schema); other
    answers are free text; without parallel calls the answer ends with the first call."""
    from radiance.engine.tool_grammars import LLAMA3_JSON, strict_tools_grammar

    weather = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'
    time = '{"name": "get_time", "parameters": {"zone": "CET"}}'
    parallel = strict_tools_grammar(STRICT_TOOLS, LLAMA3_JSON, parallel=True)
    for text in ("It is sunny.", "", '  Like {"name": "x"} in prose', weather, time, weather + "; " + time,
                 '{"name": "get_time", "parameters": {"anything": [1]}}'):  # get_time is not strict
        assert matches(byte_backend, parallel, text), text
    for text in (weather.replace("Rome", "rome"), '{"name": "get_date", "parameters": {}}', '{"city": "Rome"}',
                 " " + weather, weather + "; " + time.replace("get_time", "get_date")):
        assert not matches(byte_backend, parallel, text), text
    single = strict_tools_grammar(STRICT_TOOLS, LLAMA3_JSON, parallel=False)
    assert matches(byte_backend, single, weather) and matches(byte_backend, single, "It is sunny.")
    assert not matches(byte_backend, single, weather + "; " + time)


def test_qwen3_coder_forced_call_parses_back():
    """What the grammar accepts, the Qwen3-coder parser reads back as the call (values typed by the schema)."""
    from radiance.server.tool_parsers import Qwen3CoderToolParser, parse_tool_calls

    text = f"<tool_call>\n{XML_WEATHER}\n</tool_call>"
    [call] = parse_tool_calls(Qwen3CoderToolParser(TOOLS), text).tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome", "unit": "celsius"}
