"""Every key the app binds, with the id a user names in config.toml's [keys] table to remap it, and
the slash command that runs the same action.

One table feeds the bindings, the help screen and the command palette, so they can't drift apart.
Ids must be TOML bare keys (letters, digits, _ and -).
"""
from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class KeySpec:
    id: str
    key: str  # default; comma-separated alternatives
    action: str
    description: str
    show: bool = True  # in the footer
    # Priority bindings fire before the focused widget sees the key. The app's are: the
    # prompt box (a TextArea) binds many keys itself (ctrl+w deletes a word, f6 selects a line),
    # and a key remapped in config.toml should work wherever the focus is. The app turns its
    # chat actions off while a modal screen is up (App.check_action), so modals keep their keys.
    priority: bool = True

    def binding(self) -> Binding:
        return Binding(self.key, self.action, self.description, show=self.show, priority=self.priority, id=self.id)



APP_KEYS: tuple[KeySpec, ...] = (
    KeySpec("new_tab", "ctrl+t", "new_tab", "New chat"),
    KeySpec("close_tab", "ctrl+w", "close_tab", "Close chat"),
    KeySpec("next_tab", "ctrl+pagedown,alt+right", "next_tab", "Next chat", show=False),
    KeySpec("previous_tab", "ctrl+pageup,alt+left", "previous_tab", "Previous chat", show=False),
    KeySpec("rename_tab", "f2", "rename_tab", "Rename", show=False),
    KeySpec("stop_reply", "escape", "stop_reply", "Stop"),
    KeySpec("regenerate", "ctrl+r", "regenerate", "Regenerate"),
    KeySpec("edit_last", "f3", "edit_last", "Edit message", show=False),
    KeySpec("select_up", "alt+up", "select_message(-1)", "Select message above", show=False),
    KeySpec("select_down", "alt+down", "select_message(1)", "Select message below", show=False),
    KeySpec("branch_prev", "f8", "switch_branch(-1)", "Previous branch", show=False),
    KeySpec("branch_next", "f9", "switch_branch(1)", "Next branch", show=False),
    KeySpec("alternatives", "f6", "alternatives", "Alternatives", show=False),
    *(KeySpec(f"pick_{n}", f"alt+{n}", f"pick_alternative({n})", f"Pick alternative {n}", show=False)
      for n in range(1, 5)),
    KeySpec("system_prompt", "f4", "system_prompt", "System prompt", show=False),
    KeySpec("sampling", "f7", "sampling", "Sampling", show=False),
    KeySpec("kv_panel", "f5", "toggle_kv_panel", "KV cache"),
    KeySpec("compact", "f12", "toggle_compact", "Compact view", show=False),
    KeySpec("conversations", "ctrl+o", "open_conversations", "History", show=False),
    KeySpec("export", "ctrl+s", "export_markdown", "Export", show=False),
    KeySpec("help", "f1", "help", "Help"),
    KeySpec("quit", "ctrl+q", "quit", "Quit", show=False),
)

# The prompt box runs its keys itself, in order with the text typed before them (PromptInput).
PROMPT_KEYS: tuple[KeySpec, ...] = (
    KeySpec("send", "enter", "send", "Send", show=False, priority=False),
    KeySpec("newline", "shift+enter,ctrl+j", "newline", "New line", show=False, priority=False),
    KeySpec("scroll_chat_up", "pageup", "scroll_chat(-1)", "Scroll up", show=False, priority=False),
    KeySpec("scroll_chat_down", "pagedown", "scroll_chat(1)", "Scroll down", show=False, priority=False),
)

# Keys of Textual's focus chain and of the widgets it reaches: not remappable, listed on F1 too.
FOCUS_KEYS: tuple[tuple[str, str], ...] = (
    ("tab", "Focus next"),  # the box, the transcript, its code blocks (HelpScreen's note says so)
    ("shift+tab", "Focus previous"),
    ("c", "Copy code block"),  # the focused one
)

ALL_KEYS = APP_KEYS + PROMPT_KEYS
KEY_IDS = frozenset(spec.id for spec in ALL_KEYS)

# The action each slash command (nvchat/slash_table.py) runs, as its key would. With text, /system,
# /rename and /save do without their dialog, and /branch, /alt and /pick take their number
# (ChatActions.run_slash_command); /stats has no key.
SLASH_ACTIONS = {"help": "help", "new": "new_tab", "system": "system_prompt", "rename": "rename_tab",
                 "save": "export_markdown", "sampling": "sampling", "stop": "stop_reply", "regenerate": "regenerate",
                 "edit": "edit_last", "branch": "switch_branch(1)", "alt": "alternatives", "quit": "quit",
                 "file": "pick_file"}
# Commands that a key also runs (/pick N: Alt+N), which the help screen's key table lists.
KEYED_COMMANDS = frozenset(SLASH_ACTIONS) | {"pick"}
# Keys whose command takes what the key's action is given as text: the help screen's /command column.
_COMMAND_FORMS = {"switch_branch(-1)": "/branch prev", "switch_branch(1)": "/branch next",
                  **{f"pick_alternative({n})": f"/pick {n}" for n in range(1, 5)}}


def command_for_action(action: str) -> str | None:
    """'/new' for new_tab: for the help screen's key table."""
    if action in _COMMAND_FORMS:
        return _COMMAND_FORMS[action]
    return next((f"/{name}" for name, bound in SLASH_ACTIONS.items() if bound == action), None)


def bindings(specs: tuple[KeySpec, ...]) -> list[Binding]:
    return [spec.binding() for spec in specs]


def effective_key(spec: KeySpec, keymap: dict[str, str]) -> str:
    return keymap.get(spec.id, spec.key)


def unknown_key_ids(keymap: dict[str, str]) -> list[str]:
    return sorted(set(keymap) - KEY_IDS)


_KEY_NAMES = {"escape": "Esc", "pagedown": "PgDn", "pageup": "PgUp", "enter": "Enter", "tab": "Tab",
              "backspace": "Backspace", "delete": "Del", "space": "Space"}


def describe_key(keys: str) -> str:
    """'ctrl+pagedown,alt+right' -> 'Ctrl+PgDn / Alt+Right', for people rather than Textual."""
    def one(key: str) -> str:
        *modifiers, name = key.strip().split("+")
        name = _KEY_NAMES.get(name, name.upper() if len(name) == 1 else name.capitalize())
        return "+".join([m.capitalize() for m in modifiers] + [name])
    return " / ".join(one(k) for k in keys.split(",") if k.strip())
