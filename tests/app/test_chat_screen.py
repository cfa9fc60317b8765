"""ChatScreen's compositor renders less for a partial update than Textual's, and must send the
terminal the same thing: after every step, what a terminal fed the app's updates shows equals a
full render of the screen. Textual's own Screen runs the same steps as the control."""
import pytest
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Sparkline, Static

from nvchat.app.chat_screen import ChatScreen
from nvchat.app.streaming_markdown import GrowingParagraph, StreamingMarkdown
from tests.app.helpers import wait_for
from tests.app.terminal import RecordingTerminal


class Panes(App):
    """The chat screen's shape: a scrolling transcript beside a panel, header and footer."""
    CSS = """
    #side { width: 24; border-left: solid $primary; }
    #log { width: 1fr; }
    StreamingMarkdown { margin: 0 1; }
    """

    def __init__(self, screen_class) -> None:
        super().__init__()
        self.screen_class = screen_class

    def get_default_screen(self) -> Screen:
        return self.screen_class(id="_default")

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with VerticalScroll(id="log"):
                yield Static("the start of the transcript\n" * 3)
                yield StreamingMarkdown(id="reply")
            with Vertical(id="side"):
                yield Static(id="counter")
                yield Sparkline([1, 2, 3], id="spark")
        yield Footer()


@pytest.mark.parametrize("screen_class", [Screen, ChatScreen], ids=["textual", "chat-screen"])
async def test_the_terminal_shows_what_a_full_render_draws(screen_class):
    app = Panes(screen_class)
    terminal = RecordingTerminal(app)
    async with app.run_test(size=(70, 20)) as pilot:
        reply = app.query_one(StreamingMarkdown)
        log = app.query_one("#log", VerticalScroll)
        log.anchor()
        steps = [
            lambda i: reply.append(f"word{i} "),  # the last paragraph grows in place
            lambda i: reply.append(f"**bold {i}** and `code`\n\n"),  # a new paragraph starts
            lambda i: app.query_one("#counter", Static).update(f"count {i}"),
            lambda i: app.query_one(Sparkline).__setattr__("data", [i % 5, 3, i % 7, 1]),
            lambda i: reply.append("- a list item\n- another\n\n") if i % 7 == 0 else None,
            lambda i: app.notify(f"toast {i}") if i % 9 == 0 else None,  # a layer above both panes
        ]
        for i in range(60):
            for step in steps[: 2 + i % 5]:
                result = step(i)
                if result is not None:
                    await result
            if i == 40:
                log.scroll_home(animate=False)  # the user scrolled up
            # The step's messages handled and the screen's update sent: what the terminal was given
            # must already be whole, not made whole by a later update.
            await pilot.pause()
            assert terminal.differences() == [], f"after step {i}"
        assert terminal.updates > 60
        assert log.max_scroll_y > 0  # the transcript overflowed, so it scrolled


async def test_a_line_that_grows_in_place_renders_only_its_paragraph():
    app = Panes(ChatScreen)
    async with app.run_test(size=(70, 20)) as pilot:
        reply = app.query_one(StreamingMarkdown)
        await reply.append("hello")
        await pilot.pause()  # the first paragraph laid out and drawn, so the recording sees only the append
        rendered = []
        compositor = app.screen._compositor
        get_renders = compositor._get_renders

        def recording(crop=None):
            for region, clip, strips in get_renders(crop):
                rendered.append((region, clip))
                yield region, clip, strips

        compositor._get_renders = recording
        await reply.append(" world")
        await pilot.pause()  # handled and drawn: every region the update rendered is recorded
        paragraph = reply.query_one(GrowingParagraph)
        assert rendered == [(paragraph.region, paragraph.region)]


async def test_the_chat_app_sends_what_it_draws(make_app):
    """The app itself: two chats streaming, the KV panel refreshing, the help screen over it all."""
    from nvchat.app.prompt_input import PromptInput
    from tests.app.helpers import idle, press_now, started, submit_now

    app = make_app(max_tokens=200)
    terminal = RecordingTerminal(app)
    async with app.run_test(size=(110, 36)) as pilot:
        await started(pilot)
        await pilot.press("f5")
        await submit_now(pilot, app.active_pane, "first")
        await press_now(pilot, "ctrl+t")
        pane = app.active_pane
        pane.query_one(PromptInput).cursor_blink = False
        await submit_now(pilot, pane, "second")
        await wait_for(pilot, lambda: pane.stream is not None and pane.stream.num_completion_tokens > 50)
        await press_now(pilot, "f1")
        await wait_for(pilot, lambda: app.screen.query("#help-table"), what="the help screen")
        await press_now(pilot, "escape")
        await wait_for(pilot, lambda: not app.screen.query("#help-table"), what="the help screen to close")
        for chat in app.tabs.panes:
            await idle(pilot, chat)
        await pilot.press("f5")  # the panel's timer stops: nothing changes any more
        await wait_for(pilot, lambda: terminal.differences() == [], what="the terminal to show the last frame")


class HiddenPanel(App):
    CSS = "#hidden { display: none; height: auto; } #hidden Static { height: auto; }"

    def get_default_screen(self) -> Screen:
        return ChatScreen(id="_default")

    def compose(self) -> ComposeResult:
        yield Static("always shown", id="shown")
        with Vertical(id="hidden"):
            yield Static("one line", id="text")
        yield Footer()


async def test_changes_inside_a_hidden_container_lay_out_nothing_until_it_is_shown():
    app = HiddenPanel()
    terminal = RecordingTerminal(app)
    async with app.run_test(size=(40, 16)) as pilot:
        await pilot.pause()  # the first layout done, so that only the changes below are recorded
        reflows = []
        compositor = app.screen._compositor
        reflow = compositor.reflow
        compositor.reflow = lambda *args: reflows.append(args) or reflow(*args)
        hidden = app.query_one("#hidden", Vertical)
        for i in range(5):
            app.query_one("#text", Static).update("\n".join(f"line {n}" for n in range(i + 2)))
            await hidden.mount(Static(f"mounted {i}"))
            await pilot.pause()  # handled and drawn: a layout it asked for would have run
        assert reflows == []
        hidden.display = True
        await pilot.pause()  # handled, laid out and drawn, so the terminal is compared with the new frame
        assert len(reflows) >= 1
        assert app.query_one("#text", Static).region.height == 6
        assert hidden.region.height == 6 + 5
        assert terminal.differences() == []
        assert "mounted 4" in "\n".join(terminal.shown())
