"""Past conversations, newest first; Enter reopens one in a tab."""
import time
from pathlib import Path
from typing import Awaitable, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from nvchat.store import ConversationRow


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


class ConversationsScreen(ModalScreen[int | None]):
    """Dismisses with the chosen conversation's id, or None."""

    CSS_PATH = Path(__file__).with_name("conversations_screen.tcss")
    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, list_conversations: Callable[[], Awaitable[list[ConversationRow]]]) -> None:
        super().__init__()
        self.list_conversations = list_conversations  # runs off the UI thread

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations-box"):
            yield Label("Past conversations  (Enter opens, Esc closes)", id="conversations-heading")
            yield Label("loading…", id="conversations-empty")
            yield DataTable(id="conversations-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Title", "Messages", "Model", "Updated")
        self.run_worker(self._load(), exclusive=True)

    async def _load(self) -> None:
        try:
            rows = await self.list_conversations()
        except Exception as e:
            self.query_one("#conversations-empty", Label).update(f"Could not read the conversations: {e}")
            return
        table = self.query_one(DataTable)
        for row in rows:
            table.add_row(Text(row.title), str(row.num_messages), Text(row.model), _when(row.updated_at),
                          key=str(row.id))
        empty = self.query_one("#conversations-empty", Label)
        empty.update("No saved conversations yet." if not rows else "")
        empty.display = not rows
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(int(event.row_key.value))

    def action_cancel(self) -> None:
        self.dismiss(None)
