"""The store's file over time: older schemas migrate, unreadable files are moved aside, search."""
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest

from nvchat.store import _MIGRATIONS, SCHEMA_VERSION, ChatStore, NewerSchemaError, shown_branch

# The schema nvchat wrote before it kept a version (commit f878054), with its data.
_UNVERSIONED = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL,
    system_prompt TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, stats TEXT, created_at REAL NOT NULL);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
INSERT INTO conversations VALUES (1, 'Old chat about llamas', 'demo', 'be brief', 1.0, 2.0);
INSERT INTO messages VALUES (1, 1, 'user', 'tell me about alpacas', NULL, 1.0);
INSERT INTO messages VALUES (2, 1, 'assistant', 'they hum', '{"tokens": 3}', 2.0);
"""


def test_a_database_from_before_schema_versions_opens_migrated(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_UNVERSIONED)
    db.close()
    store = ChatStore(path)
    assert store.moved_aside is None
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    messages = store.load_messages(1)
    assert [(m.role, m.content, m.stats, m.complete) for m in messages] == [
        ("user", "tell me about alpacas", None, True), ("assistant", "they hum", {"tokens": 3}, True)]
    # Old rows are searchable, and new ones are written in the new schema.
    assert [c.id for c in store.search_conversations("alpac")] == [1]
    assert [c.id for c in store.search_conversations("LLAMAS")] == [1]
    reply = store.add_message(1, "assistant", "partial", complete=False)
    store.close()
    again = ChatStore(path)
    assert again.load_messages(1)[-1].complete is False
    assert again._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    again.update_message(reply, "partial and whole", {"tokens": 4}, complete=True)
    assert (again.load_messages(1)[-1].content, again.load_messages(1)[-1].complete) == ("partial and whole", True)
    again.close()


def test_search_finds_titles_and_messages_and_follows_edits(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    first = store.create_conversation("Kernels", "", "demo")
    second = store.create_conversation("Cooking", "", "demo")
    store.add_message(first, "user", "how do Triton kernels launch?")
    reply = store.add_message(second, "assistant", "simmer the onions", complete=False)
    assert [c.id for c in store.search_conversations("kern")] == [first]
    assert [c.id for c in store.search_conversations("triton launch")] == [first]
    assert [c.id for c in store.search_conversations("onions")] == [second]
    assert store.search_conversations('"unbalanced quote') == []  # taken literally, not as FTS syntax
    store.update_message(reply, "fry the garlic")
    assert store.search_conversations("onions") == []
    assert [c.id for c in store.search_conversations("garlic")] == [second]
    store.rename(second, "Dinner")
    assert [c.id for c in store.search_conversations("dinner")] == [second]
    store.delete_conversation(first)
    assert store.search_conversations("triton") == []
    assert {c.id for c in store.search_conversations("  ")} == {second}
    store.close()


def test_an_unreadable_file_is_moved_aside_not_overwritten(tmp_path):
    path = tmp_path / "c.sqlite3"
    garbage = b"this is not a database" * 300
    path.write_bytes(garbage)
    store = ChatStore(path)
    assert store.moved_aside is not None and store.moved_aside.read_bytes() == garbage
    assert store.moved_aside.parent == tmp_path and "corrupt" in store.moved_aside.name
    cid = store.create_conversation("Fresh", "", "demo")
    assert store.get_conversation(cid).title == "Fresh"
    store.close()


def test_a_database_from_a_newer_nvchat_is_refused_untouched(tmp_path):
    path = tmp_path / "c.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    before = path.read_bytes()
    with pytest.raises(NewerSchemaError, match="newer nvchat"):
        ChatStore(path)
    assert path.read_bytes() == before


def test_a_version_4_database_gains_drafts_and_keeps_its_data(tmp_path):
    path = tmp_path / "v4.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_UNVERSIONED)
    for step in _MIGRATIONS[1:4]:  # versions 2-4: complete, the search index, sampling
        db.executescript(step)
    db.executescript("UPDATE conversations SET sampling = '{\"temperature\": 0.2}'; PRAGMA user_version = 4;")
    db.close()
    store = ChatStore(path)
    assert store.moved_aside is None
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 5
    row = store.get_conversation(1)
    assert (row.title, row.sampling, row.num_messages, row.draft) == ("Old chat about llamas", {"temperature": 0.2}, 2, "")
    updated = row.updated_at
    store.set_draft(1, "an unsent\nquestion")
    store.close()
    again = ChatStore(path)
    row = again.get_conversation(1)
    assert (row.draft, row.updated_at) == ("an unsent\nquestion", updated)  # a draft is no new message
    assert [c.draft for c in again.list_conversations()] == ["an unsent\nquestion"]
    assert [c.id for c in again.search_conversations("alpacas")] == [1]
    again.set_draft(1, "")
    assert again.get_conversation(1).draft == ""
    again.close()


# A file written by nvchat's schema-5 store (nvchat/store.py at commit defc967): two conversations,
# one ending in a reply cut off by a kill, with sampling settings; the other with a draft.
SCHEMA_5_FILE = Path(__file__).parent / "data" / "conversations-schema-5.sqlite3"


def test_a_schema_5_file_becomes_one_branch_per_conversation_and_takes_new_branches(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    shutil.copyfile(SCHEMA_5_FILE, path)
    store = ChatStore(path)
    assert store.moved_aside is None
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 6
    llamas, kernels = sorted(c.id for c in store.list_conversations())
    rows = store.load_messages(llamas)
    assert [(m.role, m.content, m.complete) for m in rows] == [
        ("user", "tell me about alpacas", True), ("assistant", "they hum to each other", True),
        ("user", "and llamas?", True), ("assistant", "llamas spit when", False)]
    # Each message follows the one before it, and that one line is the branch shown.
    assert [m.parent_id for m in rows] == [None] + [m.id for m in rows[:-1]]
    assert shown_branch(rows) == rows
    assert [m.content for m in shown_branch(store.load_messages(kernels))] == [
        "how do Triton kernels launch?", "through a grid of programs"]
    assert store.get_conversation(kernels).draft == "and on the CPU"
    assert store.get_conversation(llamas).sampling == {"temperature": 0.2}

    # A regenerated reply to the second question: a sibling of the cut-off one, shown; both kept.
    regenerated = store.add_message(llamas, "assistant", "llamas spit when annoyed", {"tokens": 5},
                                    parent_id=rows[2].id)
    store.close()
    again = ChatStore(path)
    rows = again.load_messages(llamas)
    assert [m.content for m in shown_branch(rows)] == [
        "tell me about alpacas", "they hum to each other", "and llamas?", "llamas spit when annoyed"]
    assert "llamas spit when" in [m.content for m in rows]
    # Choosing the old reply again shows it; every branch is searchable.
    again.select_message(rows[3].id)
    assert shown_branch(again.load_messages(llamas))[-1].content == "llamas spit when"
    assert [c.id for c in again.search_conversations("annoyed")] == [llamas]
    # A message with replies under it can't be deleted alone (nothing is lost by mistake).
    with pytest.raises(sqlite3.IntegrityError):
        again.delete_message(rows[2].id)
    again.delete_message(regenerated)  # a reply nothing follows can
    assert again._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    again.delete_conversation(llamas)  # the whole tree goes with its conversation
    assert again.load_messages(llamas) == []
    again.close()


def test_two_stores_opening_an_old_file_at_once_migrate_it_once(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    shutil.copyfile(SCHEMA_5_FILE, path)
    opened, errors = [], []
    go = threading.Barrier(2)

    def open_store():
        go.wait()
        try:
            opened.append(ChatStore(path))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(opened) == 2
    for store in opened:
        assert len(store.load_messages(1)) == 4 and store.moved_aside is None
        store.close()


def test_an_old_file_that_another_process_is_writing_is_waited_for_not_moved_aside(tmp_path):
    """SQLite refuses the switch to WAL mode at once, without its busy timeout, while another
    connection writes a file in the old journal mode: that is a busy file, not a damaged one."""
    path = tmp_path / "conversations.sqlite3"
    shutil.copyfile(SCHEMA_5_FILE, path)
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    assert writer.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE conversations SET title = 'renamed elsewhere' WHERE id = 1")
    done = threading.Timer(0.3, lambda: writer.execute("COMMIT"))
    done.start()
    try:
        store = ChatStore(path)
    finally:
        done.join()
        writer.close()
    assert store.moved_aside is None and not list(tmp_path.glob("*.corrupt-*"))
    assert store.get_conversation(1).title == "renamed elsewhere" and len(store.load_messages(1)) == 4
    store.close()


def test_a_version_5_database_gains_branches_and_tool_calls_and_keeps_its_data(tmp_path):
    path = tmp_path / "v5.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_UNVERSIONED)
    for step in _MIGRATIONS[1:5]:
        db.executescript(step)
    db.executescript("PRAGMA user_version = 5;")
    db.close()
    store = ChatStore(path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 7
    assert [m.tool_calls for m in store.load_messages(1)] == [None, None]
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    reply = store.add_message(1, "assistant", "", complete=False)
    store.update_message(reply, "", {"tokens": 9}, complete=True, tool_calls=[call])
    store.add_message(1, "tool", "Oslo: sunny", tool_calls=[call])
    store.close()
    again = ChatStore(path)
    assert [(m.role, m.tool_calls) for m in again.load_messages(1)][2:] == [("assistant", [call]), ("tool", [call])]
    assert [c.id for c in again.search_conversations("sunny")] == [1]  # a tool's result is searched too
    again.close()
