"""The chats, one per tab: opening, closing and cycling them, their labels and colours, and which chat
each engine request came from (the KV panel colours a request's blocks by its chat).

A chat pane's messages bubble through here on their way to the app: a changed state redraws the
pane's tab label, a started reply records whose request it is. Neither is stopped: the app still
refreshes its keys and drains the reply.
"""
from __future__ import annotations

from typing import Callable

from textual.content import Content
from textual.widgets import TabbedContent, TabPane, Tabs

from engine import EngineSnapshot
from nvchat.app.chat_pane import Background, ChatPane
from nvchat.app.kv_panel import BlockOwner, PanelData
from nvchat.app.services import store_partial_reply
from nvchat.conversation import Conversation
from themes import tab_colors


class ChatTabs(TabbedContent):
    def __init__(self, *, background: Background, new_conversation: Callable[[], Conversation],
                 keymap: dict[str, str], note: str | None = None, id: str | None = None) -> None:
        """background: runs a call on the conversation thread; new_conversation: a fresh chat, for
        when the last tab closes; keymap and note: handed to each chat pane."""
        super().__init__(id=id)
        self.background = background
        self.new_conversation = new_conversation
        self.keymap = keymap
        self.note = note
        self.panes: list[ChatPane] = []  # in the order they opened
        self._request_owners: dict[int, ChatPane] = {}  # request id -> chat, for the KV panel
        self._serial = 0

    def on_mount(self) -> None:
        # Tab from the prompt box goes to the transcript and its code blocks, which hand typing back
        # to the box (ChatPane.on_key), never to the tab bar, where it was lost (its keys have
        # bindings of their own: Ctrl+PgDn/PgUp, Alt+arrows).
        self.query_one(Tabs).can_focus = False

    @property
    def active_chat(self) -> ChatPane | None:
        # Read by every pump tick: the chats' own list rather than two DOM queries.
        active = self.active
        return next((pane for pane in self.panes if pane.parent is not None and pane.parent.id == active), None)

    def _color_for(self, slot: int) -> str:
        colors = tab_colors(self.app.current_theme)
        return colors[slot % len(colors)]

    def _label(self, pane: ChatPane) -> Content:
        # Not "…", which a title cut short already ends with ("a… …").
        marker = (" ▸", pane.color) if pane.busy else ""
        read_only = (" · read-only", "dim") if pane.conversation.read_only else ""
        return Content.assemble(("● ", pane.color), pane.conversation.title, marker, read_only)

    def _relabel(self, pane: ChatPane) -> None:
        if pane.parent is not None and pane.parent.id:
            try:
                self.get_tab(pane.parent.id).label = self._label(pane)
            except Exception:  # the tab closed in the meantime
                pass

    async def open(self, conversation: Conversation, *, show: bool = True) -> ChatPane:
        """A new tab for the conversation, shown, with its prompt box focused (unless show is False:
        several opened at once, one of which is shown afterwards)."""
        self._serial += 1
        slot = self._serial - 1
        pane = ChatPane(conversation, background=self.background, is_shown=lambda: self.active_chat is pane,
                        keymap=self.keymap, color=self._color_for(slot), color_slot=slot, note=self.note)
        tab = TabPane(self._label(pane), pane, id=f"chat-{self._serial}")
        self.panes.append(pane)
        await self.add_pane(tab)
        if show:
            self.active = tab.id
            pane.prompt.focus()
        return pane

    async def close(self, pane: ChatPane) -> None:
        """Closes the chat's tab, keeping what its reply said so far and what it had typed; the last
        tab to close is replaced by a new chat."""
        # Its tab is going: stop the replies here and keep what they said so far.
        streams = pane.take_streams()
        for stream in streams:
            stream.abort()
        for i, stream in enumerate(streams):
            self.background(store_partial_reply, pane.conversation, stream, i == 0)
        self.panes.remove(pane)
        self._request_owners = {rid: p for rid, p in self._request_owners.items() if p is not pane}
        pane.save_draft()  # queued before the tab goes, and kept if the app quits meanwhile
        self.background(pane.conversation.release)  # after its writes: another process may write it now
        await self.remove_pane(pane.parent.id)
        if not self.panes:
            await self.open(self.new_conversation())
        elif self.active_chat is not None:
            self.active_chat.prompt.focus()

    def show(self, pane: ChatPane) -> None:
        self.active = pane.parent.id
        pane.prompt.focus()
        self.app.run_worker(pane.retry_writing(), exit_on_error=False)

    def cycle(self, step: int) -> None:
        """Shows the chat step tabs to the right (or left), wrapping around."""
        ids = [tab.id for tab in self.query(TabPane)]
        if len(ids) > 1 and self.active in ids:
            self.active = ids[(ids.index(self.active) + step) % len(ids)]
            self.active_chat.prompt.focus()

    def recolor(self) -> None:
        """The theme changed: each chat takes its slot's colour in the new one."""
        for pane in self.panes:
            pane.color = self._color_for(pane.color_slot)
            self._relabel(pane)

    async def tab_shown(self) -> None:
        """Another tab is shown: what each chat had typed is stored now, not later, and the shown
        chat draws what its reply received while hidden."""
        for pane in self.panes:
            pane.flush_draft()
        pane = self.active_chat
        if pane is not None:
            await pane.catch_up()
            await pane.retry_writing()

    def on_chat_pane_state_changed(self, event: ChatPane.StateChanged) -> None:
        self._relabel(event.pane)

    def on_chat_pane_reply_started(self, event: ChatPane.ReplyStarted) -> None:
        for stream in event.pane.streams:
            self._request_owners[stream.request_id] = event.pane

    def panel_data(self, snapshot: EngineSnapshot | None) -> PanelData:
        """What the KV panel shows of the chats beside the engine's snapshot (None from a remote
        backend): whose each request is, and every open chat for the legend."""
        # A finished request's owner is kept until the engine's snapshot no longer shows it holding
        # blocks (the snapshot trails the streams by a step).
        live = {stream.request_id for p in self.panes for stream in p.streams}
        self._request_owners = {rid: p for rid, p in self._request_owners.items()
                                if rid in live or (snapshot is not None and rid in snapshot.block_holders)}
        owners = {rid: BlockOwner(p.conversation.title, p.color) for rid, p in self._request_owners.items()}
        chats = [BlockOwner(p.conversation.title, p.color) for p in self.panes]
        return PanelData(snapshot, owners, chats)
