"""Which chats were open, in tab order, and which had the focus: written as tabs open, close, switch
and change, and at exit; read at start-up to reopen them (Settings.restore_tabs). Each chat's
unsent text is its conversation's draft, in the store.

A JSON file beside the conversation store rather than a table in it: it holds one process's
screen, not history, so it needs no schema migration, and two processes on one data directory
each write their own whole list (the last one to change its tabs is the one restored).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "open_tabs.json"


@dataclass(frozen=True)
class OpenTabs:
    # Conversation ids in tab order; None for a chat with nothing stored yet (reopened empty).
    conversation_ids: list[int | None]
    focused: int  # index into conversation_ids


def tabs_file(database: Path) -> Path:
    return database.with_name(FILE_NAME)


def save_open_tabs(path: Path, tabs: OpenTabs) -> None:
    """Written whole and then renamed over the old file, so a kill mid-write leaves the old list."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"conversation_ids": tabs.conversation_ids, "focused": tabs.focused}))
    os.replace(partial, path)


def load_open_tabs(path: Path) -> OpenTabs | None:
    """None when there is no file; ValueError naming the file when it can't be read as one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        ids, focused = data["conversation_ids"], data["focused"]
        if not (isinstance(ids, list) and all(i is None or type(i) is int for i in ids)
                and type(focused) is int and 0 <= focused < max(len(ids), 1)):
            raise ValueError("unexpected contents")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a list of open tabs ({e})") from None
    return OpenTabs(ids, focused)
