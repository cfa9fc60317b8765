"""The message box under each transcript: a TextArea where the send key sends and the newline
keys (shift+enter, ctrl+j) break lines."""
from textual.widgets import TextArea

from nvchat.app.bindings import PROMPT_KEYS, bindings
from nvchat.app.messages import PromptSubmitted


class PromptInput(TextArea):
    BINDINGS = bindings(PROMPT_KEYS)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         placeholder="Message…  (Enter sends, Shift+Enter or Ctrl+J for a new line)")

    def action_send(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(PromptSubmitted(text))
            self.clear()

    def action_newline(self) -> None:
        self.insert("\n")
