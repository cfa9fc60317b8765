"""The plain REPL's handlers for the slash commands (their names, usage and summaries are the shared
table's: nvchat/slash_table.py).

Handlers get the REPL (nvchat/repl.py's Repl) and the text after the command name, and return the
text to show, or an awaitable (a command that streams a reply) whose result is that text.
"""
from pathlib import Path
from typing import Awaitable, Callable

from nvchat import paths
from nvchat.attachments import attach
from nvchat.conversation import DEFAULT_ALTERNATIVES, MAX_ALTERNATIVES, MIN_ALTERNATIVES
from nvchat.export import export_markdown, save_markdown_to
from nvchat.slash_table import (
    REPL,
    Invocation,
    as_typed,
    command_lines,
    format_stats,
    sampling_changes,
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
                      "  Ctrl-C stops a reply, clears the line (and gives up an /edit or /file), or (twice at an",
                      "  empty prompt) quits; Ctrl-D quits",
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


def _file(repl, arg: str) -> str:
    if not arg:
        return "usage: /file PATH (the app, nvchat without --plain, also has a file picker)"
    attachment = attach(repl.conversation, arg)  # AttachmentError (a ValueError) names what is wrong
    if not repl.next_line:  # a block named by an absolute path must not make the line read as a /command
        repl.next_line = as_typed(attachment.block)
    else:
        repl.next_line += ("" if repl.next_line.endswith("\n") else "\n") + attachment.block
    tokens = "" if attachment.tokens is None else f" ({attachment.tokens} tokens)"
    return f"{attachment.name}{tokens} is in the next message: write around it, Enter sends, Ctrl-C gives it up"


def _edit(repl, arg: str) -> str:
    conversation = repl.conversation
    index = conversation.last_user_index()
    if index is None:
        return "no message to edit yet"
    repl.editing = index
    repl.next_line = as_typed(conversation.messages[index].content)
    return "editing your last message: Enter sends it as a new branch (the old one stays), Ctrl-C gives it up"


async def _regenerate(repl, arg: str) -> None:
    await repl.regenerate()


def _branch(repl, arg: str) -> str | None:
    conversation = repl.conversation
    index = conversation.latest_branching()
    if index is None:
        return "no other branch yet: /edit and /regenerate make them"
    which, count = conversation.branch_position(conversation.messages[index])
    word = arg.lower()
    if not word:
        return (f"message {index + 1} has {count} branches and this is {which}: "
                "/branch next, /branch prev or /branch N shows another")
    if word in ("next", "prev", "previous"):
        conversation.switch_branch(index, 1 if word == "next" else -1)
    elif word.isdigit():
        conversation.choose_branch(index, int(word))
    else:
        return f"/branch takes a branch's number, next or prev, not {arg!r}"
    repl.alternatives = []
    which, count = conversation.branch_position(conversation.messages[index])
    repl.print_messages(conversation.messages[index:])
    return f"[branch {which}/{count} of message {index + 1}]"


async def _alt(repl, arg: str) -> str | None:
    count = int(arg) if arg.isdigit() else None if arg else DEFAULT_ALTERNATIVES
    if count is None or not MIN_ALTERNATIVES <= count <= MAX_ALTERNATIVES:
        return f"/alt takes how many replies: {MIN_ALTERNATIVES} to {MAX_ALTERNATIVES}, not {arg!r}"
    await repl.alternatives_beside_last_reply(count)
    return None


def _pick(repl, arg: str) -> str:
    if not repl.alternatives:
        return "no alternatives to pick from: /alt N generates some"
    number = int(arg) if arg.isdigit() else None
    if number is None or not 1 <= number <= len(repl.alternatives) or repl.alternatives[number - 1] is None:
        return f"no alternative {arg!r} to pick: 1 to {len(repl.alternatives)}"
    repl.conversation.show_branch(repl.alternatives[number - 1])
    return f"alternative {number} is the reply shown now; the others stay as branches"


def _sampling(repl, arg: str) -> str:
    conversation = repl.conversation
    defaults = conversation.sampling_defaults()
    if arg.lower() == "reset":
        conversation.set_sampling({})
    elif arg:
        changes = sampling_changes(arg, defaults)
        conversation.set_sampling(conversation.sampling | changes)  # ValueError names a bad value
    own = conversation.sampling
    values = conversation.sampling_params()
    shown = ", ".join(f"{name} {getattr(values, name):g}" + (" (this chat's)" if name in own else "")
                      for name in defaults)
    return (f"sampling: {shown}\n"
            "/sampling NAME=VALUE ... sets this chat's own; /sampling reset follows the defaults again")


def _quit(repl, arg: str):
    raise QuitRepl


HANDLERS: dict[str, Callable[[object, str], str | None | Awaitable[str | None]]] = {
    "help": _help, "new": _new, "system": _system, "rename": _rename, "stats": _stats, "save": _save,
    "file": _file, "sampling": _sampling, "regenerate": _regenerate, "edit": _edit, "branch": _branch,
    "alt": _alt, "pick": _pick, "quit": _quit,
}
