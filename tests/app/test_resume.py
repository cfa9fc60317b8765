"""A conversation reopened after a restart: its history's K/V comes back from the disk tier of the
KV cache instead of being computed again, as soon as it is reopened, and its first reply's footer
says so."""
import re

from nvchat.app import NvchatApp
from tests.app.conftest import app_settings
from tests.app.helpers import idle, reopen_the_only_past_conversation, send, started, wait_for

SIZE = (110, 36)


def last_footer(pane) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) from the footer of the chat's last reply."""
    footer = str(pane.query("#reply-footer").last().render())
    match = re.search(r"(\d+) of (\d+) prompt tokens from the cache", footer)
    assert match, footer
    return int(match[2]), int(match[1])


async def test_a_conversation_reopened_after_a_restart_reads_its_history_from_disk(tmp_path):
    # Not reopened at start-up (restore_tabs): Ctrl+O reopens it.
    settings = app_settings(disk_cache_dir=str(tmp_path / "kv"), disk_cache_gib=16, max_tokens=8,
                            restore_tabs=False)
    first = NvchatApp(settings)
    async with first.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = first.active_pane
        await send(pilot, "tell me about the sea")
        await idle(pilot, pane)
        first_prompt, first_cached = last_footer(pane)
        block_size = first.engine.stats().block_size
    assert first_cached == 0  # a new directory: nothing to reuse yet

    again = NvchatApp(settings)
    async with again.run_test(size=SIZE) as pilot:
        await started(pilot)
        pane = await reopen_the_only_past_conversation(pilot, again)
        # Reopened, the chat's history comes back to the device before the next message is typed.
        history_blocks = (first_prompt - 1) // block_size
        await wait_for(pilot, lambda: again.engine.stats().num_cached_blocks >= history_blocks,
                       what="the reopened chat's blocks back on the device")
        assert again.engine.stats().prompt_tokens == 0  # brought back, not computed
        await send(pilot, "and the mountains")
        await idle(pilot, pane)
        prompt, cached = last_footer(pane)
        stats = again.engine.stats()
        await pilot.press("f5")  # the KV panel shows the tiers: the host slots reads land in, and the disk
        counters = again.query_one("#kv-counters")
        await wait_for(pilot, lambda: f"· {cached} tok hit" in str(counters.render()), what="the disk tier's hits")
        lines = str(counters.render()).splitlines()
        assert [line.split()[0] for line in lines] == ["blocks", "KV", "prefix", "host", "disk", "running", "tok/s"]
        assert lines[4].endswith(f"/16.00 GiB · {cached} tok hit")
    # At least the first turn's prompt came back (whole blocks of it, short of its last token),
    # and all of what came back came from disk.
    assert cached >= (first_prompt - 1) // block_size * block_size > 0
    assert cached < prompt
    assert stats.disk_hit_tokens == stats.prefix_hit_tokens == cached
