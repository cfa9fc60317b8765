"""The key footer, rebuilt only when the keys it shows change.

Textual's Footer recomposes (unmounts its keys, builds and styles new ones, lays out the screen)
every time the screen's bindings may have changed: each focus change, and each time the app asks,
which it does whenever the active chat starts, renames or ends a reply. That cost the UI thread
~25 ms each on the CPU box, mostly for a footer that came out the same. Here a refresh that leaves
the keys as they were changes nothing, and one that only enables or disables keys (a reply
starting or ending: Esc stops it, F3 regenerates) restyles the keys it has.
"""
from __future__ import annotations

from textual.screen import Screen
from textual.widgets import Footer
from textual.widgets._footer import FooterKey


class ChatFooter(Footer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shown: tuple | None = None  # the keys composed last, as _keys() describes them

    def bindings_changed(self, screen: Screen) -> None:
        # As Footer.bindings_changed, which recomposes unconditionally.
        self._bindings_ready = True
        if not screen.app.app_focus:
            return
        if self.is_attached and screen is self.screen:
            self.call_after_refresh(self._update_keys)

    def _keys(self) -> tuple[tuple, dict[tuple[str, str], bool]]:
        """What compose() would show: the keys in order, without their enabled state, and the
        enabled state of each (key, action) it would draw."""
        shown, enabled = [], {}
        for key, (_, binding, is_enabled, tooltip) in self.screen.active_bindings.items():
            if binding.show or key == self.app.COMMAND_PALETTE_BINDING:
                shown.append((binding, self.app.get_key_display(binding), tooltip))
                enabled.setdefault((binding.key, binding.action), is_enabled)
        return (tuple(shown), self.show_command_palette, self.app.ENABLE_COMMAND_PALETTE), enabled

    async def _update_keys(self) -> None:
        if not self.is_attached:
            return
        shown, enabled = self._keys()
        if shown != self._shown:
            self._shown = shown
            await self.recompose()
            return
        for key in self.query(FooterKey):
            disabled = not enabled.get((key.key, key.action), not key._disabled)
            if disabled != key._disabled:
                key._disabled = disabled  # what FooterKey reads on a click
                key.set_class(disabled, "-disabled")
