"""Conversations in SQLite: a user's message is committed when it is sent, a reply while it
streams (every few seconds) and again when it ends, so a crash or kill mid-reply loses at most the
last few seconds of that reply. A reply that did not end on its own (stopped, failed, or cut off by
a kill) stays marked incomplete. Text typed but not sent is kept as the conversation's draft.

The schema's version is PRAGMA user_version; opening an older file migrates it in place. A file
SQLite cannot read is moved aside (never overwritten) and a fresh one started.
"""
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nvchat import paths

# Each step takes a database from the version before it to its own. Version 1 is the schema nvchat
# wrote before it kept a version (user_version 0), so its statements must accept those files as-is.
_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE IF NOT EXISTS conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        model TEXT NOT NULL,
        system_prompt TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        stats TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
    """,
    # 2: replies saved while they stream; 0 until one ends on its own.
    "ALTER TABLE messages ADD COLUMN complete INTEGER NOT NULL DEFAULT 1;",
    # 3: full-text search over titles and messages (FTS5 indexes kept by triggers).
    """
    CREATE VIRTUAL TABLE message_search USING fts5(content, content='messages', content_rowid='id');
    CREATE VIRTUAL TABLE title_search USING fts5(title, content='conversations', content_rowid='id');
    CREATE TRIGGER messages_ai AFTER INSERT ON messages BEGIN
        INSERT INTO message_search(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
        INSERT INTO message_search(message_search, rowid, content) VALUES ('delete', old.id, old.content);
    END;
    CREATE TRIGGER messages_au AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO message_search(message_search, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO message_search(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER conversations_ai AFTER INSERT ON conversations BEGIN
        INSERT INTO title_search(rowid, title) VALUES (new.id, new.title);
    END;
    CREATE TRIGGER conversations_ad AFTER DELETE ON conversations BEGIN
        INSERT INTO title_search(title_search, rowid, title) VALUES ('delete', old.id, old.title);
    END;
    CREATE TRIGGER conversations_au AFTER UPDATE OF title ON conversations BEGIN
        INSERT INTO title_search(title_search, rowid, title) VALUES ('delete', old.id, old.title);
        INSERT INTO title_search(rowid, title) VALUES (new.id, new.title);
    END;
    INSERT INTO message_search(message_search) VALUES ('rebuild');
    INSERT INTO title_search(title_search) VALUES ('rebuild');
    """,
    # 4: a conversation's own sampling settings (JSON; NULL: the defaults of config.toml).
    "ALTER TABLE conversations ADD COLUMN sampling TEXT;",
    # 5: what the user typed in the conversation's prompt box and has not sent.
    "ALTER TABLE conversations ADD COLUMN draft TEXT NOT NULL DEFAULT '';",
    # 6: tool calls (JSON, OpenAI's tool_calls entries): an assistant message's calls, or for a
    # "tool" message the one call whose result it holds.
    "ALTER TABLE messages ADD COLUMN tool_calls TEXT;",
)
SCHEMA_VERSION = len(_MIGRATIONS)


class NewerSchemaError(RuntimeError):
    """The file was written by a newer nvchat."""


@dataclass
class ConversationRow:
    id: int
    title: str
    model: str
    system_prompt: str
    created_at: float
    updated_at: float
    num_messages: int
    sampling: dict | None = None
    draft: str = ""


@dataclass
class MessageRow:
    id: int
    role: str
    content: str
    stats: dict | None
    created_at: float
    complete: bool = True
    tool_calls: list[dict] | None = None


def _conversation_row(row: tuple) -> ConversationRow:
    *columns, sampling, draft = row
    return ConversationRow(*columns, json.loads(sampling) if sampling else None, draft)


def _fts_query(text: str) -> str:
    """The user's words as an FTS5 query: every word, each as a prefix, taken literally."""
    return " ".join('"' + word.replace('"', '""') + '"*' for word in text.split())


class ChatStore:
    def __init__(self, path: Path | None = None):
        self.path = path or paths.database_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.moved_aside: Path | None = None  # where an unreadable file went, for the app to say
        try:
            self._db = self._open()
        except NewerSchemaError:
            raise
        except sqlite3.DatabaseError:
            self.moved_aside = self._move_aside()
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            self._check_version(db)  # before WAL mode, which rewrites the header
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("quick_check failed")
            self._migrate(db)
        except BaseException:
            db.close()
            raise
        return db

    def _check_version(self, db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise NewerSchemaError(f"{self.path} was written by a newer nvchat (schema version {version}; this one "
                                   f"reads up to {SCHEMA_VERSION}): upgrade nvchat to open it")

    def _migrate(self, db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        for number in range(version + 1, SCHEMA_VERSION + 1):
            # One transaction per step (SQLite's DDL is transactional): a failed step leaves the
            # file at the version before it.
            db.execute("BEGIN")
            try:
                for statement in _statements(_MIGRATIONS[number - 1]):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {number}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            source = Path(str(self.path) + suffix)
            if source.exists():
                source.rename(Path(str(target) + suffix))
        return target

    def _run(self, sql: str, args=()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create_conversation(self, title: str, system_prompt: str, model: str) -> int:
        now = time.time()
        return self._run("INSERT INTO conversations (title, model, system_prompt, created_at, updated_at) "
                         "VALUES (?, ?, ?, ?, ?)", (title, model, system_prompt, now, now)).lastrowid

    def add_message(self, conversation_id: int, role: str, content: str, stats: dict | None = None,
                    complete: bool = True, tool_calls: list[dict] | None = None) -> int:
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                cur = self._db.execute(
                    "INSERT INTO messages (conversation_id, role, content, stats, created_at, complete, tool_calls) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (conversation_id, role, content, json.dumps(stats) if stats else None, now, int(complete),
                     json.dumps(tool_calls) if tool_calls else None))
                self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
                self._db.execute("COMMIT")
            except BaseException:
                # Left open, the transaction would swallow every later write of this connection.
                self._db.execute("ROLLBACK")
                raise
            return cur.lastrowid

    def update_message(self, message_id: int, content: str, stats: dict | None = None,
                       complete: bool = False, tool_calls: list[dict] | None = None) -> None:
        """A reply's text so far (complete=False) or its final text, numbers and calls."""
        self._run("UPDATE messages SET content = ?, stats = ?, complete = ?, tool_calls = ? WHERE id = ?",
                  (content, json.dumps(stats) if stats else None, int(complete),
                   json.dumps(tool_calls) if tool_calls else None, message_id))

    def delete_message(self, message_id: int) -> None:
        self._run("DELETE FROM messages WHERE id = ?", (message_id,))

    def rename(self, conversation_id: int, title: str) -> None:
        self._run("UPDATE conversations SET title = ?, updated_at = ? WHERE id = ?", (title, time.time(), conversation_id))

    def set_sampling(self, conversation_id: int, sampling: dict | None) -> None:
        self._run("UPDATE conversations SET sampling = ?, updated_at = ? WHERE id = ?",
                  (json.dumps(sampling) if sampling else None, time.time(), conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._run("UPDATE conversations SET system_prompt = ?, updated_at = ? WHERE id = ?",
                  (text, time.time(), conversation_id))

    def set_draft(self, conversation_id: int, text: str) -> None:
        """The conversation's unsent text ("" once sent). Leaves updated_at alone: a draft is no new message."""
        self._run("UPDATE conversations SET draft = ? WHERE id = ?", (text, conversation_id))

    _CONVERSATION_COLUMNS = ("SELECT c.id, c.title, c.model, c.system_prompt, c.created_at, c.updated_at, "
                             "(SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id), c.sampling, c.draft "
                             "FROM conversations c")

    def list_conversations(self) -> list[ConversationRow]:
        rows = self._run(self._CONVERSATION_COLUMNS + " ORDER BY c.updated_at DESC").fetchall()
        return [_conversation_row(r) for r in rows]

    def get_conversation(self, conversation_id: int) -> ConversationRow:
        row = self._run(self._CONVERSATION_COLUMNS + " WHERE c.id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation with id {conversation_id}")
        return _conversation_row(row)

    def load_messages(self, conversation_id: int) -> list[MessageRow]:
        rows = self._run("SELECT id, role, content, stats, created_at, complete, tool_calls FROM messages "
                         "WHERE conversation_id = ? ORDER BY id", (conversation_id,)).fetchall()
        return [MessageRow(i, role, content, json.loads(stats) if stats else None, t, bool(complete),
                           json.loads(calls) if calls else None)
                for i, role, content, stats, t, complete, calls in rows]

    def search_conversations(self, text: str) -> list[ConversationRow]:
        """Conversations whose title or any message has every word of text (as word prefixes)."""
        query = _fts_query(text)
        if not query:
            return self.list_conversations()
        rows = self._run(
            self._CONVERSATION_COLUMNS + " WHERE c.id IN (SELECT rowid FROM title_search WHERE title_search MATCH ?)"
            " OR c.id IN (SELECT m.conversation_id FROM messages m JOIN message_search s ON s.rowid = m.id"
            " WHERE message_search MATCH ?) ORDER BY c.updated_at DESC", (query, query)).fetchall()
        return [_conversation_row(r) for r in rows]

    def delete_conversation(self, conversation_id: int) -> None:
        self._run("DELETE FROM conversations WHERE id = ?", (conversation_id,))


def _statements(script: str) -> list[str]:
    """A migration script's statements, whole (a trigger's body holds semicolons of its own)."""
    statements, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            if current.strip():
                statements.append(current.strip())
            current = ""
    return statements
