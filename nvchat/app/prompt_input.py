"""The message box under each transcript: a TextArea where the send key sends and the newline
keys (shift+enter, ctrl+j) break lines. A line that names a slash command runs it instead of being
sent (nvchat.slash_table), and a command's name is offered as it is typed (Right or Tab takes it)."""
from textual import events
from textual.widgets import TextArea

from nvchat.app.bindings import PROMPT_KEYS, bindings, effective_key
from nvchat.app.events import PromptSubmitted, ScrollTranscript, SlashCommandSubmitted
from nvchat.slash_table import APP, completion, message_text, parse, unknown_notice


class PromptInput(TextArea):
    # Not priority bindings: the box's own key handler runs them (_on_key). A priority binding runs
    # on the app's queue the moment the app reads the key, while the keys before it still wait in
    # this widget's queue: text and Enter arriving in one terminal read (a paste, a fast typist,
    # tmux send-keys, keys typed while the UI thread is busy) sent an empty box and then filled it.
    BINDINGS = bindings(PROMPT_KEYS)

    def __init__(self, *, keymap: dict[str, str], id: str | None = None) -> None:
        """keymap: config.toml's [keys], which may remap the box's keys too."""
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         placeholder="Message…  (Enter sends, Shift+Enter or Ctrl+J for a new line)")
        self._keymap = keymap
        self._key_actions: dict[str, str] | None = None

    def _action_for(self, key: str) -> str | None:
        if self._key_actions is None:
            self._key_actions = {k.strip(): spec.action for spec in PROMPT_KEYS
                                 for k in effective_key(spec, self._keymap).split(",") if k.strip()}
        return self._key_actions.get(key)

    async def _on_key(self, event: events.Key) -> None:
        # In this widget's queue, so after every key and paste that arrived before it.
        action = self._action_for(event.key)
        if event.key == "tab" and self.suggestion:
            action = "complete"
        if action is None:
            return  # TextArea's own handler inserts it
        event.stop()
        event.prevent_default()
        await self.run_action(action)

    def action_send(self) -> None:
        text = self.text.strip()
        if not text:
            return
        # Commands run at once, while a reply streams too (/stop, /new, /stats); a message sent
        # meanwhile waits in its chat's queue (ChatPane).
        invocation = parse(text, APP)
        if invocation is not None:
            if invocation.command is None:  # kept in the box, to fix or to escape with //
                self.notify(unknown_notice(invocation.name, APP), title="Not sent", severity="warning")
                return
            self.post_message(SlashCommandSubmitted(invocation.command.name, invocation.arg))
            self.clear()
            return
        self.post_message(PromptSubmitted(message_text(text)))
        self.clear()

    def update_suggestion(self) -> None:
        """The rest of a command's name while one is typed at the end of a one-line box."""
        # Runs on every edit and cursor move: a long message is never joined into one string.
        document, suggestion = self.document, ""
        text = document.get_line(0) if document.line_count == 1 else ""
        if (text.startswith("/") and not text.startswith("//") and not any(c.isspace() for c in text)
                and self.selection.end == document.end):
            name = completion(text[1:], APP)
            suggestion = name[len(text) - 1:] if name else ""
        self.suggestion = suggestion

    def watch_selection(self) -> None:
        # The suggestion is drawn at the cursor: it goes when the cursor leaves the end.
        self.update_suggestion()

    def action_complete(self) -> None:
        self.insert(self.suggestion)

    def action_newline(self) -> None:
        self.insert("\n")

    def action_scroll_chat(self, pages: int) -> None:
        # Rather than paging through the box, which is a few lines: the transcript above is what
        # a user pages through.
        self.post_message(ScrollTranscript(pages))
