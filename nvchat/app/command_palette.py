"""The command palette's nvchat commands: every action a key does, findable by name, plus the few
that have no key."""
from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from nvchat.app.bindings import APP_KEYS, describe_key, effective_key

_HELP = {
    "new_tab": "Open a new chat in a tab",
    "close_tab": "Close this chat's tab (it stays saved)",
    "next_tab": "Switch to the next chat",
    "previous_tab": "Switch to the previous chat",
    "rename_tab": "Rename this chat",
    "stop_reply": "Stop the reply being generated",
    "regenerate": "A new reply beside the selected (or last) one; the old one stays as a branch",
    "edit_last": "Edit the selected (or your last) message: sent, it makes a new branch",
    "select_message(-1)": "Select the message above (for edit, regenerate, branches)",
    "select_message(1)": "Select the message below (past the last: none)",
    "switch_branch(-1)": "Show the previous branch of the selected (or latest branching) message",
    "switch_branch(1)": "Show the next branch of the selected (or latest branching) message",
    "alternatives": "Three replies at once, side by side, to pick from",
    "system_prompt": "Edit this chat's system prompt",
    "sampling": "This chat's temperature, top-p, top-k and max tokens",
    "toggle_kv_panel": "Show or hide the live KV-cache block map",
    "toggle_compact": "One rule per message and no reply stats (/stats shows them); saved to config.toml",
    "open_conversations": "Reopen a past conversation",
    "export_markdown": "Export this chat to a Markdown file",
    "help": "List every key",
}
# Textual's own system commands already offer quit; picking an alternative is for when some are up.
_SKIP = {"quit", "pick_1", "pick_2", "pick_3", "pick_4"}
_PALETTE_ONLY = (
    ("Default system prompt", "Edit the system prompt new chats start with (saved to config.toml)",
     "default_system_prompt"),
    ("Add a file", "Add a text file's contents to the message being written (/file PATH)", "pick_file"),
    ("Copy code block", "Copy the focused code block, or this chat's latest one (c on a focused block)",
     "copy_code"),
)


class ChatCommands(Provider):
    def _commands(self) -> list[tuple[str, str, str]]:
        keymap = self.app._keymap
        commands = [(spec.description, f"{_HELP.get(spec.action, '')}  ({describe_key(effective_key(spec, keymap))})",
                     spec.action) for spec in APP_KEYS if spec.id not in _SKIP]
        return commands + list(_PALETTE_ONLY)

    def _run(self, action: str):
        return partial(self.app.run_action, action)

    async def discover(self) -> Hits:
        for name, help_text, action in self._commands():
            yield DiscoveryHit(name, self._run(action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, action in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), self._run(action), help=help_text)
