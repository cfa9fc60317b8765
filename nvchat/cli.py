"""The `nvchat` command: with no mode flag it opens the Textual app."""
import argparse
import sys

from nvchat import startup_trace
from nvchat.flags import CommandLineParser, add_engine_flags, flags_given, settings_from_args
from nvchat.settings import Settings, SettingsError


def build_parser() -> argparse.ArgumentParser:
    # Flags default to None so that only the ones given override config.toml.
    p = CommandLineParser(prog="nvchat", description="Chat with a local LLM from the terminal.",
                                epilog="`nvchat serve --help`: serve the engine over the OpenAI API.")
    add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, help="longest reply in tokens (default 1024)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature, 0 for greedy (default: the model's recommendation, else 0.7)")
    p.add_argument("--theme", help="colour theme for the app (default nvchat-dark)")
    p.add_argument("--system", dest="system_prompt", metavar="TEXT", help="system prompt for new conversations (\"\" for none)")
    p.add_argument("--plain", action="store_true", help="a plain line-based REPL instead of the full-screen app")
    p.add_argument("-p", "--prompt", metavar="TEXT", help="pipe mode: answer TEXT (- reads stdin), print the "
                                                           "reply, exit; `-p -` is implied when stdin is not a terminal")
    p.add_argument("--json", action="store_true", help="with -p: print one JSON object with the reply and its stats")
    p.add_argument("--backend", metavar="URL", help="an OpenAI-compatible server to chat with instead of the local "
                                                    "engine, e.g. http://127.0.0.1:8000/v1 (--model names its model)")
    p.add_argument("--api-key", help="with --backend: the server's API key")
    return p


def run_tui(settings: Settings, flags: frozenset[str] = frozenset()) -> int:
    from nvchat.app import NvchatApp  # start-up: Textual loads only for the app
    app = NvchatApp(settings, flags=flags)
    app.run()
    return app.return_code or 0


def main(argv=None, *, exit_after_pipe: bool = False) -> int:
    """Runs the mode the arguments ask for; its exit status. exit_after_pipe: pipe mode ends the
    process itself once its reply is out (nvchat.pipe.run_pipe's exit_process)."""
    startup_trace.mark("reading the command line")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from nvchat.server.serve import (
            main as serve_main,  # start-up: each mode loads only its own modules
        )
        return serve_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt is None and not args.plain and not sys.stdin.isatty():
        # `echo question | nvchat`: no keyboard to drive the app with, so answer what came on stdin.
        args.prompt = "-"
    if args.json and args.prompt is None:
        parser.error("--json goes with -p/--prompt (or a question piped to stdin)")
    try:
        settings = settings_from_args(args)
        settings.sampling_params()  # a bad value is named now, not after seconds of loading the model
    except (SettingsError, ValueError) as e:
        print(f"nvchat: {e}", file=sys.stderr)
        return 2
    if args.prompt is not None:
        from nvchat.pipe import run_pipe  # start-up: as serve above
        return run_pipe(args.prompt, settings, json_output=args.json, exit_process=exit_after_pipe)
    if args.plain:
        from nvchat.repl import run_repl  # start-up: as serve above
        return run_repl(settings)
    return run_tui(settings, flags_given(args))


def command() -> int:
    """The `nvchat` executable, `python -m nvchat` and `python -m nvchat.cli`."""
    return main(exit_after_pipe=True)


if __name__ == "__main__":
    sys.exit(command())
