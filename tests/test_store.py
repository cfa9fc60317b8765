import pytest

from nvchat.conversation import split_thinking
from nvchat.settings import SettingsError, load_settings, save_setting
from nvchat.store import ChatStore, shown_branch


def test_store_round_trip(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    cid = store.create_conversation("First", "be brief", "demo")
    store.add_message(cid, "user", "hello")
    mid = store.add_message(cid, "assistant", "hi", {"tokens": 2, "tokens_per_s": 10.0})
    store.rename(cid, "Greeting")
    store.close()
    again = ChatStore(tmp_path / "c.sqlite3")
    [row] = again.list_conversations()
    assert (row.title, row.system_prompt, row.model, row.num_messages) == ("Greeting", "be brief", "demo", 2)
    msgs = again.load_messages(cid)
    assert [(m.role, m.content) for m in msgs] == [("user", "hello"), ("assistant", "hi")]
    assert msgs[1].stats == {"tokens": 2, "tokens_per_s": 10.0} and msgs[1].id == mid
    again.delete_conversation(cid)
    assert again.list_conversations() == []


def test_a_message_added_without_a_parent_follows_the_newest_and_none_starts_a_branch(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    cid = store.create_conversation("Linear", "", "demo")
    question = store.add_message(cid, "user", "hello")
    answer = store.add_message(cid, "assistant", "hi")
    edited = store.add_message(cid, "user", "hello again", parent_id=None)  # an edit of the first message
    rows = store.load_messages(cid)
    assert [r.parent_id for r in rows] == [None, question, None]
    assert [r.id for r in shown_branch(rows)] == [edited]
    store.select_message(question)
    assert [r.id for r in shown_branch(store.load_messages(cid))] == [question, answer]
    store.close()


def test_split_thinking():
    assert split_thinking("<think>\nhmm\n</think>\n\nAnswer") == ("hmm", "Answer")
    assert split_thinking("<think>still going") == ("still going", "")
    assert split_thinking("plain") == (None, "plain")


def test_settings_file(tmp_path):
    path = tmp_path / "config.toml"
    assert load_settings(path).theme == "nvchat-dark"
    save_setting("theme", "nvchat-light", path)
    path.write_text(path.read_text() + '\n[keys]\nnew_tab = "ctrl+n"\n')
    s = load_settings(path)
    assert s.theme == "nvchat-light" and s.keys == {"new_tab": "ctrl+n"}
    save_setting("max_tokens", 99, path)
    assert load_settings(path).keys == {"new_tab": "ctrl+n"} and load_settings(path).max_tokens == 99
    path.write_text("max_tokens = 'lots'\n")
    with pytest.raises(SettingsError, match="max_tokens must be an integer"):
        load_settings(path)
    path.write_text("colour = 1\n")
    with pytest.raises(SettingsError, match="unknown setting 'colour'"):
        load_settings(path)


def test_a_failed_write_does_not_poison_later_ones(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    with pytest.raises(Exception):
        store.add_message(12345, "user", "no such conversation")  # foreign key violation
    cid = store.create_conversation("After", "", "demo")
    store.add_message(cid, "user", "kept")
    store.close()
    again = ChatStore(tmp_path / "c.sqlite3")
    assert [m.content for m in again.load_messages(cid)] == ["kept"]
