"""Conversations in SQLite: every message is committed as it completes, so a crash or kill
mid-reply loses nothing that was finished."""
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nvchat import paths

_SCHEMA = """
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
"""


@dataclass
class ConversationRow:
    id: int
    title: str
    model: str
    system_prompt: str
    created_at: float
    updated_at: float
    num_messages: int


@dataclass
class MessageRow:
    id: int
    role: str
    content: str
    stats: dict | None
    created_at: float


class ChatStore:
    def __init__(self, path: Path | None = None):
        self.path = path or paths.database_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)

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

    def add_message(self, conversation_id: int, role: str, content: str, stats: dict | None = None) -> int:
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                cur = self._db.execute(
                    "INSERT INTO messages (conversation_id, role, content, stats, created_at) VALUES (?, ?, ?, ?, ?)",
                    (conversation_id, role, content, json.dumps(stats) if stats else None, now))
                self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
                self._db.execute("COMMIT")
            except BaseException:
                # Left open, the transaction would swallow every later write of this connection.
                self._db.execute("ROLLBACK")
                raise
            return cur.lastrowid

    def delete_message(self, message_id: int) -> None:
        self._run("DELETE FROM messages WHERE id = ?", (message_id,))

    def rename(self, conversation_id: int, title: str) -> None:
        self._run("UPDATE conversations SET title = ?, updated_at = ? WHERE id = ?", (title, time.time(), conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._run("UPDATE conversations SET system_prompt = ?, updated_at = ? WHERE id = ?",
                  (text, time.time(), conversation_id))

    _CONVERSATION_COLUMNS = ("SELECT c.id, c.title, c.model, c.system_prompt, c.created_at, c.updated_at, "
                             "(SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) FROM conversations c")

    def list_conversations(self) -> list[ConversationRow]:
        rows = self._run(self._CONVERSATION_COLUMNS + " ORDER BY c.updated_at DESC").fetchall()
        return [ConversationRow(*r) for r in rows]

    def get_conversation(self, conversation_id: int) -> ConversationRow:
        row = self._run(self._CONVERSATION_COLUMNS + " WHERE c.id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation with id {conversation_id}")
        return ConversationRow(*row)

    def load_messages(self, conversation_id: int) -> list[MessageRow]:
        rows = self._run("SELECT id, role, content, stats, created_at FROM messages WHERE conversation_id = ? "
                         "ORDER BY id", (conversation_id,)).fetchall()
        return [MessageRow(i, role, content, json.loads(stats) if stats else None, t) for i, role, content, stats, t in rows]

    def delete_conversation(self, conversation_id: int) -> None:
        self._run("DELETE FROM conversations WHERE id = ?", (conversation_id,))
