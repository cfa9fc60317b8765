"""Every key, as remapped by config.toml's [keys] table, with its binding id and the slash command
that does the same."""
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from nvchat.app.bindings import (
    ALL_KEYS,
    FOCUS_KEYS,
    KEYED_COMMANDS,
    command_for_action,
    describe_key,
    effective_key,
)
from nvchat.slash_table import APP, commands_for


def _slash_note() -> str:
    commands = commands_for(APP)
    with_text = ", ".join(c.usage for c in commands if " " in c.usage)
    keyless = "".join(f"\n{c.usage}: {c.summary}; " for c in commands if c.name not in KEYED_COMMANDS) or "\n"
    return f"Commands that take text: {with_text}.{keyless}//x sends /x."


class HelpScreen(ModalScreen[None]):
    CSS_PATH = Path(__file__).with_name("help_screen.tcss")
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self, keymap: dict[str, str]) -> None:
        super().__init__()
        self.keymap = keymap

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Label("Keys, and the /commands typed in the message box that do the same", id="help-heading")
            yield DataTable(id="help-table", cursor_type="none", zebra_stripes=True, show_cursor=False)
            yield Label(_slash_note() + "\nTab and Shift+Tab move between the message box, the transcript and "
                        "its code blocks; c copies the focused block.\nCtrl+P opens the command palette (themes are there too).\n"
                        "Remap a key by its id in config.toml's [keys] table, e.g.\n"
                        "  new_tab = \"ctrl+n\"\n"
                        "(config.toml lives in ~/.config/nvchat, or $XDG_CONFIG_HOME/nvchat.)",
                        id="help-footer", markup=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Key", "Action", "Command", "Id")
        picks = [spec for spec in ALL_KEYS if spec.action.startswith("pick_alternative(")]
        for spec in ALL_KEYS:
            if spec in picks[1:]:
                continue
            if spec is picks[0]:  # one row for the four: Alt+1 … Alt+4
                table.add_row(" … ".join(describe_key(effective_key(s, self.keymap)) for s in (picks[0], picks[-1])),
                              "Pick alternative N", "/pick N", f"{picks[0].id} … {picks[-1].id}")
                continue
            table.add_row(describe_key(effective_key(spec, self.keymap)), spec.description,
                          command_for_action(spec.action) or "", spec.id)
        for key, description in FOCUS_KEYS:
            table.add_row(describe_key(key), description, "", "")
        table.styles.max_height = table.row_count + 1  # and its header

    def action_close(self) -> None:
        self.dismiss(None)
