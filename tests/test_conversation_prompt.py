"""A conversation's turn renders and tokenizes its prompt once and submits those token ids; a history
too long for the context leaves out its oldest turns, keeping the system prompt and the last message."""
import math

import pytest

from engine import EngineThread
from nvchat.conversation import Conversation
from nvchat.settings import Settings

CONTEXT = 256


class TokenizerCalls:
    """Counts the real tokenizer's chat-template renders and encodes; every call goes through to it."""

    def __init__(self, tokenizer, monkeypatch):
        self.renders = self.encodes = 0
        render, encode = tokenizer.apply_chat_template, tokenizer.encode

        def counted_render(*args, **kwargs):
            self.renders += 1
            return render(*args, **kwargs)

        def counted_encode(*args, **kwargs):
            self.encodes += 1
            return encode(*args, **kwargs)

        monkeypatch.setattr(tokenizer, "apply_chat_template", counted_render)
        monkeypatch.setattr(tokenizer, "encode", counted_encode)

    def during(self, call):
        """(renders, encodes) that call made, and what it returned."""
        renders, encodes = self.renders, self.encodes
        result = call()
        return (self.renders - renders, self.encodes - encodes), result


@pytest.fixture(scope="module")
def engine(demo_model_path):
    with EngineThread(str(demo_model_path), device="cpu", max_model_len=CONTEXT, max_num_seqs=4) as engine:
        yield engine


@pytest.fixture
def calls(engine, monkeypatch):
    return TokenizerCalls(engine.llm.tokenizer, monkeypatch)


def conversation(engine, max_tokens=8) -> Conversation:
    settings = Settings(model="demo", temperature=0.0, max_tokens=max_tokens)
    return Conversation(engine, None, system_prompt="Be brief.", model_name="demo", settings=settings)


def turn(calls, chat: Conversation, text: str):
    """Sends text, waits for the reply and keeps it; returns the tokenizer calls the send made and its stream."""
    counted, stream = calls.during(lambda: chat.send(text))
    assert stream.wait(60) and stream.finish_reason in ("stop", "length")
    chat.finish_reply(stream)
    return counted, stream


def test_a_turn_that_fits_renders_and_tokenizes_its_prompt_once(engine, calls):
    chat = conversation(engine)
    for text in ("hello", "and again", "once more"):
        counted, stream = turn(calls, chat, text)
        assert counted == (1, 1)
        kept = chat.engine_messages(chat.messages[:-1])
        assert stream.num_prompt_tokens == len(engine.tokenize_chat(kept)) and chat.left_out == 0
    counted, figure = calls.during(chat.context_tokens)
    assert counted == (1, 1) and figure == len(engine.tokenize_chat(chat.engine_messages()))


def test_a_history_past_the_context_leaves_out_its_oldest_turns_in_a_few_renders(engine, calls):
    chat = conversation(engine)
    budget = CONTEXT - min(chat.sampling_params().max_tokens, CONTEXT // 4)
    trimmed = 0
    for n in range(12):
        counted, stream = turn(calls, chat, f"message {n}: " + "words to fill the context " * 2)
        sent = chat.messages[:-1]  # the history this turn answered
        kept = sent[chat.left_out:]
        # The oracle: the earliest user message from which the rest fits, tried one by one.
        starts = [i for i, m in enumerate(sent) if i > 0 and m.role == "user"]
        fitting = [i for i in [0, *starts] if len(engine.tokenize_chat(chat.engine_messages(sent[i:]))) <= budget]
        assert chat.left_out == fitting[0]
        assert kept[-1].role == "user" and kept[-1].content.startswith(f"message {n}:")
        assert stream.num_prompt_tokens == len(engine.tokenize_chat(chat.engine_messages(kept))) <= budget
        if chat.left_out:
            trimmed += 1
            assert kept[0].role == "user"
            # One render of the whole history, one per step of the search, and at most one more.
            assert counted[0] == counted[1] <= 2 + math.ceil(math.log2(len(starts)))
        else:
            assert counted == (1, 1)
    assert trimmed >= 3
