"""The store's file over time: older schemas migrate, unreadable files are moved aside, search."""
import sqlite3

import pytest

from nvchat.store import _MIGRATIONS, SCHEMA_VERSION, ChatStore, NewerSchemaError

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


def test_a_version_5_database_gains_tool_calls_and_keeps_its_data(tmp_path):
    path = tmp_path / "v5.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_UNVERSIONED)
    for step in _MIGRATIONS[1:5]:
        db.executescript(step)
    db.executescript("PRAGMA user_version = 5;")
    db.close()
    store = ChatStore(path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 6
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
