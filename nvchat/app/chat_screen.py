"""The app's main screen, drawn by a compositor that renders only what an update shows.

For a partial update (a streamed line, a KV panel refresh) Textual's compositor renders every
widget whose clip overlaps the union of the dirty regions, each of them whole: for a one-line
change to the last paragraph of a reply, the screen, header and footer, the KV panel and every
container down to the paragraph, some 400 lines from 18 widgets, of which the update then sends
one line. The lines mostly come from each widget's cache, but walking them and each widget's
styles was most of what a streamed frame cost the UI thread (and, through the GIL, the engine).

UpdateCompositor renders, for a partial update, only widgets that a dirty region overlaps, only
the rows of each that the regions cover, and no widget behind one that already covers every dirty
region it overlaps. The update it sends is Textual's: it writes only the dirty spans, and each
cell of a span shows the frontmost widget there, which overlaps the span and so is rendered.
Full updates (resizes, screenshots) are Textual's own.

ChatScreen also ignores the layout requests of hidden widgets that the last layout did not place
(everything in background tabs, the KV panel while it is off): Textual lays out the whole screen
for each, and 8 chats starting their replies at once asked for dozens of layouts that could change
nothing shown. A widget has already cleared its containers' cached arrangements when it asks, and
showing a container asks for a layout of its own, so it is laid out afresh when it is shown; a
widget that hides itself was placed by the last layout, so its request still counts.
"""
from __future__ import annotations

from typing import Iterable

from textual import messages
from textual._compositor import Compositor
from textual.geometry import Region
from textual.screen import Screen
from textual.strip import Strip
from textual.widget import Widget


class UpdateCompositor(Compositor):
    def __init__(self) -> None:
        super().__init__()
        self._update_regions: list[Region] | None = None

    def render_partial_update(self):
        self._update_regions = list(self._dirty_regions)
        try:
            return super().render_partial_update()
        finally:
            self._update_regions = None

    def _get_renders(self, crop: Region | None = None) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if not self._update_regions or crop is None:
            yield from super()._get_renders(crop)
            return
        uncovered = list(self._update_regions)
        # Front to back, as the compositor fills each cut from the first widget that renders it.
        for widget, (region, clip) in self.visible_widgets.items():
            if not uncovered:
                break
            visible = region.intersection(clip)
            top = bottom = None
            for dirty in uncovered:
                hit = visible.intersection(dirty)
                if hit:
                    top = hit.y if top is None else min(top, hit.y)
                    bottom = hit.bottom if bottom is None else max(bottom, hit.bottom)
            if top is None:
                continue
            uncovered = [dirty for dirty in uncovered if not visible.contains_region(dirty)]
            # Whole rows of the widget's visible part: the compositor divides lines at widget
            # edges, and a narrower render would move those cuts.
            rows = Region(visible.x, top, visible.width, bottom - top)
            yield region, rows, widget.render_lines(rows.translate((-region.x, -region.y)))


def _overridable(compositor: Compositor) -> bool:
    """UpdateCompositor overrides internals of Textual's compositor (written against 8.2.8); a
    Textual whose compositor lacks them keeps its own, which draws the same, only slower."""
    return all(hasattr(compositor, name)
               for name in ("render_partial_update", "_get_renders", "visible_widgets", "_dirty_regions"))


class ChatScreen(Screen):
    def __init__(self, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        if _overridable(self._compositor):
            self._compositor = UpdateCompositor()

    async def _on_layout(self, message: messages.Layout) -> None:
        widget = message.widget
        if isinstance(widget, Widget) and widget not in self._compositor and not _displayed(widget):
            message.stop()
            message.prevent_default()
            return
        await super()._on_layout(message)


def _displayed(widget: Widget) -> bool:
    """Neither the widget nor a container of it has display: none."""
    node = widget
    while isinstance(node, Widget):
        if not node.display:
            return False
        node = node.parent
    return True
