"""The plain REPL's slash commands: parsing, /help, and what each command does.

Handlers get the REPL (anything with `conversation`, `engine`, `last_stream` and
`new_conversation()`) and the text after the command name, and return the text to show.
"""
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nvchat import paths
from nvchat.export import export_markdown, save_markdown_to


class QuitRepl(Exception):
    """Raised by /quit; the REPL ends its loop."""


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    summary: str
    run: Callable[[object, str], str | None]


COMMANDS: dict[str, Command] = {}
ALIASES: dict[str, str] = {}

_COMMAND = re.compile(r"/(\S*)\s*(.*)", re.DOTALL)


def command(name: str, usage: str, summary: str, aliases: tuple[str, ...] = ()):
    def register(fn):
        COMMANDS[name] = Command(name, usage, summary, fn)
        ALIASES.update({a: name for a in aliases})
        return fn
    return register


def is_command(line: str) -> bool:
    """A leading "/" makes a command; "//" escapes it so a message may start with a slash."""
    return line.startswith("/") and not line.startswith("//")


def dispatch(repl, line: str) -> str | None:
    match = _COMMAND.fullmatch(line.strip())
    name, arg = match.group(1).lower(), match.group(2).strip()
    cmd = COMMANDS.get(ALIASES.get(name, name))
    if cmd is None:
        return f"unknown command /{name}; /help lists the commands (start a message with // to send a leading /)"
    return cmd.run(repl, arg)


# --- the commands ---------------------------------------------------------------------------------

@command("help", "/help", "list the commands and keys", aliases=("?",))
def _help(repl, arg: str) -> str:
    width = max(len(c.usage) for c in COMMANDS.values())
    lines = [f"  {c.usage:<{width}}  {c.summary}" for c in COMMANDS.values()]
    return "\n".join(["commands:", *lines, "keys:",
                      "  Enter sends; Meta+Enter (Esc Enter) or Ctrl-J adds a new line",
                      "  Ctrl-C stops a reply, clears the line, or (twice at an empty prompt) quits; Ctrl-D quits",
                      "  a message starting with // is sent with a single leading /"])


@command("new", "/new", "start a new conversation")
def _new(repl, arg: str) -> str:
    repl.new_conversation()
    return "new conversation"


@command("system", "/system TEXT", "set the system prompt from the next turn on (no TEXT: show it)")
def _system(repl, arg: str) -> str:
    if not arg:
        current = repl.conversation.system_prompt
        return f"system prompt: {current}" if current else "no system prompt"
    repl.conversation.set_system_prompt(arg)
    return "system prompt set for the next turn"


@command("stats", "/stats", "KV cache, prefix cache and last reply numbers")
def _stats(repl, arg: str) -> str:
    return format_stats(repl.engine.stats(), repl.last_stream)


@command("save", "/save [PATH]", "export the conversation as Markdown and show the file's path")
def _save(repl, arg: str) -> str:
    conversation = repl.conversation
    if not conversation.messages:
        return "nothing to save yet: the conversation is empty"
    path = save_markdown(conversation, Path(arg).expanduser() if arg else None)
    return f"saved to {path}"


@command("quit", "/quit", "leave (conversations are already stored)", aliases=("exit", "q"))
def _quit(repl, arg: str):
    raise QuitRepl


# --- helpers --------------------------------------------------------------------------------------

def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


NO_BLOCK_STATS = "KV cache: block statistics are not available from a remote backend"


def format_stats(snap, last_stream=None) -> str:
    lines = [NO_BLOCK_STATS] if snap is None else [
        f"KV cache: {snap.num_used_blocks}/{snap.num_blocks} blocks in use ({snap.block_size} tokens each), "
        f"{snap.num_cached_blocks} free but cached for reuse; {_mib(snap.kv_bytes_used)} of {_mib(snap.kv_bytes_total)}",
        f"prefix cache: {snap.prefix_hit_tokens}/{snap.prompt_tokens} prompt tokens reused "
        f"({snap.prefix_hit_rate:.1%} hit rate)",
        f"requests: {snap.num_running} running, {snap.num_waiting} waiting, {snap.num_preemptions} preemptions; "
        f"prefill {snap.prefill_tokens_per_s:.0f} tok/s, decode {snap.decode_tokens_per_s:.0f} tok/s",
    ]
    if last_stream is not None:
        tps, ttft = last_stream.tokens_per_second, last_stream.time_to_first_token
        lines.append(
            f"last reply: {last_stream.num_completion_tokens} tokens"
            + (f", {tps:.1f} tok/s" if tps else "")
            + (f", first token after {ttft:.2f} s" if ttft is not None else "")
            + f"; prompt {last_stream.num_prompt_tokens} tokens, {last_stream.num_cached_tokens} from the prefix cache"
            + (f" ({last_stream.finish_reason})" if last_stream.finish_reason else ""))
    return "\n".join(lines)


def save_markdown(conversation, path: Path | None = None) -> Path:
    """/save: to PATH when given (a directory gets a generated name), else into nvchat's exports
    directory, never over an existing file unless PATH names it."""
    if path is None:
        return export_markdown(conversation, [paths.exports_dir()])
    return save_markdown_to(conversation, path)
