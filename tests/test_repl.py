"""The plain REPL, driven key by key through prompt-toolkit's pipe input against a real engine
running the demo model. The REPL runs on its own thread; the test types into the pipe and waits
(bounded) for what the REPL writes to its output stream or stores."""
import re
import threading
import time

import pytest
from prompt_toolkit.application import create_app_session
from prompt_toolkit.history import FileHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from engine import EngineThread
from nvchat import paths
from nvchat.mcp_tools import DECLINED
from nvchat.repl import Repl
from nvchat.settings import DEFAULT_SYSTEM_PROMPT, Settings
from nvchat.store import ChatStore
from tests.conftest import MCP_TEST_SERVER, force_tool_calls

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def engine(demo_model_path):
    with EngineThread(str(demo_model_path), device="cpu", max_model_len=4096) as engine:
        yield engine


@pytest.fixture(autouse=True)
def xdg_dirs(tmp_path, monkeypatch):
    for name in ("XDG_DATA_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))


class Capture:
    """The REPL's output stream; writes wake whoever waits on it."""

    def __init__(self):
        self._parts: list[str] = []
        self.cond = threading.Condition()

    def write(self, text: str) -> int:
        with self.cond:
            self._parts.append(text)
            self.cond.notify_all()
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        with self.cond:
            return "".join(self._parts)


class Driver:
    """A Repl on its own thread, reading keys from a pipe."""

    def __init__(self, engine, settings: Settings):
        self.out = Capture()
        self.store = ChatStore()
        self._pipe_cm = create_pipe_input()
        self.pipe = self._pipe_cm.__enter__()
        self.repl: Repl | None = None
        self.exit_code: int | None = None
        ready = threading.Event()

        def run():
            with create_app_session(input=self.pipe, output=DummyOutput()):
                self.repl = Repl(engine, settings, store=self.store, out=self.out,
                                 history=FileHistory(str(paths.repl_history_file())))
                ready.set()
                self.exit_code = self.repl.run()

        paths.repl_history_file().parent.mkdir(parents=True, exist_ok=True)
        self.thread = threading.Thread(target=run, name="repl-under-test", daemon=True)
        self.thread.start()
        assert ready.wait(TIMEOUT_S), "the REPL did not start"
        self.wait_for(lambda: "/help lists commands" in self.out.text, "the banner")

    def type(self, keys: str) -> None:
        self.pipe.send_text(keys)

    def wait_for(self, predicate, what: str, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        with self.out.cond:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, f"timed out waiting for {what}; REPL output so far:\n{self.out.text}"
                # Output-based conditions wake at once; state-based ones are re-checked often.
                self.out.cond.wait(min(left, 0.05))

    def wait_for_messages(self, n: int) -> None:
        self.wait_for(lambda: len(self.repl.conversation.messages) >= n, f"{n} stored messages")

    def close(self) -> None:
        if self.thread.is_alive():
            if self.repl.streaming is not None:
                self.repl.streaming.abort()
            self.pipe.close()  # end of input: the prompt raises EOFError and the REPL returns
            self.thread.join(TIMEOUT_S)
        self._pipe_cm.__exit__(None, None, None)
        self.store.close()


class FixedLengthSettings(Settings):
    """Replies run to max_tokens. Otherwise the demo model stops whenever it draws its end-of-turn
    token: sampled, at random; greedy, at a token that depends on the CPU, since its logits are
    near-ties that the CPU's float rounding settles (greedy "x" ended after 64 tokens on one CI
    machine and ran to 2,000 on another)."""

    def sampling_params(self, recommended=None, **overrides):
        return super().sampling_params(recommended, ignore_eos=True, **overrides)


@pytest.fixture
def drive(engine):
    drivers = []

    def start(fixed_length: bool = False, **settings) -> Driver:
        kind = FixedLengthSettings if fixed_length else Settings
        driver = Driver(engine, kind(**{"model": "demo", "temperature": 0.0, "max_tokens": 12, **settings}))
        drivers.append(driver)
        return driver

    yield start
    for driver in drivers:
        driver.close()


def test_message_streams_reply_stores_it_and_writes_history(drive):
    d = drive()
    mark = len(d.out.text)
    d.type("hello\r")
    d.wait_for_messages(2)
    stream = d.repl.last_stream
    assert stream.finish_reason in ("stop", "length") and stream.text
    assert d.out.text[mark:].startswith(stream.text), "the reply streams to the REPL's output as plain text"

    # Meta+Enter and Ctrl-J add new lines; only Enter sends.
    d.type("one\x1b\rtwo\nthree\r")
    d.wait_for_messages(4)
    conversation = d.repl.conversation
    assert conversation.messages[2].content == "one\ntwo\nthree"

    stored = d.store.load_messages(conversation.id)
    assert [(m.role, m.content) for m in stored] == [(m.role, m.content) for m in conversation.messages]
    assert stored[1].content == stream.text and stored[1].stats["tokens"] == stream.num_completion_tokens
    assert d.store.get_conversation(conversation.id).title == "hello"

    history = paths.repl_history_file().read_text()
    assert "+hello" in history and "+one\n+two\n+three" in history


def test_ctrl_c_stops_the_reply(drive):
    # The reply runs to max_tokens, far longer than the test needs.
    d = drive(max_tokens=2000, system_prompt=DEFAULT_SYSTEM_PROMPT, fixed_length=True)
    mark = len(d.out.text)
    d.type("x\r")
    d.wait_for(lambda: len(d.out.text) > mark + 8, "the reply to start streaming")
    d.type("\x03")
    d.wait_for_messages(2)
    stream = d.repl.last_stream
    assert stream.finish_reason == "abort", f"the reply ended by itself ({stream.finish_reason}) before Ctrl-C"
    assert stream.num_completion_tokens < 2000
    # Written once the reply is stored, so after the message count above.
    d.wait_for(lambda: f"[stopped after {stream.num_completion_tokens} tokens]" in d.out.text, "the stop's footer")
    assert d.out.text[mark:].startswith(stream.text)
    stored = d.store.load_messages(d.repl.conversation.id)
    assert stored[-1].stats["finish_reason"] == "abort" and stored[-1].content == stream.text
    assert d.thread.is_alive(), "stopping a reply does not quit"


def test_a_reply_is_stored_while_it_streams(drive):
    # The reply runs to max_tokens: seconds of streaming on CPU.
    d = drive(max_tokens=2000, system_prompt=DEFAULT_SYSTEM_PROMPT, fixed_length=True)
    d.type("x\r")
    d.wait_for(lambda: d.repl.streaming is not None, "the reply to start")

    def stored_so_far():
        conversation_id = d.repl.conversation.id
        rows = d.store.load_messages(conversation_id) if conversation_id is not None else []
        return [r for r in rows if r.role == "assistant"]
    d.wait_for(lambda: stored_so_far(), "the reply stored before it ends")
    [row] = stored_so_far()
    assert not row.complete and row.content and d.repl.streaming is not None, "stored while it streams"
    d.type("\x03")
    d.wait_for_messages(2)
    [row] = stored_so_far()
    assert row.content == d.repl.last_stream.text and row.stats["finish_reason"] == "abort"


def test_system_command_changes_the_next_turn(drive, engine):
    d = drive(max_tokens=4)
    d.type("hello\r")
    d.wait_for_messages(2)
    first, reply = d.repl.last_stream, d.repl.conversation.messages[1].content
    d.type("/system Talk like a pirate.\r")
    d.wait_for(lambda: "system prompt set" in d.out.text, "/system's confirmation")
    d.type("hi\r")
    d.wait_for_messages(4)
    second = d.repl.last_stream

    def prompt_tokens(system: str, *turns: str) -> int:
        roles = ["user", "assistant"] * len(turns)
        messages = [{"role": "system", "content": system}] + [{"role": r, "content": t} for r, t in zip(roles, turns)]
        return len(engine.llm.encode(engine.llm.render_chat(messages)))

    assert first.num_prompt_tokens == prompt_tokens(DEFAULT_SYSTEM_PROMPT, "hello")
    assert second.num_prompt_tokens == prompt_tokens("Talk like a pirate.", "hello", reply, "hi")
    assert d.store.get_conversation(d.repl.conversation.id).system_prompt == "Talk like a pirate."
    d.type("/system\r")
    d.wait_for(lambda: "system prompt: Talk like a pirate." in d.out.text, "/system showing the prompt")


def test_stats_save_new_and_unknown_commands(drive, engine):
    d = drive()
    d.type("hello\r")
    d.wait_for_messages(2)
    d.type("again\r")
    d.wait_for_messages(4)
    last = d.repl.last_stream
    assert last.num_cached_tokens > 0, "the second turn reuses the first one's KV blocks"

    d.type("/stats\r")
    d.wait_for(lambda: "prefix cache:" in d.out.text and "last reply:" in d.out.text, "/stats output")
    stats = d.out.text[d.out.text.index("KV cache:"):]
    blocks = re.search(r"KV cache: (\d+)/(\d+) blocks in use \((\d+) tokens each\), (\d+) free but cached", stats)
    assert blocks and int(blocks[2]) == engine.stats().num_blocks and int(blocks[3]) == engine.stats().block_size
    assert int(blocks[4]) > 0, "finished turns leave their blocks cached for reuse"
    hits = re.search(r"prefix cache: (\d+)/(\d+) prompt tokens reused \((\d+\.\d)% hit rate\)", stats)
    assert hits and int(hits[1]) >= last.num_cached_tokens and int(hits[2]) > 0
    assert re.search(r"MiB of \d+\.\d MiB", stats)
    assert (f"last reply: {last.num_completion_tokens} tokens" in stats
            and f"prompt {last.num_prompt_tokens} tokens, {last.num_cached_tokens} from the prefix cache" in stats)

    d.type("/save\r")
    d.wait_for(lambda: "saved to " in d.out.text, "/save's path")
    saved = re.search(r"saved to (.+\.md)\n", d.out.text)[1]
    markdown = open(saved).read()
    assert "## User\n\nhello" in markdown and last.text in markdown
    assert saved.startswith(str(paths.data_dir()))

    d.type("/frobnicate\r")
    d.wait_for(lambda: "unknown command /frobnicate" in d.out.text, "the unknown-command message")

    old_id = d.repl.conversation.id
    d.type("/new\rfresh\r")
    d.wait_for(lambda: d.repl.conversation.id not in (None, old_id) and len(d.repl.conversation.messages) == 2,
               "a reply in a new conversation")
    assert [m.content for m in d.repl.conversation.messages][0] == "fresh"
    assert len(d.store.list_conversations()) == 2


def test_double_slash_sends_a_leading_slash_and_rename_and_app_commands(drive):
    d = drive()
    d.type("/rename Slash talk\r")
    d.wait_for(lambda: "renamed to Slash talk" in d.out.text, "/rename's confirmation")
    d.type("//etc/hosts is a path\r")
    d.wait_for_messages(2)
    assert d.repl.conversation.messages[0].content == "/etc/hosts is a path"
    assert d.repl.conversation.title == "Slash talk", "the first message does not retitle a renamed chat"
    assert [c.title for c in d.store.list_conversations()] == ["Slash talk"]
    d.type("/stop\r")
    d.wait_for(lambda: "/stop is an app command" in d.out.text, "the app-only notice")
    d.type("/help\r")
    d.wait_for(lambda: "/rename TITLE" in d.out.text and "keys:" in d.out.text, "/help")
    assert "/stop " not in d.out.text[d.out.text.index("commands:"):], "/help lists the REPL's commands"
    assert len(d.repl.conversation.messages) == 2


def test_second_ctrl_c_at_an_empty_prompt_quits(drive):
    d = drive()
    d.type("some text\x03")  # Ctrl-C with text on the line clears it
    d.type("\x03")
    d.wait_for(lambda: "press Ctrl-C again to quit" in d.out.text, "the quit hint")
    assert d.thread.is_alive()
    d.type("\x03")
    d.thread.join(TIMEOUT_S)
    assert not d.thread.is_alive() and d.exit_code == 0
    assert d.repl.conversation.messages == [] and d.out.text.count("press Ctrl-C again") == 1


def stored_tree(d) -> list[tuple[str, str, int | None]]:
    """Every message of the conversation in the store, every branch: (role, text, parent row)."""
    return [(m.role, m.content, m.parent_id) for m in d.store.load_messages(d.repl.conversation.id)]


def test_regenerate_branch_and_edit_keep_every_message(drive):
    d = drive(temperature=0.9, max_tokens=8)
    d.type("hello\r")
    d.wait_for_messages(2)
    first_reply = d.repl.conversation.messages[1]

    d.type("/regenerate\r")
    d.wait_for(lambda: "[the reply is branch 2/2" in d.out.text, "/regenerate's note")
    conversation = d.repl.conversation
    second_reply = conversation.messages[1]
    assert len(conversation.messages) == 2 and second_reply is not first_reply
    assert conversation.siblings(second_reply) == [first_reply, second_reply]

    mark = len(d.out.text)
    d.type("/branch prev\r")
    d.wait_for(lambda: "[branch 1/2 of message 2]" in d.out.text, "/branch's note")
    assert d.repl.conversation.messages[1] is first_reply
    assert first_reply.content.rstrip("\n") in d.out.text[mark:], "the branch switched to is printed"

    d.type("/edit\r")
    d.wait_for(lambda: "editing your last message" in d.out.text, "/edit's note")
    d.type(" there\r")  # the prompt starts with the message: typing goes on after it
    d.wait_for(lambda: "[your message is branch 2/2" in d.out.text, "the edit's note")
    messages = d.repl.conversation.messages
    assert [m.content for m in messages][0] == "hello there" and len(messages) == 2

    roles = [(role, text) for role, text, _ in stored_tree(d)]
    assert roles.count(("user", "hello")) == 1 and ("user", "hello there") in roles and len(roles) == 5, \
        "every branch stays in the store"

    # Ctrl-C clearing the line gives the edit up: the next line is a new message, not an edit.
    d.type("/edit\r")
    d.wait_for(lambda: d.out.text.count("editing your last message") == 2, "the second /edit")
    d.type("\x03")
    d.type("new turn\r")
    d.wait_for_messages(4)
    assert [m.content for m in d.repl.conversation.messages][::2] == ["hello there", "new turn"]


def test_alternatives_come_at_once_and_pick_keeps_one(drive):
    d = drive(temperature=1.0, max_tokens=6)
    d.type("/alt 3\r")
    d.wait_for(lambda: "error: nothing to regenerate" in d.out.text, "the refusal with no message yet")
    d.type("hi\r")
    d.wait_for_messages(2)
    d.type("/alt 3\r")
    d.wait_for(lambda: "/pick N keeps another" in d.out.text, "the alternatives")
    out = d.out.text
    assert out.index("[alternative 2 of 3]") < out.index("[alternative 3 of 3]")
    alternatives = d.repl.alternatives
    conversation = d.repl.conversation
    assert len(alternatives) == 3 and conversation.messages[-1] is alternatives[0]
    assert conversation.siblings(alternatives[0])[-3:] == alternatives

    d.type("/pick 3\r")
    d.wait_for(lambda: "alternative 3 is the reply shown now" in d.out.text, "/pick's note")
    assert conversation.messages[-1] is alternatives[2]
    d.type("/pick 9\r")
    d.wait_for(lambda: "no alternative '9' to pick" in d.out.text, "/pick's refusal")
    d.type("/alt 7\r")
    d.wait_for(lambda: "/alt takes how many replies: 2 to 4, not '7'" in d.out.text, "/alt's refusal")

    # The next turn follows the reply picked.
    d.type("more\r")
    d.wait_for_messages(4)
    assert d.repl.conversation.messages[1] is alternatives[2]
    assert stored_tree(d)[-2][2] == alternatives[2].id, "the new message answers the reply picked"


def test_ctrl_c_stops_every_alternative(drive):
    d = drive(temperature=1.0, max_tokens=2000, system_prompt=DEFAULT_SYSTEM_PROMPT, fixed_length=True)
    d.type("x\r")
    d.wait_for(lambda: d.repl.streaming is not None, "the first reply to start")
    d.type("\x03")
    d.wait_for_messages(2)
    mark = len(d.out.text)
    d.type("/alt 2\r")
    d.wait_for(lambda: len(d.out.text) > mark + 16, "the alternatives to start streaming")
    d.type("\x03")
    d.wait_for(lambda: "/pick N keeps another" in d.out.text, "the alternatives' end")
    assert [m.stats["finish_reason"] for m in d.repl.alternatives] == ["abort", "abort"]
    assert d.out.text.count("[stopped after") == 3


def test_file_goes_into_the_next_message_and_sampling_is_the_chats_own(drive, tmp_path):
    d = drive()
    notes = tmp_path / "notes.py"
    notes.write_text("print(42)\n")
    d.type(f"/file {notes}\r")
    d.wait_for(lambda: "is in the next message" in d.out.text, "/file's note")
    assert re.search(r"notes\.py \(\d+ tokens\) is in the next message", d.out.text)
    d.type("what does it print?\r")
    d.wait_for_messages(2)
    sent = d.repl.conversation.messages[0].content
    assert sent == f"{notes}:\n```py\nprint(42)\n```\nwhat does it print?"

    (tmp_path / "blob").write_bytes(b"\x00\x01")
    d.type(f"/file {tmp_path / 'blob'}\r")
    d.wait_for(lambda: "is a binary file, not text" in d.out.text, "/file's refusal")
    d.type("/file\r")
    d.wait_for(lambda: "usage: /file PATH" in d.out.text, "/file's usage")

    d.type("/sampling temperature=0.3 top-k=5\r")
    d.wait_for(lambda: "temperature 0.3 (this chat's)" in d.out.text, "/sampling's values")
    assert "top_k 5 (this chat's)" in d.out.text and "top_p 0.95," in d.out.text
    conversation_id = d.repl.conversation.id
    assert d.store.get_conversation(conversation_id).sampling == {"temperature": 0.3, "top_k": 5}
    d.type("/sampling top_p=2\r")
    d.wait_for(lambda: "error: top_p" in d.out.text, "the bad value's error")
    d.type("/sampling warmth=3\r")
    d.wait_for(lambda: "not 'warmth=3'" in d.out.text, "the unknown name's error")
    assert d.repl.conversation.sampling == {"temperature": 0.3, "top_k": 5}
    d.type("/sampling reset\r")
    d.wait_for(lambda: d.repl.conversation.sampling == {}, "the reset")
    assert d.store.get_conversation(conversation_id).sampling is None, "no values of its own"


def tools_ready(d, *servers: str) -> None:
    d.wait_for(lambda: all(d.repl.tools.tools.status.get(s) != "starting" for s in servers), "the MCP servers")


def stored_roles(d) -> list[str]:
    return [m.role for m in d.store.load_messages(d.repl.conversation.id)]


def test_tool_calls_are_asked_about_run_and_fed_back_and_always_asks_no_more(drive, monkeypatch):
    force_tool_calls(monkeypatch, "weather", rounds=2)
    d = drive(max_tokens=96, mcp_servers=MCP_TEST_SERVER | {"gone": {"command": "/nonexistent/mcp-server"}})
    tools_ready(d, "test", "gone")
    d.type("what is the weather\r")
    d.wait_for(lambda: d.repl.tools.asking == "weather", "the question about the call")
    assert re.search(r'\[tool call: weather\(\{"city": "(Paris|Oslo)"\}\)\]', d.out.text)
    d.type("a\r")  # always: the second round's call runs without a question (none would be answered)
    d.wait_for(lambda: d.repl.streaming is None and stored_roles(d)[-1:] == ["assistant"] and len(stored_roles(d)) == 6,
               "the turn's end")
    assert stored_roles(d) == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    results = [m.content for m in d.store.load_messages(d.repl.conversation.id) if m.role == "tool"]
    assert all(r in ("Paris: 21 degrees and sunny", "Oslo: 21 degrees and sunny") for r in results)
    assert d.out.text.count("[result]\n  ") == 2 and results[0] in d.out.text
    assert d.repl.conversation.messages[-1].content and d.repl.last_stream.finish_reason == "length"
    d.type("/stats\r")  # a prompt comes back, and the failed server's report with it
    d.wait_for(lambda: "[MCP server gone could not start:" in d.out.text and "last reply:" in d.out.text,
               "the failed server's report")


def test_a_declined_call_tells_the_model_and_ctrl_c_at_the_question_ends_the_turn(drive, monkeypatch):
    force_tool_calls(monkeypatch, "weather", rounds=1)
    d = drive(max_tokens=96, mcp_servers=MCP_TEST_SERVER)
    tools_ready(d, "test")
    d.type("no\r")
    d.wait_for(lambda: d.repl.tools.asking == "weather", "the question")
    d.type("maybe\r")  # not an answer: asked again
    d.type("n\r")
    d.wait_for(lambda: len(stored_roles(d)) == 4 and d.repl.streaming is None, "the reply after the refusal")
    messages = d.store.load_messages(d.repl.conversation.id)
    assert messages[2].content == DECLINED.text and messages[2].stats == {"error": True}
    assert "[declined]" in d.out.text

    d.type("again\r")
    d.wait_for(lambda: d.repl.tools.asking == "weather", "the second turn's question")
    d.type("\x03")
    d.wait_for(lambda: "[not run; the turn ends here]" in d.out.text, "the turn ended at the question")
    assert stored_roles(d) == ["user", "assistant", "tool", "assistant", "user", "assistant", "tool"]
    d.type("/rename still here\r")
    d.wait_for(lambda: "renamed to still here" in d.out.text, "the REPL going on")


def test_every_repl_command_has_a_handler():
    from nvchat import repl_slash_handlers, slash_table
    assert set(repl_slash_handlers.HANDLERS) == {c.name for c in slash_table.commands_for(slash_table.REPL)}
