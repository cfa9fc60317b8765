"""The command line's own errors: a bad flag is one line naming it, and a non-zero exit."""
import pytest

from nvchat.cli import main


@pytest.mark.parametrize("argv, named", [
    (["--temperature", "warm"], "--temperature"),
    (["--quantization", "int3"], "--quantization"),
    (["--no-such-flag"], "--no-such-flag"),
    (["-p"], "-p/--prompt"),
    (["serve", "--port", "http"], "--port"),
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
