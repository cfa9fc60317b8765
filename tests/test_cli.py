"""The command line's own errors: a bad flag is one line naming it, and a non-zero exit."""
import socket
import subprocess
import sys

import pytest

from nvchat.cli import main


@pytest.mark.parametrize("argv, named", [
    (["--temperature", "warm"], "--temperature"),
    (["--quantization", "int3"], "--quantization"),
    (["--no-such-flag"], "--no-such-flag"),
    (["-p"], "-p/--prompt"),
    (["serve", "--port", "http"], "--port"),
    (["serve", "--port", "99999"], "--port"),
])
def test_a_bad_flag_is_one_line(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvchat") and named in lines[0], captured.err


def test_json_needs_a_question(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)  # a terminal: no question piped in
    with pytest.raises(SystemExit) as exit_:
        main(["--json"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "nvchat: --json goes with -p/--prompt (or a question piped to stdin) (`nvchat --help` lists the options)"]


def test_serve_on_a_port_in_use_names_the_address(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"nvchat: can't listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "temperature must be >= 0"),
])
def test_a_bad_sampling_flag_stops_the_app_before_it_loads_a_model(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("nvchat.cli.run_tui", lambda *args: pytest.fail("the app started"))
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nvchat: {message}")


def test_the_app_is_told_which_settings_came_from_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "nvchat").mkdir()
    (tmp_path / "nvchat" / "config.toml").write_text('theme = "paper"\nmax_tokens = 99\n')
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    seen = {}
    monkeypatch.setattr("nvchat.cli.run_tui", lambda settings, flags: seen.update(settings=settings, flags=flags) or 0)
    assert main(["--theme", "nosuch"]) == 0
    assert seen["flags"] == {"theme"}
    assert (seen["settings"].theme, seen["settings"].max_tokens) == ("nosuch", 99)


def test_python_dash_m_nvchat_is_the_command():
    done = subprocess.run([sys.executable, "-m", "nvchat", "--no-such-flag"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("nvchat: unrecognized arguments: --no-such-flag"), done.stderr
