"""Past conversations, newest first, filtered by the words typed above them (titles and messages,
through the store's full-text index); Enter reopens the highlighted one in a tab. One holding an
unsent draft says so."""
import time
from pathlib import Path
from typing import Awaitable, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label

from nvchat.store import ConversationRow


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


_DRAFT_MARK = "  ✎ draft"
_WHEN_WIDTH = len("2000-01-01 00:00")
_COUNT_WIDTH = len("Messages")
_MIN_TITLE = 16


def _model_label(model: str) -> str:
    """A checkpoint's or GGUF file's name without its directories; a repo id or name as it is."""
    return Path(model).name if model.startswith(("/", "~", ".")) else model


class ConversationsScreen(ModalScreen[int | None]):
    """Dismisses with the chosen conversation's id, or None."""

    CSS_PATH = Path(__file__).with_name("conversations_screen.tcss")
    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("down", "to_table", show=False)]

    def __init__(self, search: Callable[[str], Awaitable[list[ConversationRow]]]) -> None:
        super().__init__()
        self.search = search  # runs off the UI thread; "" lists them all

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations-box"):
            yield Label("Past conversations  (type to search, ↓ and Enter open, Esc closes)",
                        id="conversations-heading")
            yield Input(placeholder="Search titles and messages…", id="conversations-search")
            yield Label("loading…", id="conversations-empty")
            yield DataTable(id="conversations-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Title", "Updated", "Messages", "Model")
        self.query_one(Input).focus()
        self.run_worker(self._load(""), exclusive=True)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.run_worker(self._load(event.value), exclusive=True)  # a newer search replaces an older one

    def on_input_submitted(self, event: Input.Submitted) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            self.dismiss(int(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value))

    def action_to_table(self) -> None:
        self.query_one(DataTable).focus()

    async def _load(self, text: str) -> None:
        try:
            rows = await self.search(text)
        except Exception as e:
            self.query_one("#conversations-empty", Label).update(f"Could not read the conversations: {e}")
            return
        table = self.query_one(DataTable)
        table.clear()
        room = self._title_room(table, [_model_label(row.model) for row in rows])
        for row in rows:
            marked = bool(row.draft.strip())  # words typed there and not sent wait in it
            title = Text(row.title, no_wrap=True, overflow="ellipsis")
            title.truncate(max(1, room - len(_DRAFT_MARK) * marked), overflow="ellipsis")
            if marked:
                title.append(_DRAFT_MARK, style="italic")
            table.add_row(title, _when(row.updated_at), str(row.num_messages), Text(_model_label(row.model)),
                          key=str(row.id))
        empty = self.query_one("#conversations-empty", Label)
        empty.update("" if rows else f"No conversation has “{text.strip()}”." if text.strip()
                     else "No saved conversations yet.")
        empty.display = not rows

    @staticmethod
    def _title_room(table: DataTable, models: list[str]) -> int:
        """The columns a title may take: a long title is cut (…) so that the model fits whole beside
        the date and the count, down to half the room they leave; on a narrower table
        the model is the one cut, at the table's edge."""
        # Each column is padded by cell_padding on both sides; the vertical scrollbar takes its own.
        padding = 2 * table.cell_padding * 4 + table.styles.scrollbar_size_vertical
        room = table.size.width - padding - _WHEN_WIDTH - _COUNT_WIDTH
        model = max([len("Model"), *map(len, models)])
        return max(_MIN_TITLE, room - model, room // 2)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(int(event.row_key.value))

    def action_cancel(self) -> None:
        self.dismiss(None)
