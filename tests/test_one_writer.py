"""One writer per conversation: the process that opens or starts a conversation holds its writer
lock; another that opens it meanwhile gets it read-only, and writable (read again, with what the
first one wrote) once the lock is let go, by release() or by the first process ending, kill -9
included. Deleting a conversation deletes its lock file, unless another process holds the lock."""
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from nvchat.conversation import Conversation, ReadOnlyConversation
from nvchat.settings import Settings
from nvchat.store import ChatStore, WriterLock

REPO = Path(__file__).resolve().parents[1]


def conversation(store: ChatStore) -> Conversation:
    return Conversation(None, store, system_prompt="", model_name="demo", settings=Settings())


def lock_file(path: Path, conversation_id: int) -> Path:
    return path.with_name(path.name + ".writers") / f"{conversation_id}.lock"


@contextmanager
def holding_process(path: Path, conversation_id: int):
    """Another process that holds the conversation's writer lock, killed on leaving if still running."""
    script = ("import sys; from pathlib import Path; from nvchat.store import ChatStore; "
              f"lock = ChatStore(Path(sys.argv[1])).lock_for_writing({conversation_id}); "
              "print('held' if lock else 'refused', flush=True); sys.stdin.read()")
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_a_conversation_written_by_one_holder_is_read_only_for_another_until_let_go(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    first_store, second_store = ChatStore(path), ChatStore(path)
    writer = conversation(first_store)
    writer.save_draft("half a thought")  # stores the new chat, and takes its writer lock
    first = first_store.add_message(writer.id, "user", "from the first", parent_id=None)

    reader = Conversation.load(None, second_store, writer.id, Settings())
    assert reader.read_only is not None and f"process {os.getpid()}" in reader.read_only
    for write in (lambda: reader.rename("mine now"), lambda: reader.set_system_prompt("x"),
                  lambda: reader.set_sampling({"temperature": 0.1}), lambda: reader.send("from the second")):
        with pytest.raises(ReadOnlyConversation, match="open in another nvchat"):
            write()
    reader.save_draft("not the reader's to store")  # quietly not stored: the draft is the writer's
    assert not reader.try_to_write()

    first_store.add_message(writer.id, "assistant", "a reply", parent_id=first)
    writer.release()
    assert reader.try_to_write() and reader.read_only is None
    # Read again: what the first holder wrote meanwhile, and its draft.
    assert [m.content for m in reader.messages] == ["from the first", "a reply"]
    assert reader.draft == "half a thought"
    reader.rename("mine now")
    # Now the first holder is the one that can't write it.
    again = Conversation.load(None, first_store, writer.id, Settings())
    assert again.read_only is not None and again.title == "mine now"
    reader.release()
    first_store.close()
    second_store.close()


def test_the_lock_goes_with_a_process_killed_with_sigkill(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    store = ChatStore(path)
    conversation_id = store.create_conversation("Held elsewhere", "", "demo")
    with holding_process(path, conversation_id) as holder:
        reader = Conversation.load(None, store, conversation_id, Settings())
        assert reader.read_only is not None and f"process {holder.pid}" in reader.read_only
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert reader.try_to_write()
        reader.release()
    store.close()


def test_deleting_a_conversation_that_nobody_writes_deletes_its_lock_file(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    store = ChatStore(path)
    deleted, kept = conversation(store), conversation(store)
    for chat in (deleted, kept):
        chat.save_draft("a draft")  # stored, with its writer lock taken
        chat.release()
    assert lock_file(path, deleted.id).exists() and lock_file(path, kept.id).exists()
    store.delete_conversation(deleted.id)
    assert not lock_file(path, deleted.id).exists()
    assert lock_file(path, kept.id).exists()
    store.close()


def test_deleting_a_conversation_this_process_writes_frees_its_id_for_a_new_writer(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    store = ChatStore(path)
    deleted = conversation(store)
    deleted.save_draft("a draft")  # holds the writer lock from here on
    store.delete_conversation(deleted.id)
    assert not lock_file(path, deleted.id).exists()
    # SQLite gives the next conversation the deleted one's id (the largest id plus one); its writer
    # lock is a new file, not the one the deleted conversation's object still holds.
    fresh = conversation(store)
    fresh.save_draft("another draft")
    assert fresh.id == deleted.id and fresh.read_only is None
    assert WriterLock.take(lock_file(path, fresh.id)) is None  # held, by fresh
    deleted.release()
    fresh.release()
    store.close()


def test_a_lock_file_that_another_process_holds_stays_when_its_conversation_is_deleted(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    store = ChatStore(path)
    conversation_id = store.create_conversation("Held elsewhere", "", "demo")
    with holding_process(path, conversation_id) as holder:
        store.delete_conversation(conversation_id)
        assert lock_file(path, conversation_id).read_text() == str(holder.pid)  # still the holder's
        assert store.lock_for_writing(conversation_id) is None
    assert WriterLock.remove_file(lock_file(path, conversation_id))  # the holder is gone: nobody holds it
    assert not lock_file(path, conversation_id).exists()
    store.close()
