"""A file picker for adding a file to the message being written: the current directory as a tree
(Textual's DirectoryTree); Enter on a file picks it, Esc closes."""
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Label


class FilePickerScreen(ModalScreen[Path | None]):
    CSS_PATH = Path(__file__).with_name("file_picker_screen.tcss")
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def compose(self) -> ComposeResult:
        with Vertical(id="file-picker-box"):
            yield Label(f"Add a file to the message  (Enter picks, Esc closes)\n{self.root}", id="file-picker-heading")
            yield DirectoryTree(self.root, id="file-picker-tree")

    def on_mount(self) -> None:
        self.query_one(DirectoryTree).focus()

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        event.stop()
        self.dismiss(event.path)

    def action_cancel(self) -> None:
        self.dismiss(None)
