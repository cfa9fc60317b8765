"""The app's pieces that need no running app: think splitting, footers, the KV grid's folding,
the draw pacing and garbage collection deferral, themes, key names, exports."""
import gc

import pytest

from engine.backend import EngineSnapshot
from nvchat.app.bindings import ALL_KEYS, describe_key, unknown_key_ids
from nvchat.app.kv_panel import counters_text, fold_blocks
from nvchat.app.message_view import ThinkSplitter, footer_text
from nvchat.app.pacing import DrawPacer, FullCollectionDeferral
from nvchat.cli import build_parser
from nvchat.conversation import Conversation, Message
from nvchat.export import export_markdown
from nvchat.flags import settings_from_args
from nvchat.settings import Settings
from themes import ThemeFileError, load_themes, tab_colors, theme_from_toml


def split_all(chunks):
    splitter = ThinkSplitter()
    pieces = [p for chunk in chunks for p in splitter.feed(chunk)] + splitter.flush()
    thinking = "".join(text for is_thinking, text in pieces if is_thinking)
    answer = "".join(text for is_thinking, text in pieces if not is_thinking)
    return thinking, answer


@pytest.mark.parametrize("chunks", [
    ["<think>hmm, let me see</think>The answer is 4."],
    ["<thi", "nk>hmm, let", " me see</th", "ink>The answer", " is 4."],
    list("<think>hmm, let me see</think>The answer is 4."),
])
def test_think_sections_split_wherever_the_chunks_break(chunks):
    assert split_all(chunks) == ("hmm, let me see", "The answer is 4.")


def test_text_that_only_looks_like_a_tag_is_kept():
    assert split_all(["a <thin", "g> and <b>"]) == ("", "a <thing> and <b>")
    assert split_all(["ends with <th"]) == ("", "ends with <th")


def test_footer_shows_tokens_rate_and_time_to_first_token():
    text = footer_text({"tokens": 42, "tokens_per_s": 31.25, "ttft_s": 0.125, "finish_reason": "abort",
                        "prompt_tokens": 100, "cached_tokens": 64})
    assert text == "42 tokens · 31.2 tok/s · TTFT 125 ms · 64 of 100 prompt tokens from the cache · stopped"


def test_a_stopped_or_failed_reply_says_so_in_one_word():
    stopped = footer_text({"tokens": 3, "finish_reason": "abort"}, interrupted=True)
    assert stopped == "3 tokens · stopped (Ctrl+R regenerates)"
    assert footer_text({"tokens": 0, "finish_reason": "error"}, interrupted=True) == "0 tokens · failed (Ctrl+R regenerates)"
    assert footer_text({"tokens": 5, "finish_reason": "length"}) == "5 tokens · hit max tokens"


def snapshot(states: bytes, holders: dict) -> EngineSnapshot:
    return EngineSnapshot(num_blocks=len(states), block_size=16, num_free_blocks=states.count(0) + states.count(1),
                          num_cached_blocks=states.count(1), prefix_hit_tokens=32, prompt_tokens=128,
                          num_running=len(holders), num_waiting=0, num_preemptions=0, prefill_tokens_per_s=0.0,
                          decode_tokens_per_s=0.0, kv_bytes_total=1 << 30, kv_bytes_used=1 << 29,
                          block_states=states, block_holders=holders, taken_at=0.0)


def test_grid_cells_fold_blocks_when_the_grid_is_small():
    states = bytes([2, 2, 3, 0, 1, 1, 0, 0])
    snap = snapshot(states, {7: [0, 1, 2], 9: [2]})
    folded = fold_blocks(snap, num_cells=8)
    assert folded.per_cell == 1 and list(folded.ranks) == [2, 2, 3, 0, 1, 1, 0, 0]  # used, shared, free, cached
    assert folded.owners == {0: 7, 1: 7, 2: 7}  # block 2 is 7's and 9's: the first holder names it
    folded = fold_blocks(snap, num_cells=3)
    assert folded.per_cell == 3 and list(folded.ranks) == [3, 1, 0]  # a cell shows its most telling block
    assert folded.owners == {0: 7}
    assert "25.0% hit (32/128 tok)" in counters_text(snap)


def test_themes_ship_light_and_dark_with_tab_colours():
    themes = {t.name: t for t in load_themes()}
    assert {"nvchat-dark", "nvchat-light"} <= set(themes) and len(themes) >= 4
    assert any(t.dark for t in themes.values()) and any(not t.dark for t in themes.values())
    assert all(len(tab_colors(t)) >= 6 for t in themes.values())


def test_a_broken_theme_file_names_itself():
    with pytest.raises(ThemeFileError, match="broken.toml"):
        theme_from_toml('name = "x"\ncolour = "#fff"', "broken.toml")


def test_every_binding_has_a_toml_safe_id():
    assert all(spec.id.replace("_", "").isalnum() for spec in ALL_KEYS)
    assert unknown_key_ids({"new_tab": "ctrl+n", "nope": "x"}) == ["nope"]
    assert describe_key("ctrl+pagedown,alt+right") == "Ctrl+PgDn / Alt+Right"


def test_exports_never_overwrite(tmp_path):
    conversation = Conversation(None, None, system_prompt="sys", model_name="demo", settings=Settings(),
                                title="Hello, World!", messages=[Message("user", "hi")])
    first = export_markdown(conversation, [tmp_path])
    second = export_markdown(conversation, [tmp_path])
    assert first.name == "nvchat-hello-world.md" and second.name == "nvchat-hello-world-2.md"
    assert "## User\n\nhi" in first.read_text()


def test_flags_override_the_config_file(xdg_dirs):
    from nvchat import paths
    paths.config_file().parent.mkdir(parents=True)
    paths.config_file().write_text('max_model_len = 2048\ntemperature = 0.2\ntheme = "paper"\n')
    settings = settings_from_args(build_parser().parse_args(["--tp", "2", "--temperature", "0.9"]))
    assert (settings.tensor_parallel_size, settings.temperature, settings.max_model_len, settings.theme) == \
        (2, 0.9, 2048, "paper")


class CpuClock:
    """Stands in for the UI thread's CPU clock: a test says how much each frame cost."""
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pace(frame_cpu_s: float, streams: int, frames: int = 40) -> tuple[DrawPacer, float]:
    """Draws as often as the pacer allows, each costing frame_cpu_s; returns the pacer and the draws a second."""
    cpu = CpuClock()
    pacer = DrawPacer(max_hz=20, min_hz=4, budget_one=0.25, budget_many=0.10, cpu_clock=cpu)
    now, ticks, draws = 0.0, 0, 0
    while draws < frames:
        now = ticks / 20  # the app's pump ticks at max_hz
        ticks += 1
        if pacer.due(now):
            cpu.now += frame_cpu_s
            pacer.drew(now, streams)
            draws += 1
    return pacer, draws / now


def test_cheap_draws_run_at_the_full_rate():
    assert pace(0.002, streams=8)[1] == pytest.approx(20, rel=0.05)


def test_costly_draws_slow_down_more_while_several_chats_stream():
    # 10 ms a frame: 20 a second would be 20% of a core.
    _, one = pace(0.010, streams=1)
    _, many = pace(0.010, streams=8)
    assert one == pytest.approx(20, rel=0.05)  # within the one-chat share (25%)
    assert 8 <= many <= 11  # about 10% of a core: 10 draws a second
    _, slowest = pace(0.200, streams=8)
    assert slowest == pytest.approx(4, rel=0.1)  # never below min_hz


def test_after_streaming_stops_the_next_draw_is_due_at_once():
    pacer, _ = pace(0.200, streams=8)
    assert pacer.interval == pytest.approx(0.25)
    pacer.reset()
    assert pacer.due(0.0) and pacer.interval == pytest.approx(0.05)


def test_full_collections_wait_while_streaming_but_not_forever():
    saved = gc.get_threshold()
    clock = CpuClock()  # any settable clock
    deferral = FullCollectionDeferral(max_s=30, clock=clock)
    try:
        deferral.start()
        young, middle, oldest = gc.get_threshold()
        assert (young, middle) == saved[:2] and oldest > 10**6
        clock.now = 29
        deferral.tick()
        assert gc.get_threshold()[2] > 10**6
        clock.now = 31  # streaming for too long: one full collection may run...
        deferral.tick()
        assert gc.get_threshold() == saved
        deferral.tick()
        assert gc.get_threshold() == saved  # ...and until it has, the threshold stays as it was
        gc.collect()
        deferral.tick()
        assert gc.get_threshold()[2] > 10**6  # then deferring again
        deferral.stop()
        assert gc.get_threshold() == saved
    finally:
        gc.set_threshold(*saved)
