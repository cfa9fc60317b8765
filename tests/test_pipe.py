"""Pipe mode end to end: `nvchat -p ...` in subprocesses on the demo model."""
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nvchat.default_model import GIBBERISH_NOTE

REPO = Path(__file__).resolve().parent.parent
FAST = ["--model", "demo", "--device", "cpu", "--max-model-len", "256", "--max-tokens", "16", "--temperature", "0"]
# Greedy on the demo model, "x" streams for seconds on the CPUs tried; the runs that use it signal it
# as soon as its first byte arrives.
LONG = ["-p", "x", "--model", "demo", "--device", "cpu", "--temperature", "0", "--max-tokens", "3000"]
QUESTION = "What is a paged KV cache?"
NVCHAT = [sys.executable, "-m", "nvchat.cli"]


def cut_note(limit: int) -> str:
    return f"nvchat: the reply was cut off at the {limit}-token limit (--max-tokens)"


def _run(env, args, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run(NVCHAT + args, cwd=REPO, env=env, input=stdin, capture_output=True, text=True,
                          timeout=180)


def _cut_short(env, how: str) -> subprocess.CompletedProcess:
    """A long reply, ended once it has started streaming: by Ctrl-C, or by the reader going away."""
    # A child of a non-interactive shell may start with SIGINT ignored; give it the default back.
    proc = subprocess.Popen(NVCHAT + LONG, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(1)
    if how == "sigint":
        proc.send_signal(signal.SIGINT)
    else:
        proc.stdout.close()  # like `nvchat -p x | head -c 1`
    err = proc.stderr.read().decode()
    returncode = proc.wait(timeout=180)
    return subprocess.CompletedProcess(proc.args, returncode, first.decode(), err)


def _own_dirs(root, demo_model_path) -> dict:
    """An environment whose nvchat cache, data and config directories are under root. nvchat finds
    the demo model under $XDG_CACHE_HOME/nvchat: the session's copy is linked there, so no
    subprocess writes its own; what the runs write (the KV cache's disk tier) stays under root."""
    (root / "cache" / "nvchat").mkdir(parents=True)
    for entry in demo_model_path.parent.iterdir():
        if entry.name != "kv":
            (root / "cache" / "nvchat" / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return {**os.environ, "XDG_CACHE_HOME": str(root / "cache"), "XDG_DATA_HOME": str(root / "data"),
            "XDG_CONFIG_HOME": str(root / "config"), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(demo_model_path, tmp_path_factory):
    """Every nvchat run of this module, two at a time: each spends most of its seconds importing
    torch on one core, so pairs roughly halve the module's time on a 2-core box."""
    root = tmp_path_factory.mktemp("xdg")
    env = _own_dirs(root, demo_model_path)
    missing = root / "no-such-checkpoint"
    jobs = {
        "json": (_run, ["-p", QUESTION, "--json", *FAST]),
        # Greedy, "x" ran to max_tokens (LONG) on every CPU tried, but where the demo model ends a reply
        # depends on the CPU's rounding: 4 tokens leave it the least room to end first.
        "cut": (_run, ["-p", "x", *FAST, "--max-tokens", "4"]),
        "argument": (_run, ["-p", QUESTION, *FAST]),
        "stdin": (_run, ["-p", "-", *FAST], QUESTION + "\n"),
        "piped_without_p": (_run, FAST, QUESTION + "\n"),
        "piped_json_without_p": (_run, ["--json", *FAST], QUESTION + "\n"),
        "bad_model": (_run, ["-p", "hi", *FAST, "--model", str(missing)]),  # the last --model wins
        "too_long": (_run, ["-p", "word " * 100, *FAST, "--max-model-len", "64"]),
        "bad_temperature": (_run, ["-p", "hi", "--temperature", "-1"]),
        "sigint": (_cut_short, "sigint"),
        "sigpipe": (_cut_short, "sigpipe"),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(fn, env, *args) for name, (fn, *args) in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    results["missing_path"] = missing
    return results


def one_error_line(result) -> str:
    assert result.returncode != 0 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvchat: "), f"expected one stderr line, got:\n{result.stderr}"
    return lines[0]


@pytest.fixture(scope="module")
def json_reply(runs):
    result = runs["json"]
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # the whole of stdout is one JSON object


def _as_printed(reply: str) -> str:
    return reply if reply.endswith("\n") else reply + "\n"


def test_json_has_the_reply_and_its_stats(json_reply):
    assert set(json_reply) == {"text", "finish_reason", "tokens", "tokens_per_s", "ttft_s", "prompt_tokens",
                               "cached_tokens", "model"}
    assert json_reply["text"] and json_reply["model"] == "demo"
    assert json_reply["finish_reason"] in ("stop", "length") and 1 <= json_reply["tokens"] <= 16
    # The runs share a disk tier: a run may find blocks another one left there.
    assert json_reply["prompt_tokens"] > len(QUESTION) and 0 <= json_reply["cached_tokens"] < json_reply["prompt_tokens"]
    assert json_reply["ttft_s"] > 0


def test_question_as_argument_prints_only_the_reply(runs, json_reply):
    result = runs["argument"]
    assert result.returncode == 0, result.stderr
    # Greedy decoding: the same reply as the --json run, and nothing else on stdout.
    assert result.stdout == _as_printed(json_reply["text"])
    cut = cut_note(16) + "\n" if json_reply["finish_reason"] == "length" else ""
    assert result.stderr == f"nvchat: {GIBBERISH_NOTE}\n" + cut


def test_a_reply_cut_at_the_token_limit_says_so_on_stderr(runs):
    result = runs["cut"]
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"nvchat: {GIBBERISH_NOTE}", cut_note(4)]
    assert result.stdout.endswith("\n") and "nvchat" not in result.stdout


def test_question_from_stdin(runs, json_reply):
    result = runs["stdin"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == _as_printed(json_reply["text"])


def test_piped_stdin_without_p_is_pipe_mode(runs, json_reply):
    """`echo question | nvchat`: the app would wait forever for keys that cannot come."""
    result = runs["piped_without_p"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == _as_printed(json_reply["text"])


def test_piped_stdin_takes_json_without_p(runs, json_reply):
    result = runs["piped_json_without_p"]
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["text"] == json_reply["text"]


def test_bad_model_path(runs):
    assert str(runs["missing_path"]) in one_error_line(runs["bad_model"])


def test_prompt_too_long(runs):
    line = one_error_line(runs["too_long"])
    assert "too long" in line and "max_model_len=64" in line


def test_bad_sampling_value(runs):
    assert "temperature" in one_error_line(runs["bad_temperature"])


def test_ctrl_c_mid_reply_exits_quietly(runs):
    result = runs["sigint"]
    assert result.stdout, "the reply had started"
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr


def test_closed_stdout_exits_quietly(runs):
    result = runs["sigpipe"]
    assert result.stdout, "the reply had started"
    assert result.returncode == 141 and "Traceback" not in result.stderr, result.stderr


def test_the_next_run_finds_the_prompt_on_disk_although_the_process_ends_itself(demo_model_path, tmp_path):
    """Pipe mode ends its process without the interpreter's finalization (nvchat.pipe._exit_now),
    once the engine has shut down: the KV blocks it wrote to disk are whole for the next run, and
    its JSON reaches a file's buffered stdout whole."""
    env = _own_dirs(tmp_path, demo_model_path)
    question = "the same question again, " * 3
    replies = []
    for run in range(2):
        with open(tmp_path / f"reply-{run}.json", "w") as out:
            result = subprocess.run(NVCHAT + ["-p", question, "--json", *FAST], cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.PIPE, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        replies.append(json.loads((tmp_path / f"reply-{run}.json").read_text()))
    assert replies[0]["cached_tokens"] == 0
    assert replies[1]["cached_tokens"] >= 16 and replies[1]["text"] == replies[0]["text"]


def test_the_engine_is_sized_for_the_one_prompt(demo_model_path, monkeypatch, capsys):
    """Pipe mode answers one prompt: its engine holds one sequence at most, whatever max_num_seqs
    the settings give the app, so that a GPU start captures one decode graph, and no prefill graphs."""
    from nvchat import pipe
    from nvchat.settings import Settings
    opened, open_backend = [], pipe.open_backend

    def recording(settings, progress=None):
        opened.append(open_backend(settings, progress))
        return opened[-1]
    monkeypatch.setattr(pipe, "open_backend", recording)
    settings = Settings(model=str(demo_model_path), device="cpu", max_model_len=256, max_tokens=4, temperature=0)
    assert settings.max_num_seqs > 1
    assert pipe.run_pipe("hello", settings) == 0
    assert capsys.readouterr().out.strip()
    [engine] = opened
    assert engine.llm.config.max_num_seqs == 1 and not engine.llm.config.prefill_cuda_graphs
