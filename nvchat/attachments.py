"""Text files added to the message being written (the app's /file PATH and its file picker): read
and checked on the conversation thread, then put in the box as a named, fenced block with its
token count, for the user to write around and send.

Refused with an AttachmentError that names the file and the problem: a missing file, a directory,
a binary or non-UTF-8 file, and one that could not fit the model's context beside the system
prompt and room for a reply (where the backend can count tokens; a remote one cannot).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from nvchat.conversation import Conversation

# Read whole only below this: the largest contexts nvchat runs hold about 128k tokens, some 0.5 MiB
# of text; a file many times that could never fit.
MAX_FILE_BYTES = 8 * 2**20


class AttachmentError(ValueError):
    """The file can't go into the message; the text names it and why."""


@dataclass(frozen=True)
class Attachment:
    name: str  # as the user gave it
    block: str  # what goes into the message
    tokens: int | None  # what it adds to the prompt, where the backend can count


def read_text_file(path: Path) -> str:
    if not path.exists():
        raise AttachmentError(f"{path}: no such file")
    if not path.is_file():
        raise AttachmentError(f"{path} is not a file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise AttachmentError(f"{path} is {size / 2**20:.1f} MiB, more than any model's context holds")
    data = path.read_bytes()
    if b"\0" in data:
        raise AttachmentError(f"{path} is a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AttachmentError(f"{path} is not UTF-8 text (byte {e.start})") from None


def file_block(name: str, text: str) -> str:
    """The file's text fenced under its name, the fence longer than any backtick run inside it, and
    its language taken from the file's suffix (for Markdown's highlighting of the message)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    language = Path(name).suffix.lstrip(".")
    language = language if language.isalnum() else ""
    body = text if text.endswith("\n") or not text else text + "\n"
    return f"{name}:\n{fence}{language}\n{body}{fence}\n"


def attach(conversation: Conversation, name: str) -> Attachment:
    """Reads the file named (relative to the current directory, ~ expanded) and checks that it fits
    the conversation's model. Tokenizes: off the UI thread."""
    text = read_text_file(Path(name).expanduser())
    block = file_block(name, text)
    engine = conversation.engine
    if not engine.capabilities.tokenizes:
        return Attachment(name, block, None)
    thinking = conversation.settings.enable_thinking
    system = [{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt else []
    bare = len(engine.tokenize_chat(system + [{"role": "user", "content": ""}], thinking))
    alone = len(engine.tokenize_chat(system + [{"role": "user", "content": block}], thinking))
    limit = conversation.max_context
    if limit is not None:
        room = limit - min(conversation.sampling_params().max_tokens, limit // 4)  # as Conversation._fit
        if alone > room:
            raise AttachmentError(f"{name} is {alone - bare} tokens: it can't fit the model's {limit}-token "
                                  f"context (at most {max(room - bare, 0)} tokens for a message here)")
    return Attachment(name, block, alone - bare)
