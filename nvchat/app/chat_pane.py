"""One conversation's tab body: the transcript, a status line and the prompt box.

Conversation calls (tokenizing, SQLite writes) run on the app's conversation thread through the
`background` callable, never on the UI thread. While a turn is in flight (from submit until its
replies are stored) the pane is busy: a message sent meanwhile waits in its queue, shown
dimmed at the foot of the transcript (below any alternatives), and starts the next turn once every
reply of the turn is stored and its tool calls are done (Esc stops the replies and puts the queue
back in the box); new turns of other kinds and branch switches are refused. So the transcript always
matches conversation.messages, then the queue, once it is idle (with one exception: alternatives
stay side by side, the first one standing for the branch shown, until one is picked or the chat
moves on).

Branches: Alt+Up/Down select a message; F3 edits the selected user message (else the last), Ctrl+R
regenerates the selected reply (else the last), F8/F9 show the previous/next sibling of the selected
message (else of the latest message that has any). Each makes or shows a branch; none replaces one.

A conversation that another nvchat process is writing is read-only here: its box takes no text, a
note says so, and it becomes writable when shown again after that process let it go.

The pane is handed what it needs from outside (that callable, the keymap, whether its tab is the
one shown) and tells the app what happened through its own messages (ReplyStarted, StateChanged);
it reaches into the app for nothing but Textual's own services (notify).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Awaitable, Callable, NamedTuple

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.message import Message as TextualMessage
from textual.timer import Timer
from textual.widgets import Static, TextArea

from engine import RequestStream
from nvchat.app.events import PromptSubmitted, ScrollTranscript
from nvchat.app.message_view import AlternativesView, QueuedMessageView, ReplyView, UserMessageView
from nvchat.app.prompt_input import PromptInput
from nvchat.app.tool_views import ToolCallView
from nvchat.attachments import AttachmentError, attach
from nvchat.conversation import (
    DEFAULT_ALTERNATIVES,
    SAVE_EVERY_S,
    Conversation,
    Message,
    first_line,
    reply_stats,
)
from nvchat.slash_table import as_typed

Background = Callable[..., Awaitable]
_DEFAULT_TITLE = "New chat"
_AUTO_TITLE_CHARS = 40


class Activity(NamedTuple):
    """What a busy chat is doing, as its status line says it."""

    doing: str
    esc: str | None  # what Esc does to it; None while a dialog takes the keys
    stopping: str  # said instead of esc once Esc was pressed


GENERATING = Activity("generating…", "Esc stops", "stopping")
CALLING_TOOLS = Activity("the reply calls tools…", "Esc stops", "stopping")


@dataclass(eq=False)
class LiveReply:
    """One reply of the turn in flight: its stream, its view, and its stored message once queued."""

    stream: RequestStream
    view: ReplyView
    show: bool  # the branch shown ends with it once stored (not for alternatives)
    next_save: float = 0.0  # when it is next stored while it streams
    stored: object = None  # the finish_reply() future, once it ended


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

    class ToolCallsMade(TextualMessage):
        """The stored reply calls tools: the app asks for approval and runs them; the pane stays busy
        until it continues the reply (continue_after_tools) or ends the turn (end_tool_round)."""

        def __init__(self, pane: ChatPane, message: Message) -> None:
            super().__init__()
            self.pane = pane
            self.message = message

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
        self._live: list[LiveReply] = []  # the turn's replies still streaming (one, or alternatives)
        self._replies: list[LiveReply] = []  # the turn's replies, until they are stored
        self.last_stream: RequestStream | None = None  # the latest reply's, for /stats
        self.busy = False
        self._activity = GENERATING  # what the turn is doing while busy
        self.editing = False
        self._edit_index: int | None = None  # which message of the branch shown F3 is editing
        self.cursor: int | None = None  # the message selected (Alt+Up/Down), an index into the branch shown
        # The turn's view being generated (a ReplyView, or an AlternativesView), until it is stored.
        self._reply_view: ReplyView | AlternativesView | None = None
        self._last_reply: ReplyView | AlternativesView | None = None  # the latest, maybe not drawn in full yet
        self._alternatives: AlternativesView | None = None  # alternatives up until one is picked
        # A turn started in a hidden tab mounts its views when the tab is first shown (catch_up).
        self._views_pending = False
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
        self._refresh_marks()
        self._show_read_only()
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
        if self.prompt.read_only:
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
            if self.prompt.read_only:
                return
            self.prompt.focus()
            self.prompt.insert(event.text)

    @property
    def transcript(self) -> VerticalScroll:
        return self.query_one("#transcript", VerticalScroll)

    @property
    def prompt(self) -> PromptInput:
        return self._prompt

    @property
    def stream(self) -> RequestStream | None:
        """The reply being generated (the first, with alternatives), until it ended and is claimed."""
        return self._live[0].stream if self._live else None

    @property
    def streams(self) -> list[RequestStream]:
        return [live.stream for live in self._live]

    @property
    def has_alternatives(self) -> bool:
        """Alternatives are up to pick from."""
        return self._alternatives is not None

    def take_streams(self) -> list[RequestStream]:
        """Claims the replies still streaming (the tab closes, the app quits), first one first: the
        caller stops and stores them, and the pump no longer does."""
        streams, self._live = self.streams, []
        return streams

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
        if message.role == "tool" and message.answered_call is not None:
            return ToolCallView(message.answered_call, message)
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
            self._activity = GENERATING
        self._show_busy_status()
        self.post_message(self.StateChanged(self))

    def _set_activity(self, activity: Activity) -> None:
        self._activity = activity
        self._show_busy_status()

    def _show_busy_status(self) -> None:
        if not self.busy:
            self._set_status(self._idle_status())
            return
        doing, esc, stopping = self._activity
        count = len(self.queued)
        if self._stop_requested:
            esc = stopping
        elif count and esc is not None:
            esc += f" and puts {'it' if count == 1 else 'them'} back in the box"
        if not count:
            self._set_status(doing if esc is None else f"{doing} {esc}")
            return
        parts = [doing, f"{count} queued to send next"] + ([esc] if esc is not None else [])
        self._set_status(" · ".join(parts))

    def _idle_status(self) -> str:
        if self.conversation.read_only:
            return f"Read-only: {self.conversation.read_only}. Then show this tab again to write here."
        if self.cursor is not None:
            return (f"message {self.cursor + 1} of {len(self.conversation.messages)} selected: F3 edits, "
                    "Ctrl+R regenerates, F8/F9 switch branches, Esc unselects")
        if self._alternatives is not None:
            count = len(self._alternatives.replies)
            return (f"Pick one: Alt+1…Alt+{count} or /pick N (a click does too); the chat goes on from "
                    "the one outlined")
        return ""

    def _refresh_status(self) -> None:
        if not self.busy and not self.editing:
            self._set_status(self._idle_status())

    def _show_read_only(self) -> None:
        read_only = self.conversation.read_only is not None
        self.prompt.read_only = read_only
        self.set_class(read_only, "-read-only")
        self._refresh_status()

    async def _sync_views(self, reply: ReplyView | AlternativesView | None = None) -> None:
        """Makes the transcript show exactly conversation.messages (after a turn dropped or added some),
        then `reply`, the turn's view, not mounted yet: it goes last, live or standing for the stored
        message(s) it holds. Alternatives up for picking stay, standing for the last message."""
        kept = {id(m) for m in self.conversation.messages}
        views = [v for v in self.transcript.children if isinstance(v, (UserMessageView, ReplyView, ToolCallView))]
        stale = [v for v in views if v.message is None or id(v.message) not in kept]
        if stale:
            await self.transcript.remove_children(stale)
        shown = {id(v.message) for v in views if v not in stale}
        for alternatives in (reply, self._alternatives):
            if isinstance(alternatives, AlternativesView):
                shown.update(id(m) for m in alternatives.messages)
        if reply is not None and reply.message is not None:
            shown.add(id(reply.message))
        new = [self._view_for(m) for m in self.conversation.messages if id(m) not in shown]
        if reply is not None and (reply is self._reply_view or reply is self._alternatives
                                  or id(reply.message) in kept):
            new.append(reply)
        if new:
            # Above the queue, which stays at the foot.
            await self.transcript.mount_all(new, before=self.queued[0] if self.queued else None)
        self._refresh_marks()

    def _refresh_marks(self) -> None:
        """Each message's ◀ 2/3 ▶, and the selected one's outline."""
        selected = self.conversation.messages[self.cursor] if self.cursor is not None else None
        for view in self.transcript.children:
            if isinstance(view, (UserMessageView, ReplyView)) and view.message is not None:
                which, of = self.conversation.branch_position(view.message)
                view.mark_branch(which, of, view.message is selected)
        if self._alternatives is not None:
            messages = self.conversation.messages
            self._alternatives.mark_shown(messages[-1] if messages else None)

    def _view_of(self, message: Message):
        for view in self.transcript.children:
            if isinstance(view, (UserMessageView, ReplyView)) and view.message is message:
                return view
        return None

    async def _close_alternatives(self) -> None:
        """The alternatives make way for the one the branch shown goes through, as a reply like any."""
        view, self._alternatives = self._alternatives, None
        if view is not None:
            if view.is_attached:
                await view.remove()
            if self._last_reply is view:
                self._last_reply = None

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
        self._submit_prompt(event.text)

    def _submit_prompt(self, text: str, alternatives: int = 1) -> None:
        if self._refuse_if_busy():
            self._restore_prompt(as_typed(text))
            return
        self._set_busy(True)  # now, not when the worker starts: a second turn must not start meanwhile
        if self.editing:
            index = self._edit_index
            self.run_worker(self._turn(self.conversation.edit, index, text, alternatives=alternatives, restore=text,
                                       edit_index=index))
        else:
            self.run_worker(self._turn(self.conversation.send, text, alternatives=alternatives, restore=text))
        self.editing = False
        self._edit_index = None

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

    def _end_turn(self) -> None:
        """Every reply of the turn is stored and its tool calls are done: the pane goes idle, and
        the first queued message, if any, starts the next turn."""
        self._set_busy(False)
        if self.queued:
            self._send_next_queued()

    def _send_next_queued(self) -> None:
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

    def regenerate(self, alternatives: int = 1) -> None:
        """A new reply (or several) beside the selected reply, or to the selected message, or to
        the last message: the reply it replaces stays, as a branch (F8/F9 show it again)."""
        if self._refuse_if_busy():
            return
        if not any(m.role == "user" for m in self.conversation.messages):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        self._set_busy(True)
        self.run_worker(self._turn(self.conversation.regenerate, self.cursor, alternatives=alternatives))

    def alternatives(self, count: int = DEFAULT_ALTERNATIVES) -> None:
        """count replies at once: to the message in the box (sent now), else beside the selected or
        last reply."""
        text = self.prompt.text.strip()
        if text:
            self.prompt.clear()
            self._submit_prompt(text, count)
        else:
            self.regenerate(count)

    def _edit_target(self) -> int | None:
        """The message F3 edits: the selected one (or the one a selected reply answers), else the last
        of the user's."""
        messages = self.conversation.messages
        if self.cursor is not None:
            index = self.cursor if messages[self.cursor].role == "user" else self.cursor - 1
            return index if index >= 0 and messages[index].role == "user" else None
        return self.conversation.last_user_index()

    def start_edit(self) -> None:
        if self._refuse_if_busy():
            return
        index = self._edit_target()
        if index is None:
            self.notify("No message to edit yet.", severity="warning")
            return
        if not self.editing:
            self._draft = self.prompt.text if self.prompt.text.strip() else ""
        self.editing = True
        self._edit_index = index
        self.prompt.text = as_typed(self.conversation.messages[index].content)
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()
        self._set_status(self._editing_status())
        self.post_message(self.StateChanged(self))

    def _editing_status(self) -> str:
        last = self._edit_index == max(i for i, m in enumerate(self.conversation.messages) if m.role == "user")
        which = "your last message" if last else f"message {self._edit_index + 1}"
        return f"editing {which}: Enter sends it as a new branch (the old one stays), Esc cancels"

    def cancel_edit(self) -> None:
        self.editing = False
        self._edit_index = None
        self.prompt.clear()
        self._give_back_draft()
        self._set_status(self._idle_status())
        self.post_message(self.StateChanged(self))

    def stop(self) -> None:
        """Esc: stops the replies and puts the queue back in the box, or leaves edit mode, or
        unselects the selected message."""
        self.unqueue()
        if self._live:
            for live in self._live:
                live.stream.abort()
        elif self.busy:
            # The turn is starting (its stream is stopped once it has one) or runs its tool calls
            # (none runs after the one running now).
            self._stop_requested = True
            self._show_busy_status()
        elif self.editing:
            self.cancel_edit()
        elif self.cursor is not None:
            self.select(None)

    async def _turn(self, start: Callable, *args, alternatives: int = 1, restore: str | None = None,
                    edit_index: int | None = None) -> None:
        self._activity = GENERATING
        self._set_busy(True)
        first_turn = not self.conversation.messages
        try:
            if alternatives > 1:
                streams = await self.background(start, *args, alternatives)
            else:
                streams = [await self.background(start, *args)]
        except Exception as e:  # a refused prompt (too long, engine stopped) leaves the conversation as it was
            self._set_busy(False)
            self.unqueue()  # what was queued after it stays unsent too, back in the box after it
            if restore is not None:
                self._restore_prompt(as_typed(restore))
                if edit_index is not None:
                    self.editing, self._edit_index = True, edit_index
                    self._set_status(self._editing_status())
            self.notify(str(e), title="Could not send", severity="error", timeout=8)
            return
        # Claimed at once: an Esc, a closed tab or a quit while the views below mount finds them.
        if alternatives > 1:
            view = AlternativesView(len(streams), self._side_by_side(len(streams)))
            replies = view.replies
        else:
            view = ReplyView()
            replies = [view]
        self._live = [LiveReply(stream, reply, show=alternatives == 1) for stream, reply in zip(streams, replies)]
        self._replies = list(self._live)
        self.last_stream = streams[0]
        if edit_index is not None:
            self._give_back_draft()
        if self._stop_requested:  # Esc came while the turn was starting
            for stream in streams:
                stream.abort()
        self.cursor = None
        await self._close_alternatives()
        self._reply_view = self._last_reply = view
        if alternatives > 1:
            self._alternatives = view
        self._refresh_hint()
        if self.is_shown():
            await self._sync_views(view)
        else:
            # Eight tabs mounting and laying out their views at once held the UI thread for about
            # half a second, and through the GIL the engine; a hidden tab has nothing to show yet.
            self._views_pending = True
        if self.stream is not streams[0]:  # its tab closed or the app quit meanwhile, and stored the reply
            return
        if self.conversation.left_out and not self._left_out_noted:
            self._left_out_noted = True
            await self._note_left_out()
            if self.stream is not streams[0]:
                return
        self._show_context(streams[0].num_prompt_tokens)
        self.post_message(self.ReplyStarted(self))
        if first_turn and self.conversation.title == _DEFAULT_TITLE and restore:
            await self.rename(first_line(restore, _AUTO_TITLE_CHARS))

    def _side_by_side(self, count: int) -> bool:
        return self.transcript.size.width >= count * AlternativesView.MIN_COLUMN_WIDTH

    async def pump(self, shown: bool, draw: bool = True) -> bool:
        """Moves what the streams produced since the last tick into their replies; True once they
        have all ended. Called by the app's stream pump (NvchatApp.PUMP_HZ). Shown, it draws when draw
        says a frame is due (the app paces them), and always its last one. A chat in a hidden tab
        keeps receiving but draws nothing until it is shown (catch_up()): nobody sees it, and parsing
        and laying it out would take time from the visible chat and, through the GIL, from the engine."""
        if not self._live or self._reply_view is None:
            return True
        ended_now = []
        for live in list(self._live):
            stream, view = live.stream, live.view
            ended = stream.finished  # read before draining, so this drain holds the last tokens
            delta = stream.drain()
            if delta is not None and delta.text:
                view.receive(delta.text)
                now = time.monotonic()
                if not ended and now >= live.next_save:
                    live.next_save = now + SAVE_EVERY_S
                    self.background(self.conversation.save_reply_so_far, stream).add_done_callback(self._saved)
            if ended:
                # Claimed and queued before any await: a tab closed or an app quit meanwhile finds no
                # stream to store, so the reply is stored exactly once, and the write already waits.
                self._live.remove(live)
                live.stored = self.background(self.conversation.finish_reply, stream, live.show)
                view.end(reply_stats(stream))
                ended_now.append(live)
        all_ended = not self._live
        if all_ended:
            last = self._replies[0].stream
            if last.num_prompt_tokens is not None:  # None: a server that reports no usage
                self._show_context(last.num_prompt_tokens + last.num_completion_tokens)
        try:
            if shown and (draw or ended_now):
                await self._reply_view.catch_up()
        finally:
            # Even when drawing failed: the pump drops this chat after its last tick, and only
            # _store_replies ends the turn.
            for live in ended_now:
                if live.stream.finish_reason == "error":
                    self.notify(live.stream.error or "generation failed", title="Engine error", severity="error",
                                timeout=10)
            if all_ended and ended_now:
                self.run_worker(self._store_replies(self._replies, self._reply_view), exit_on_error=False)
        return all_ended

    async def _note_left_out(self) -> None:
        limit = self.conversation.max_context
        note = Static(f"This conversation no longer fits the model's context ({limit} tokens): from now on the "
                      "oldest turns are left out of what the model sees (the system prompt and your latest "
                      "message always go).", classes="context-note")
        reply = self._reply_view
        if reply is not None and reply.parent is self.transcript:
            await self.transcript.mount(note, before=reply)
        else:
            await self.transcript.mount(note, before=self.queued[0] if self.queued else None)

    def show_note(self, text: str, classes: str) -> None:
        """Text for the user at the foot of the transcript (above any queued messages), not stored:
        read at leisure and scrolled away, where a notification would cover part of the screen."""
        self.transcript.mount(Static(Content(text), classes=classes), before=self.queued[0] if self.queued else None)
        self.transcript.scroll_end(animate=False)

    def _show_context(self, tokens: int | None) -> None:
        """The context the conversation fills, under the prompt box."""
        limit = self.conversation.max_context
        if limit and tokens is not None:
            self.prompt.border_subtitle = f"context {tokens} / {limit} tokens"

    async def _show_stored_context(self) -> None:
        """A reopened chat's context figure, before its next turn; meanwhile the engine brings the
        chat's K/V back from its lower tiers (Conversation.context_tokens)."""
        try:
            tokens = await self.background(self.conversation.context_tokens, True)
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

    async def _store_replies(self, replies: list[LiveReply], view: ReplyView | AlternativesView) -> None:
        stored = []
        for live in replies:
            try:
                message = await live.stored
            except Exception as e:  # the reply stays on screen; Ctrl+S can still export the others
                self.notify(f"The reply could not be stored: {e}", title="Storage error", severity="error", timeout=10)
                continue
            if message is None and live.view.is_attached and view is live.view:
                await live.view.remove()  # failed before producing anything: nothing to keep
            live.view.message = message
            stored.append(message)
        if isinstance(view, AlternativesView):
            await self._show_first_alternative(view)
        if self._reply_view is view:
            self._reply_view = None
        self._replies = []
        # A single reply that calls tools: the app asks for approval and runs them (alternatives'
        # calls are not run: none of them is the branch the chat goes on from until one is picked).
        if (not isinstance(view, AlternativesView) and len(stored) == 1 and stored[0] is not None
                and stored[0].tool_calls and not self._stop_requested):
            self._set_activity(CALLING_TOOLS)
            self.post_message(self.ToolCallsMade(self, stored[0]))
            return
        self._refresh_hint()
        self._refresh_marks()
        self._end_turn()

    async def _show_first_alternative(self, view: AlternativesView) -> None:
        """Until one is picked, the chat goes on from the first alternative that has text."""
        first = next(iter(view.messages), None)
        if first is None:
            return
        try:
            await self.background(self.conversation.show_branch, first)
        except Exception as e:
            self.notify(f"Could not store which alternative is shown: {e}", title="Storage error", severity="error")

    # --- branches ------------------------------------------------------------------------------------

    def select(self, index: int | None) -> None:
        """Selects the message at index of the branch shown (None: none), for the keys that act on one."""
        self.cursor = index
        self._refresh_marks()
        self._refresh_status()
        self.post_message(self.StateChanged(self))
        if index is not None:
            view = self._view_of(self.conversation.messages[index])
            if view is not None:
                self.transcript.scroll_to_widget(view, animate=False)

    def move_selection(self, step: int) -> None:
        """Alt+Up/Down: the message above or below the selected one; from none, Up selects the last,
        and Down past the last selects none again."""
        count = len(self.conversation.messages)
        if not count:
            return
        if self.cursor is None:
            index = count - 1 if step < 0 else None
        else:
            index = self.cursor + step
            index = None if index >= count else max(index, 0)
        self.select(index)

    def _branch_target(self) -> int | None:
        """The message whose siblings F8/F9 go through: the selected one, else the latest message of
        the branch shown that has any."""
        return self.cursor if self.cursor is not None else self.conversation.latest_branching()

    async def switch_branch(self, step: int = 0, number: int | None = None) -> None:
        """Shows the sibling step places from the target message (or sibling number, from 1)."""
        if self._refuse_if_busy():
            return
        index = self._branch_target()
        if index is None or self.conversation.branch_position(self.conversation.messages[index])[1] < 2:
            self.notify("No other branch here: F3 (edit) and Ctrl+R (regenerate) make them.", severity="warning")
            return
        try:
            if number is None:
                await self.background(self.conversation.switch_branch, index, step)
            else:
                await self.background(self.conversation.choose_branch, index, number)
        except Exception as e:
            self.notify(str(e), title="Could not switch branches", severity="error")
            return
        await self._close_alternatives()
        await self._sync_views()
        if self.cursor is not None:
            self.select(index)
        self._refresh_status()

    async def pick_alternative(self, number: int) -> None:
        """Keeps alternative number (from 1) as the branch shown; the others stay as its siblings."""
        view = self._alternatives
        if view is None:
            self.notify("No alternatives to pick from: F6 or /alt N generates some.", severity="warning")
            return
        if self._refuse_if_busy():
            return
        if not 1 <= number <= len(view.replies) or view.replies[number - 1].message is None:
            self.notify(f"No alternative {number} to pick.", severity="warning")
            return
        try:
            await self.background(self.conversation.show_branch, view.replies[number - 1].message)
        except Exception as e:
            self.notify(str(e), title="Could not pick", severity="error")
            return
        await self._close_alternatives()
        await self._sync_views()
        self._refresh_status()

    async def on_alternatives_view_picked(self, event: AlternativesView.Picked) -> None:
        event.stop()
        await self.pick_alternative(event.number)

    async def retry_writing(self) -> None:
        """A read-only conversation becomes writable here once the process writing it let it go:
        it is read again, with what that process wrote."""
        if self.conversation.read_only is None or self.busy:
            return
        try:
            writable = await self.background(self.conversation.try_to_write)
        except Exception as e:
            self.notify(str(e), title="Could not read the conversation", severity="error")
            return
        if not writable:
            return
        await self._close_alternatives()
        await self._sync_views()
        self.refresh_banner()
        self._refresh_hint()
        self._show_read_only()
        if self.conversation.draft and not self.prompt.text:
            self.prompt.text = self.conversation.draft
        self.post_message(self.StateChanged(self))
        self.notify("The other nvchat let this conversation go: it is writable here now.")

    # --- tool calls (the app runs them: ToolCallsMade) -----------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """Esc was pressed since the turn started: its tool calls should not run."""
        return self._stop_requested

    async def show_tool_call(self, call: dict) -> ToolCallView:
        # A reply that ended in a hidden tab has views still to mount: they go first.
        await self.catch_up()
        view = ToolCallView(call)
        await self.transcript.mount(view, before=self.queued[0] if self.queued else None)
        return view

    def show_tool_approval(self, name: str) -> None:
        """The tool name waits for the user's answer in the approval dialog (which takes Esc)."""
        self._set_activity(Activity(f"the model calls {name}: approve or decline it", None, "stopping"))

    def show_tool_running(self, name: str) -> None:
        self._set_activity(Activity(f"running {name}…", "Esc stops after it", "stopping after it"))

    def continue_after_tools(self) -> None:
        """Every call has its result stored: the reply goes on."""
        self.run_worker(self._turn(self.conversation.continue_after_tools))

    def end_tool_round(self) -> None:
        """The turn ends without the reply going on (Esc, or the conversation could not store a result)."""
        self._refresh_hint()
        self._end_turn()

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
        at_start = self.prompt.cursor_location == (0, 0)
        # A block named by an absolute path must not make the message read as a /command.
        self.prompt.insert(as_typed(attachment.block) if at_start else attachment.block)
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
