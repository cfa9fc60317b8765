"""Writing a conversation to a Markdown file (runs on the conversation thread, not the UI's)."""
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
