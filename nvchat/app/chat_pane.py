"""One conversation's tab body: the transcript, a status line and the prompt box.

Conversation calls (tokenizing, SQLite writes) run on the app's conversation thread through the
`background` callable, never on the UI thread. While a turn is in flight (from submit until its
reply is stored) the pane is busy: a message sent meanwhile waits in its queue, shown dimmed at
the foot of the transcript, and starts the next turn when the reply is stored (Esc puts the queue
back in the box); regenerating and editing are refused. So the transcript always matches
conversation.messages, then the queue, once it is idle.

The pane is handed what it needs from outside (that callable, the keymap, whether its tab is the
one shown) and tells the app what happened through its own messages (ReplyStarted, StateChanged);
it reaches into the app for nothing but Textual's own services (notify).
"""
from __future__ import annotations

import time
from typing import Awaitable, Callable

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.message import Message as TextualMessage
from textual.timer import Timer
from textual.widgets import Static, TextArea

from engine import RequestStream
from nvchat.app.events import PromptSubmitted, ScrollTranscript
from nvchat.app.message_view import QueuedMessageView, ReplyView, UserMessageView
from nvchat.app.prompt_input import PromptInput
from nvchat.attachments import AttachmentError, attach
from nvchat.conversation import Conversation, Message, first_line, reply_stats
from nvchat.slash_table import as_typed

Background = Callable[..., Awaitable]
_DEFAULT_TITLE = "New chat"
_AUTO_TITLE_CHARS = 40
# A streaming reply is stored this often (and when it ends): what a kill of the process can lose.
SAVE_EVERY_S = 2.0


class ChatPane(Vertical):
    class ReplyStarted(TextualMessage):
        """The pane has a new stream for the app's pump to drain."""

        def __init__(self, pane: ChatPane) -> None:
            super().__init__()
            self.pane = pane

    class StateChanged(TextualMessage):
        """The chat's title or busy state changed: its tab label needs redrawing."""

        def __init__(self, pane: ChatPane) -> None:
            super().__init__()
            self.pane = pane

    # The unsent text is stored once typing pauses this long (not per key), at least this often
    # while typing goes on, and at once when the tab closes, another tab is shown or the app quits:
    # what a kill while typing can lose.
    DRAFT_SAVE_DELAY_S = 1.5
    DRAFT_SAVE_MAX_WAIT_S = 10.0

    def __init__(self, conversation: Conversation, *, background: Background, is_shown: Callable[[], bool],
                 keymap: dict[str, str], color: str, color_slot: int, note: str | None = None,
                 id: str | None = None) -> None:
        """is_shown: whether this chat's tab is the one shown; keymap: config.toml's [keys]."""
        super().__init__(id=id)
        self.conversation = conversation
        self.background = background
        self.is_shown = is_shown
        self.color = color
        self.color_slot = color_slot  # which tab colour this chat wears, kept when tabs close
        self.note = note
        self.stream: RequestStream | None = None  # the reply being generated
        self.last_stream: RequestStream | None = None  # the latest reply's, for /stats
        self.busy = False
        self.editing = False
        self._reply_view: ReplyView | None = None  # the reply being generated, until it is stored
        self._last_reply: ReplyView | None = None  # the latest live reply, which may not be drawn in full yet
        # A turn started in a hidden tab mounts its views when the tab is first shown (catch_up).
        self._views_pending = False
        self._next_save = 0.0  # when the streaming reply is next stored
        self._left_out_noted = False  # said once that old turns no longer fit the model
        self._stop_requested = False  # Esc before the turn's stream existed
        self._draft = ""  # what the box held when F3 put the last message there; back after the edit
        self._draft_timer: Timer | None = None  # a draft save waiting for typing to pause
        self._draft_due = 0.0  # when that save is made even if typing goes on
        self.queued: list[QueuedMessageView] = []  # messages sent while busy, first out first
        # Held: the app reads its draft after the DOM is gone.
        self._prompt = PromptInput(keymap=keymap, id="prompt")

    # --- layout ------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="transcript"):
            yield Static(self._banner_text(), id="system-banner")
            yield Static(self._hint_text(), id="empty-hint")
            for message in self.conversation.messages:
                yield self._view_for(message)
        # In a container of their own: Textual redraws every child of a container whose area an
        # update touches, and the prompt box (a TextArea) re-derives its theme on each redraw, so as
        # a sibling of the transcript it was redrawn with every streamed update.
        with Vertical(id="composer"):
            yield Static(id="chat-status")
            yield self._prompt

    def on_mount(self) -> None:
        # Anchored: follows new output until the user scrolls up, and again once back at the bottom.
        self.transcript.anchor()
        self._refresh_hint()
        if self.conversation.draft:
            self.prompt.text = self.conversation.draft
            self.prompt.move_cursor(self.prompt.document.end)
        if self.conversation.messages and self.conversation.max_context:
            self.run_worker(self._show_stored_context(), exit_on_error=False)

    def on_key(self, event: events.Key) -> None:
        """Typing while the transcript or a code block has the focus (after a click, or Shift+Tab)
        goes on in the prompt box rather than nowhere. Keys bound there (c copies a block) stay."""
        if not event.is_printable or self.prompt.has_focus or event.key in self.screen.active_bindings:
            return
        event.stop()
        event.prevent_default()
        self.prompt.focus()
        self.prompt.insert(event.character)

    def on_scroll_transcript(self, event: ScrollTranscript) -> None:
        event.stop()
        if event.pages < 0:
            self.transcript.scroll_page_up()
        else:
            self.transcript.scroll_page_down()

    def on_paste(self, event: events.Paste) -> None:
        if not self.prompt.has_focus:  # a paste into the box bubbles up here too, already inserted
            event.stop()
            self.prompt.focus()
            self.prompt.insert(event.text)

    @property
    def transcript(self) -> VerticalScroll:
        return self.query_one("#transcript", VerticalScroll)

    @property
    def prompt(self) -> PromptInput:
        return self._prompt

    # --- the unsent draft ----------------------------------------------------------------------------

    @property
    def draft(self) -> str:
        """What the user typed and has not sent: the box's text, and while F3's edit holds it, what
        the box held before (the edited message itself is not a draft: it is stored already)."""
        if self.editing:
            return self._draft
        typed = self.prompt.text
        if self.queued:  # not sent yet either: kept with the draft if the tab closes or the app quits
            typed = _before_typed(self._queued_text(), typed)
        if self._draft:  # an edit was sent and its reply is starting: the kept draft comes back next
            return _before_typed(self._draft, typed)
        return typed

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area is not self.prompt:
            return
        if self._draft_timer is None:
            self._draft_timer = self.set_timer(self.DRAFT_SAVE_DELAY_S, self.save_draft)
            self._draft_due = time.monotonic() + self.DRAFT_SAVE_MAX_WAIT_S
        elif time.monotonic() >= self._draft_due:
            self.save_draft()
        else:
            self._draft_timer.reset()

    def stop_draft_timer(self) -> None:
        if self._draft_timer is not None:
            self._draft_timer.stop()
            self._draft_timer = None

    def save_draft(self):
        """Stores the draft now, on the conversation thread (a no-op there if it is unchanged)."""
        self.stop_draft_timer()
        saved = self.background(self.conversation.save_draft, self.draft)
        saved.add_done_callback(self._draft_saved)
        return saved

    def flush_draft(self) -> None:
        """Stores the draft at once if a save is waiting for typing to pause."""
        if self._draft_timer is not None:
            self.save_draft()

    def _draft_saved(self, future) -> None:
        if future.cancelled() or future.exception() is None:
            return
        try:  # through the app: the tab may have closed since
            self.app.notify(f"The unsent text could not be stored: {future.exception()}", title="Storage error",
                            severity="error", timeout=10)
        except Exception:  # the app has gone too
            pass

    @staticmethod
    def _view_for(message: Message):
        return UserMessageView(message) if message.role == "user" else ReplyView(message)

    def _banner_text(self) -> Content:
        prompt = self.conversation.system_prompt
        text = first_line(prompt, 100) if prompt else "(none)"
        return Content.assemble(("system ", "bold"), text, ("  F4 edits", "dim"))

    def _hint_text(self) -> Content:
        parts: list = ["Type a message below: Enter sends, Shift+Enter or Ctrl+J starts a new line, Esc stops "
                       "a reply. Ctrl+O reopens past chats, F1 lists every key and /command (/help), Ctrl+P opens the "
                       "command palette."]
        if self.note:
            parts.append(("\n\n" + self.note.capitalize() + ".", "italic"))
        return Content.assemble(*parts)

    def _refresh_hint(self) -> None:
        self.query_one("#empty-hint").display = not self.conversation.messages and self._reply_view is None

    def refresh_banner(self) -> None:
        self.query_one("#system-banner", Static).update(self._banner_text())

    def _set_status(self, text: str) -> None:
        status = self.query_one("#chat-status", Static)
        status.update(text)
        status.display = bool(text)

    def _set_busy(self, busy: bool) -> None:
        self.busy = busy
        if not busy:
            self._stop_requested = False
        self._show_busy_status()
        self.post_message(self.StateChanged(self))

    def _show_busy_status(self) -> None:
        if not self.busy:
            self._set_status("")
        elif self.queued:
            self._set_status(f"generating… {len(self.queued)} queued to send next · Esc stops and puts "
                             f"{'it' if len(self.queued) == 1 else 'them'} back in the box")
        else:
            self._set_status("generating… Esc stops")

    async def _sync_views(self, reply: ReplyView | None = None) -> None:
        """Makes the transcript show exactly conversation.messages (after a turn dropped or added some),
        then `reply`, the turn's reply view, not mounted yet: it goes last, live or standing for the
        stored message it holds."""
        kept = {id(m) for m in self.conversation.messages}
        views = [v for v in self.transcript.children if isinstance(v, (UserMessageView, ReplyView))]
        stale = [v for v in views if v.message is None or id(v.message) not in kept]
        if stale:
            await self.transcript.remove_children(stale)
        shown = {id(v.message) for v in views if v not in stale}
        if reply is not None and reply.message is not None:
            shown.add(id(reply.message))
        new = [self._view_for(m) for m in self.conversation.messages if id(m) not in shown]
        if reply is not None and (reply is self._reply_view or id(reply.message) in kept):
            new.append(reply)
        if new:
            # Above the queue, which stays at the foot.
            await self.transcript.mount_all(new, before=self.queued[0] if self.queued else None)

    # --- turns -------------------------------------------------------------------------------------

    def _refuse_if_busy(self) -> bool:
        if self.busy:
            self.notify("This chat is still replying: wait, or press Esc to stop it.", severity="warning")
        return self.busy

    def on_prompt_submitted(self, event: PromptSubmitted) -> None:
        event.stop()
        if self.busy or self.queued:
            self._queue(event.text)
            return
        start = self.conversation.edit_last_user if self.editing else self.conversation.send
        self._set_busy(True)  # now, not when the worker starts: a second turn must not start meanwhile
        self.run_worker(self._turn(start, event.text, restore=event.text, was_editing=self.editing))
        self.editing = False

    # --- the queue -----------------------------------------------------------------------------------

    def _queue(self, text: str) -> None:
        view = QueuedMessageView(text)
        self.queued.append(view)
        self.transcript.mount(view)
        self._show_busy_status()

    def _queued_text(self) -> str:
        return "\n".join(as_typed(view.text) for view in self.queued)

    def unqueue(self) -> None:
        """Puts the queued messages back in the box, in order, before whatever was typed since."""
        if not self.queued:
            return
        text = self._queued_text()
        views, self.queued = self.queued, []
        self.transcript.remove_children(views)
        self._restore_prompt(text)
        self._show_busy_status()

    def _send_next_queued(self) -> None:
        """The reply is stored: the first queued message starts the next turn."""
        view = self.queued.pop(0)
        view.remove()
        self._set_busy(True)
        self.run_worker(self._turn(self.conversation.send, view.text, restore=view.text))

    def _give_back_draft(self) -> None:
        draft, self._draft = self._draft, ""
        if draft:
            self._restore_prompt(draft)

    def _restore_prompt(self, text: str) -> None:
        """Puts a message that was not sent back in the box, before whatever was typed since."""
        self.prompt.text = _before_typed(text, self.prompt.text)
        self.prompt.move_cursor(self.prompt.document.end)

    def regenerate(self) -> None:
        if self._refuse_if_busy():
            return
        if not any(m.role == "user" for m in self.conversation.messages):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        self._set_busy(True)
        self.run_worker(self._turn(self.conversation.regenerate))

    def start_edit(self) -> None:
        if self._refuse_if_busy():
            return
        text = self.conversation.last_user_text
        if text is None:
            self.notify("No message to edit yet.", severity="warning")
            return
        if not self.editing:
            self._draft = self.prompt.text if self.prompt.text.strip() else ""
        self.editing = True
        self.prompt.text = as_typed(text)
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()
        self._set_status("editing your last message: Enter resends, Esc cancels")
        self.post_message(self.StateChanged(self))

    def cancel_edit(self) -> None:
        self.editing = False
        self.prompt.clear()
        self._give_back_draft()
        self._set_status("")
        self.post_message(self.StateChanged(self))

    def stop(self) -> None:
        """Esc: stops the reply and puts the queue back in the box, or leaves edit mode."""
        self.unqueue()
        if self.stream is not None:
            self.stream.abort()
        elif self.busy:
            self._stop_requested = True  # the turn is starting: its stream is stopped once it has one
        elif self.editing:
            self.cancel_edit()

    async def _turn(self, start: Callable[..., RequestStream], *args, restore: str | None = None,
                    was_editing: bool = False) -> None:
        self._set_busy(True)
        first_turn = not self.conversation.messages
        try:
            stream = await self.background(start, *args)
        except Exception as e:  # a refused prompt (too long, engine stopped) leaves the conversation as it was
            self._set_busy(False)
            self.unqueue()  # what was queued after it stays unsent too, back in the box after it
            if restore is not None:
                self._restore_prompt(as_typed(restore))
                if was_editing:
                    self.editing = True
                    self._set_status("editing your last message: Enter resends, Esc cancels")
            self.notify(str(e), title="Could not send", severity="error", timeout=8)
            return
        # Claimed at once: an Esc, a closed tab or a quit while the views below mount finds it.
        self.stream = self.last_stream = stream
        if was_editing:
            self._give_back_draft()
        self._next_save = 0.0  # its first text is stored at once
        if self._stop_requested:  # Esc came while the turn was starting
            stream.abort()
        self._reply_view = self._last_reply = ReplyView()
        self._refresh_hint()
        if self.is_shown():
            await self._sync_views(self._reply_view)
        else:
            # Eight tabs mounting and laying out their views at once held the UI thread for about
            # half a second, and through the GIL the engine; a hidden tab has nothing to show yet.
            self._views_pending = True
        if self.stream is not stream:  # its tab closed or the app quit meanwhile, and stored the reply
            return
        if self.conversation.left_out and not self._left_out_noted:
            self._left_out_noted = True
            await self._note_left_out()
            if self.stream is not stream:
                return
        self._show_context(stream.num_prompt_tokens)
        self.post_message(self.ReplyStarted(self))
        if first_turn and self.conversation.title == _DEFAULT_TITLE and args:
            await self.rename(first_line(args[0], _AUTO_TITLE_CHARS))

    async def pump(self, shown: bool, draw: bool = True) -> bool:
        """Moves what the stream produced since the last tick into the reply; True once it has ended.
        Called by the app's stream pump (NvchatApp.PUMP_HZ). Shown, it draws when draw says a frame
        is due (the app paces them), and always its last one. A chat in a hidden tab keeps receiving
        but draws nothing until it is shown (catch_up()): nobody sees it, and parsing and laying it
        out would take time from the visible chat and, through the GIL, from the engine."""
        stream, view = self.stream, self._reply_view
        if stream is None or view is None:
            return True
        ended = stream.finished  # read before draining, so this drain holds the last tokens
        delta = stream.drain()
        if delta is not None and delta.text:
            view.receive(delta.text)
            now = time.monotonic()
            if not ended and now >= self._next_save:
                self._next_save = now + SAVE_EVERY_S
                self.background(self.conversation.save_reply_so_far, stream).add_done_callback(self._saved)
        if ended:
            self._show_context(stream.num_prompt_tokens + stream.num_completion_tokens)
            # Claimed and queued before any await: a tab closed or an app quit meanwhile finds no
            # stream to store, so the reply is stored exactly once, and the write already waits.
            self.stream = None
            stored = self.background(self.conversation.finish_reply, stream)
            view.end(reply_stats(stream))
        try:
            if shown and (draw or ended):
                await view.catch_up()
        finally:
            # Even when drawing failed: the pump drops this chat after its last tick, and only
            # _store_reply ends the turn.
            if ended:
                if stream.finish_reason == "error":
                    self.notify(stream.error or "generation failed", title="Engine error", severity="error",
                                timeout=10)
                self.run_worker(self._store_reply(stored, view), exit_on_error=False)
        return ended

    async def _note_left_out(self) -> None:
        limit = self.conversation.max_context
        note = Static(f"This conversation no longer fits the model's context ({limit} tokens): from now on the "
                      "oldest turns are left out of what the model sees (the system prompt and your latest "
                      "message always go).", classes="context-note")
        reply = self._reply_view
        if reply is not None and reply.parent is self.transcript:
            await self.transcript.mount(note, before=reply)
        else:
            await self.transcript.mount(note)

    def show_note(self, text: str, classes: str) -> None:
        """Text for the user at the foot of the transcript (above any queued messages), not stored:
        read at leisure and scrolled away, where a notification would cover part of the screen."""
        self.transcript.mount(Static(Content(text), classes=classes), before=self.queued[0] if self.queued else None)
        self.transcript.scroll_end(animate=False)

    def _show_context(self, tokens: int) -> None:
        """The context the conversation fills, under the prompt box."""
        limit = self.conversation.max_context
        if limit:
            self.prompt.border_subtitle = f"context {tokens} / {limit} tokens"

    async def _show_stored_context(self) -> None:
        """A reopened chat's context figure, before its next turn."""
        try:
            tokens = await self.background(self.conversation.context_tokens)
        except Exception:  # only a figure: the next turn shows it anyway
            return
        if tokens is not None and not self.busy and not self.prompt.border_subtitle:
            self._show_context(tokens)

    def _saved(self, future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.notify(f"The reply so far could not be stored: {future.exception()}", title="Storage error",
                        severity="error", timeout=10)

    async def catch_up(self) -> None:
        """Draws what the reply received while the tab was hidden (its tab was just shown)."""
        view = self._last_reply
        if self._views_pending:
            self._views_pending = False
            await self._sync_views(view)
        if view is not None and view.behind and view.is_attached:
            await view.catch_up()

    async def _store_reply(self, stored, view: ReplyView) -> None:
        try:
            message = await stored
        except Exception as e:  # the reply stays on screen; Ctrl+S can still export it
            self.notify(f"The reply could not be stored: {e}", title="Storage error", severity="error", timeout=10)
        else:
            if message is None and view.is_attached:  # failed before producing anything: nothing to keep
                await view.remove()
            view.message = message
        self._reply_view = None
        self._refresh_hint()
        self._set_busy(False)
        if self.queued:
            self._send_next_queued()

    async def attach_file(self, name: str, typed: str | None = None) -> None:
        """Adds the file's text to the message being written, at the cursor (read and checked on
        the conversation thread); a file that can't go in is a notification that says why, and
        typed (the /file command) goes back in the box to fix."""
        try:
            attachment = await self.background(attach, self.conversation, name)
        except (AttachmentError, OSError) as e:
            self.notify(str(e), title="File not added", severity="error", timeout=10)
            if typed is not None:
                self._restore_prompt(typed)
            return
        if self.prompt.cursor_location[1]:
            self.prompt.insert("\n")
        self.prompt.insert(attachment.block)
        self.prompt.focus()
        tokens = "" if attachment.tokens is None else f" ({attachment.tokens} tokens)"
        self.notify(f"{attachment.name}{tokens}", title="File added to the message")

    # --- chat settings -------------------------------------------------------------------------------

    async def _store(self, what: str, fn, *args) -> bool:
        try:
            await self.background(fn, *args)
        except Exception as e:
            self.notify(f"Could not save the {what}: {e}", title="Storage error", severity="error")
            return False
        return True

    async def rename(self, title: str) -> None:
        await self._store("title", self.conversation.rename, title)
        self.post_message(self.StateChanged(self))

    async def set_sampling(self, sampling: dict) -> None:
        if await self._store("sampling settings", self.conversation.set_sampling, sampling):
            values = self.conversation.sampling_params()
            self.notify(f"temperature {values.temperature:g}, top-p {values.top_p:g}, top-k {values.top_k}, "
                        f"max tokens {values.max_tokens}", title="Sampling for this chat")

    async def set_system_prompt(self, text: str) -> None:
        await self._store("system prompt", self.conversation.set_system_prompt, text)
        self.refresh_banner()


def _before_typed(text: str, typed: str) -> str:
    """text put back in the prompt box above what was typed since (if anything was)."""
    return f"{text}\n{typed}" if typed.strip() else text
