"""Writing a conversation to a Markdown file, for the app's export and the REPL's /save (never on
the UI thread)."""
import re
from pathlib import Path

from nvchat.conversation import Conversation


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:48] or "chat"


def _unused(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def export_markdown(conversation: Conversation, directories: list[Path]) -> Path:
    """Writes the conversation into the first directory that takes it; returns the file's path."""
    text = conversation.to_markdown()
    errors = []
    for directory in directories:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = _unused(directory / f"nvchat-{_slug(conversation.title)}.md")
            path.write_text(text, encoding="utf-8")
            return path.resolve()
        except OSError as e:
            errors.append(f"{directory}: {e.strerror or e}")
    raise OSError("could not write the export: " + "; ".join(errors))


def save_markdown_to(conversation: Conversation, path: Path) -> Path:
    """Writes to exactly PATH (the user named the file); a directory gets a fresh name inside it."""
    if path.is_dir():
        return export_markdown(conversation, [path])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(conversation.to_markdown(), encoding="utf-8")
    return path.resolve()
