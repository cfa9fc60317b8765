"""Pipe mode: `nvchat -p "question"` or `... | nvchat -p -`.

stdout carries the reply and nothing else (streamed as it arrives, or one JSON object with
--json); every problem is one `nvchat: ...` line on stderr and a non-zero exit.
"""
import json
import os
import sys
from typing import NoReturn

from nvchat import startup_trace
from nvchat.backend import model_name as backend_model_name
from nvchat.backend import open_backend
from nvchat.conversation import Conversation, reply_stats
from nvchat.default_model import GIBBERISH_NOTE
from nvchat.settings import Settings

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process killed by SIGPIPE


class PipeError(Exception):
    """A problem to report as one line and exit on."""


def _fail(message: str) -> int:
    print(f"nvchat: {message}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def read_prompt(prompt: str) -> str:
    text = sys.stdin.read() if prompt == "-" else prompt
    text = text.strip()
    if not text:
        raise PipeError("the prompt is empty" + (" (nothing on stdin)" if prompt == "-" else ""))
    return text


def _silence_stdout() -> None:
    """After the reader went away: point stdout at /dev/null so the interpreter's final flush
    doesn't raise a second BrokenPipeError on exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run_pipe(prompt: str, settings: Settings, *, json_output: bool = False, exit_process: bool = False) -> int:
    """Answers prompt; the exit status. exit_process: end the process once the reply is out and
    the backend closed (see _exit_now), for the `nvchat` command, not for a caller in-process."""
    code = _answer(prompt, settings, json_output)
    if exit_process:
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """Ends the process without the interpreter's finalization. By then the backend has shut down
    (the engine's disk KV writes drained, tensor-parallel workers stopped) and pipe mode holds
    nothing else to close; finalizing the modules torch loads took 0.8-1.0 s after the reply on
    the 2-core box (bench_startup's "first token, to the exit"; a bare `import torch` takes as long
    to exit, most of it CPython's garbage collector over torch's objects, perf)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader went away, or the stream is closed
            pass
    os._exit(code)


def _answer(prompt: str, settings: Settings, json_output: bool) -> int:
    stream = None
    try:
        text = read_prompt(prompt)
        # One prompt is one sequence: an engine sized for it captures one decode graph, not one for
        # each batch size up to max_num_seqs, and sets sampling memory aside for one row. On an H100
        # (bench_startup) the decode graphs' capture fell from 0.89 to 0.40 s of the start, though
        # the prefill graphs', which now load the kernels first, rose from 0.31 to 0.60 s.
        # Its prompt is prefilled once, so graphs of prefill steps only cost their capture (unless
        # the settings ask for them).
        engine_settings = settings.updated(max_num_seqs=1)
        if settings.prefill_cuda_graphs is None:
            engine_settings = engine_settings.updated(prefill_cuda_graphs=False)
        with open_backend(engine_settings) as engine:
            startup_trace.mark("ready")
            model_name = backend_model_name(settings, engine)
            conversation = Conversation(engine, None, system_prompt=settings.system_prompt, model_name=model_name,
                                        settings=settings)
            stream = conversation.send(text)
            if settings.uses_demo_model:
                print(f"nvchat: {GIBBERISH_NOTE}", file=sys.stderr, flush=True)
            elif settings.model is None:  # say which model was chosen for the user
                print(f"nvchat: model: {model_name}", file=sys.stderr, flush=True)
            first = True
            for delta in stream:
                if first:
                    startup_trace.mark("first token")
                    first = False
                if delta.text and not json_output:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            if stream.finish_reason == "error":
                if stream.text and not json_output:
                    sys.stdout.write("\n")
                return _fail(f"generation failed: {stream.error}")
            if json_output:
                sys.stdout.write(json.dumps({"text": stream.text, **reply_stats(stream), "model": model_name}) + "\n")
            elif not stream.text.endswith("\n"):
                sys.stdout.write("\n")
            sys.stdout.flush()
            if stream.finish_reason == "length":  # on stderr, so stdout stays the reply alone
                print(f"nvchat: the reply was cut off at the {stream.num_completion_tokens}-token limit "
                      "(--max-tokens)", file=sys.stderr, flush=True)
        return 0
    except BrokenPipeError:  # before OSError, which it is
        if stream is not None:
            stream.abort()
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except PipeError as e:
        return _fail(str(e))
    except (ValueError, RuntimeError, OSError) as e:  # bad model path, prompt too long, bad setting...
        return _fail(str(e))
    except KeyboardInterrupt:
        if stream is not None:
            stream.abort()
            if stream.text and not json_output:
                sys.stdout.write("\n")
                sys.stdout.flush()
        return EXIT_INTERRUPTED
