"""The plain REPL's handlers for the slash commands (their names, usage and summaries are the shared
table's: nvchat/slash_table.py).

Handlers get the REPL (anything with `conversation`, `engine`, `last_stream` and
`new_conversation()`) and the text after the command name, and return the text to show.
"""
from pathlib import Path
from typing import Callable

from nvchat import paths
from nvchat.export import export_markdown, save_markdown_to
from nvchat.slash_table import (
    REPL,
    Invocation,
    command_lines,
    format_stats,
    unknown_notice,
)


class QuitRepl(Exception):
    """Raised by /quit; the REPL ends its loop."""


def dispatch(repl, invocation: Invocation) -> str | None:
    """Runs the command slash_table.parse found in a line."""
    if invocation.command is None:
        return unknown_notice(invocation.name, REPL)
    return HANDLERS[invocation.command.name](repl, invocation.arg)


def _help(repl, arg: str) -> str:
    return "\n".join(["commands:", *command_lines(REPL), "keys:",
                      "  Enter sends; Meta+Enter (Esc Enter) or Ctrl-J adds a new line",
                      "  Ctrl-C stops a reply, clears the line, or (twice at an empty prompt) quits; Ctrl-D quits",
                      "  a message starting with // is sent with a single leading /"])


def _new(repl, arg: str) -> str:
    repl.new_conversation()
    return "new conversation"


def _system(repl, arg: str) -> str:
    if not arg:
        current = repl.conversation.system_prompt
        return f"system prompt: {current}" if current else "no system prompt"
    repl.conversation.set_system_prompt(arg)
    return "system prompt set for the next turn"


def _rename(repl, arg: str) -> str:
    if not arg:
        return f"title: {repl.conversation.title} (/rename TITLE changes it)"
    repl.conversation.rename(arg)
    return f"renamed to {arg}"


def _stats(repl, arg: str) -> str:
    return format_stats(repl.engine.stats(), repl.last_stream)


def _save(repl, arg: str) -> str:
    conversation = repl.conversation
    if not conversation.messages:
        return "nothing to save yet: the conversation is empty"
    path = save_markdown(conversation, Path(arg).expanduser() if arg else None)
    return f"saved to {path}"


def save_markdown(conversation, path: Path | None = None) -> Path:
    """/save: to PATH when given (a directory gets a generated name), else into nvchat's exports
    directory, never over an existing file unless PATH names it."""
    if path is None:
        return export_markdown(conversation, [paths.exports_dir()])
    return save_markdown_to(conversation, path)


def _quit(repl, arg: str):
    raise QuitRepl


HANDLERS: dict[str, Callable[[object, str], str | None]] = {
    "help": _help, "new": _new, "system": _system, "rename": _rename, "stats": _stats, "save": _save,
    "quit": _quit,
}
