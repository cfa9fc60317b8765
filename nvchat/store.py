"""Conversations in SQLite: a user's message is committed when it is sent, a reply while it
streams (every few seconds) and again when it ends, so a crash or kill mid-reply loses at most the
last few seconds of that reply. A reply that did not end on its own (stopped, failed, or cut off by
a kill) stays marked incomplete. Text typed but not sent is kept as the conversation's draft.

A conversation's messages form a tree: each has a parent (None for a first message), and editing a
message or regenerating a reply adds a sibling rather than replacing it, so no message is ever
overwritten. The branch shown is found by walking down from the roots, taking at each level the
child selected last (selected_at: set when a message is written or chosen).

The schema's version is PRAGMA user_version; opening an older file migrates it in place. A file
SQLite cannot read is moved aside (never overwritten) and a fresh one started.

Several nvchat processes may share the file (SQLite's WAL mode serializes their writes), but one
conversation has one writer: the process that opens or starts it takes its writer lock
(lock_for_writing), and another process that opens it while the lock is held gets it read-only.
The lock is the operating system's lock on a small file beside the database, so it goes with the
process however that ends, kill -9 included. Deleting a conversation deletes its lock file too,
unless another process holds the lock.
"""
import json
import os
import sqlite3
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: msvcrt's byte-range locks instead
    fcntl = None
    import msvcrt

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
    # 6: branches. Each message's parent (NULL: a first message), and when it was last selected
    # among its siblings. A linear conversation becomes one branch: each message's parent is the
    # one before it. No ON DELETE action: a message with replies under it can't be deleted alone.
    """
    ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id);
    ALTER TABLE messages ADD COLUMN selected_at REAL NOT NULL DEFAULT 0;
    UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p
                                     WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id),
                        selected_at = created_at;
    CREATE INDEX messages_by_parent ON messages(parent_id);
    """,
    # 7: tool calls (JSON, OpenAI's tool_calls entries): an assistant message's calls, or for a
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
    parent_id: int | None = None  # the message this one answers or follows; None for a first message
    selected_at: float = 0.0  # when it was written or last chosen among its siblings
    tool_calls: list[dict] | None = None


class _AfterNewest:
    def __repr__(self) -> str:
        return "AFTER_NEWEST"


# add_message's default parent: the conversation's newest message.
AFTER_NEWEST = _AfterNewest()


def shown_branch(rows: list[MessageRow]) -> list[MessageRow]:
    """The branch shown of a conversation's messages: from the first messages down, at each level
    the child selected last (the later id where two were selected at the same time)."""
    children: dict[int | None, list[MessageRow]] = {}
    for row in rows:
        children.setdefault(row.parent_id, []).append(row)
    branch, level = [], children.get(None)
    while level:
        chosen = max(level, key=lambda r: (r.selected_at, r.id))
        branch.append(chosen)
        level = children.get(chosen.id)
    return branch


def _still_named(fd: int, path: Path) -> bool:
    """Whether path still names the file open as fd (remove_file may have deleted it meanwhile)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


# The writer locks this process holds, by file: remove_file deletes the file of one of them, which
# a new lock of this process could not take (a second descriptor's flock conflicts with the first).
_held_here: "weakref.WeakValueDictionary[str, WriterLock]" = weakref.WeakValueDictionary()
_held_here_guard = threading.Lock()


class WriterLock:
    """One conversation's writer lock, held until release() or the process ends."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: Path) -> "WriterLock | None":
        """The lock on path, or None while another holder has it (another process, or another
        lock object of this one)."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                else:
                    msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            except OSError:  # held elsewhere (BlockingIOError on POSIX, PermissionError on Windows)
                os.close(fd)
                return None
            # A file deleted by remove_file between the open and the lock guards nothing: a later
            # taker creates and locks a new one. Windows deletes no open file, so there it is named.
            if fcntl is None or _still_named(fd, path):
                break
            os.close(fd)
        # For the note the other process shows: which process writes here.
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(os.getpid()).encode())
        lock = cls(path, fd)
        with _held_here_guard:
            _held_here[os.path.abspath(path)] = lock
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            with _held_here_guard:  # not let go while remove_file deletes the file as this process's
                if _held_here.get(os.path.abspath(self.path)) is self:
                    del _held_here[os.path.abspath(self.path)]
                os.close(self._fd)  # closing the only descriptor drops the lock
                self._fd = None

    @classmethod
    def remove_file(cls, path: Path) -> bool:
        """Deletes the lock file where this process holds its lock or nobody does; one that another
        process holds stays, guarding that process's writes. True if no file is left."""
        if not path.exists():
            return True
        if fcntl is None:
            # Windows deletes no file that is open, so this fails while anyone holds the lock (this
            # process too), and a taker that opens the file first keeps it.
            try:
                os.unlink(path)
            except OSError:
                return False
            return True
        # Deleted while held, here or by a lock taken for it: a process that opened the file before
        # takes the lock only after that, and take() then sees the file is no longer the path's.
        with _held_here_guard:
            if os.path.abspath(path) in _held_here:
                path.unlink(missing_ok=True)
                return True
        taken = cls.take(path)
        if taken is None:  # another process holds it
            return False
        try:
            path.unlink(missing_ok=True)
        finally:
            taken.release()
        return True


def _conversation_row(row: tuple) -> ConversationRow:
    *columns, sampling, draft = row
    return ConversationRow(*columns, json.loads(sampling) if sampling else None, draft)


def _fts_query(text: str) -> str:
    """The user's words as an FTS5 query: every word, each as a prefix, taken literally."""
    return " ".join('"' + word.replace('"', '""') + '"*' for word in text.split())


# How long opening the file waits for another process's write to end (sqlite3.connect's default).
_BUSY_TIMEOUT_S = 5.0


def _is_busy(error: sqlite3.DatabaseError) -> bool:
    return getattr(error, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _switch_to_wal(db: sqlite3.Connection) -> None:
    """Puts the file in WAL mode. The switch needs the file to itself, and SQLite answers "database
    is locked" at once, without its busy timeout, where another connection is opening or migrating
    the file meanwhile (two stores opening one schema-5 file at once hit it once in about 600 tries,
    and the test of that failed once in 6 runs, on the loaded 2-core box): it is retried until the
    timeout."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if not _is_busy(e) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


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
        except sqlite3.DatabaseError as e:
            if _is_busy(e):  # another process holds the file: it is not damaged
                raise
            self.moved_aside = self._move_aside()
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            self._check_version(db)  # before WAL mode, which rewrites the header
            _switch_to_wal(db)
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
        while True:
            # One transaction per step (SQLite's DDL is transactional): a failed step leaves the
            # file at the version before it. The version is read inside the step's write
            # transaction: two processes opening an old file at once take turns, and the second
            # finds the step done.
            db.execute("BEGIN IMMEDIATE")
            try:
                number = db.execute("PRAGMA user_version").fetchone()[0] + 1
                if number > SCHEMA_VERSION:
                    db.execute("COMMIT")
                    return
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
                    complete: bool = True, parent_id: int | None | _AfterNewest = AFTER_NEWEST,
                    tool_calls: list[dict] | None = None) -> int:
        """A new message under parent_id (None: a first message), selected among its siblings. By
        default it follows the conversation's newest message, as every message did before branches
        (and as the migration to schema 6 links them)."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                if parent_id is AFTER_NEWEST:
                    parent_id = self._db.execute("SELECT MAX(id) FROM messages WHERE conversation_id = ?",
                                                 (conversation_id,)).fetchone()[0]
                cur = self._db.execute(
                    "INSERT INTO messages (conversation_id, role, content, stats, created_at, complete, parent_id, "
                    "selected_at, tool_calls) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (conversation_id, role, content, json.dumps(stats) if stats else None, now, int(complete),
                     parent_id, now, json.dumps(tool_calls) if tool_calls else None))
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
        """Only a message nothing follows (sqlite3.IntegrityError otherwise): a failed, empty reply."""
        self._run("DELETE FROM messages WHERE id = ?", (message_id,))

    def select_message(self, message_id: int) -> None:
        """Makes the message the one shown among its siblings (the branch shown goes through it)."""
        self._run("UPDATE messages SET selected_at = ? WHERE id = ?", (time.time(), message_id))

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
        """Every message of every branch, oldest first (shown_branch() picks the branch shown)."""
        rows = self._run("SELECT id, role, content, stats, created_at, complete, parent_id, selected_at, tool_calls "
                         "FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)).fetchall()
        return [MessageRow(i, role, content, json.loads(stats) if stats else None, t, bool(complete), parent, selected,
                           json.loads(calls) if calls else None)
                for i, role, content, stats, t, complete, parent, selected, calls in rows]

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
        WriterLock.remove_file(self._writer_lock_path(conversation_id))

    # --- one writer per conversation -------------------------------------------------------------

    def _writer_lock_path(self, conversation_id: int) -> Path:
        return self.path.with_name(self.path.name + ".writers") / f"{conversation_id}.lock"

    def lock_for_writing(self, conversation_id: int) -> WriterLock | None:
        """The conversation's writer lock, or None while another process (or another lock of this
        one) holds it: then the conversation is read-only here."""
        path = self._writer_lock_path(conversation_id)
        path.parent.mkdir(exist_ok=True)
        return WriterLock.take(path)

    def writer_pid(self, conversation_id: int) -> int | None:
        """The process that last took the conversation's writer lock, where it says."""
        try:
            return int(self._writer_lock_path(conversation_id).read_text() or 0) or None
        except (OSError, ValueError):
            return None


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
