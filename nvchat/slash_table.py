"""Slash commands: the one table of their names, usage and summaries, which both front-ends (the
plain REPL and the Textual app) list and parse with, and the helpers their handlers share.

Each front-end keeps its own handlers (nvchat/repl_slash_handlers.py, nvchat/app/actions.py). A
line that starts with "/" is a command; "//" escapes it, so a message may start with a slash.
"""
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    summary: str
    aliases: tuple[str, ...] = ()
    app_only: bool = False  # the REPL has no such action (or a key does it there: Ctrl-C stops)


COMMANDS: tuple[Command, ...] = (
    Command("help", "/help", "list the commands and keys", aliases=("?",)),
    Command("new", "/new", "start a new conversation"),
    Command("system", "/system [TEXT]", "set the system prompt from the next turn on (no TEXT: show it)"),
    Command("rename", "/rename TITLE", "retitle the conversation"),
    Command("stats", "/stats", "KV cache, prefix cache and last reply numbers"),
    Command("save", "/save [PATH]", "export the conversation as Markdown and show the file's path"),
    Command("file", "/file [PATH]", "add a text file to the message being written (the app: no PATH picks one)"),
    Command("sampling", "/sampling [NAME=VALUE...]", "this chat's temperature, top-p, top-k, max tokens... "
            "(the app: a dialog)"),
    Command("stop", "/stop", "stop the reply being generated", app_only=True),
    Command("regenerate", "/regenerate", "a new reply beside the selected (or last) one, kept as a branch"),
    Command("edit", "/edit", "put the selected (or your last) message in the box: sent, it makes a branch"),
    Command("branch", "/branch [N|next|prev]", "show another branch of the selected (or latest branching) message"),
    Command("alt", "/alt [N]", "N replies at once (2-4, default 3) to the message in the box, or beside the last reply"),
    Command("pick", "/pick N", "keep alternative N as the branch shown (the others stay as branches)"),
    Command("quit", "/quit", "leave (conversations are already stored)", aliases=("exit", "q")),
)

APP, REPL = "app", "repl"


def commands_for(frontend: str) -> tuple[Command, ...]:
    return tuple(c for c in COMMANDS if frontend == APP or not c.app_only)


@dataclass(frozen=True)
class Invocation:
    name: str  # as typed, lower-cased
    arg: str
    command: Command | None  # None: no such command in this front-end


_COMMAND = re.compile(r"/(\S*)\s*(.*)", re.DOTALL)


def parse(line: str, frontend: str) -> Invocation | None:
    """The command a typed line names, or None when it is a message (see message_text)."""
    line = line.strip()
    if not line.startswith("/") or line.startswith("//"):
        return None
    match = _COMMAND.fullmatch(line)
    name, arg = match.group(1).lower(), match.group(2).strip()
    by_name = {n: c for c in commands_for(frontend) for n in (c.name, *c.aliases)}
    return Invocation(name, arg, by_name.get(name))


def message_text(line: str) -> str:
    """What a line that is no command sends: itself, less the escaping slash of a leading //."""
    return line[1:] if line.startswith("//") else line


def as_typed(message: str) -> str:
    """A message as it must be typed to be sent again (back in a box to edit): a leading / doubled."""
    return "/" + message if message.startswith("/") else message


def unknown_notice(name: str, frontend: str) -> str:
    if frontend == REPL and any(c.name == name and c.app_only for c in COMMANDS):
        return f"/{name} is an app command (nvchat without --plain); /help lists the commands here"
    return f"unknown command /{name}; /help lists the commands (start a message with // to send a leading /)"


def completion(prefix: str, frontend: str) -> str | None:
    """The first command name that starts with prefix (typed after its "/"), for completing it."""
    prefix = prefix.lower()
    return next((c.name for c in commands_for(frontend) if prefix and c.name.startswith(prefix)), None)


def command_lines(frontend: str) -> list[str]:
    commands = commands_for(frontend)
    width = max(len(c.usage) for c in commands)
    return [f"  {c.usage:<{width}}  {c.summary}" for c in commands]


# --- what the handlers share ----------------------------------------------------------------------

def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


NO_BLOCK_STATS = "KV cache: block statistics are not available from a remote backend"


def _prompt_figures(prompt_tokens: int | None, cached_tokens: int | None) -> str:
    # None: the server did not report it (unknown, not 0).
    if prompt_tokens is None:
        return "; prompt size unknown (the server did not report it)"
    cached = "prefix-cache use unknown" if cached_tokens is None else f"{cached_tokens} from the prefix cache"
    return f"; prompt {prompt_tokens} tokens, {cached}"


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
            + _prompt_figures(last_stream.num_prompt_tokens, last_stream.num_cached_tokens)
            + (f" ({last_stream.finish_reason})" if last_stream.finish_reason else ""))
    return "\n".join(lines)


def sampling_changes(arg: str, defaults: dict) -> dict:
    """/sampling's NAME=VALUE words as values (top-p and top_p alike); ValueError names a bad word.
    defaults: the chat's values, whose types the new ones take."""
    changes = {}
    for word in arg.split():
        name, equals, text = word.partition("=")
        name = name.lower().replace("-", "_")
        if not equals or name not in defaults:
            raise ValueError(f"/sampling takes NAME=VALUE, NAME one of {', '.join(defaults)}; not {word!r}")
        try:
            changes[name] = int(text) if isinstance(defaults[name], int) else float(text)
        except ValueError:
            raise ValueError(f"{name}: {text!r} is not a number") from None
    return changes
