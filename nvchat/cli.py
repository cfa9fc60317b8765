"""The `nvchat` command."""
import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvchat", description="Chat with a local LLM from the terminal.")
    p.add_argument("--model", help="checkpoint directory, or a Hugging Face repo id already in the local cache "
                                   "(default: the built-in demo model, which answers gibberish)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", help="float32, float16 or bfloat16 (default: the checkpoint's on GPU, float32 on CPU)")
    p.add_argument("--tp", type=int, default=1, dest="tensor_parallel_size", help="tensor-parallel GPUs")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    return p


def engine_kwargs(args) -> dict:
    from engine.demo_model import ensure_demo_model
    return dict(model=args.model or str(ensure_demo_model()), device=args.device, dtype=args.dtype,
                tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from engine import LLM, SamplingParams
    from engine.demo_model import GIBBERISH_NOTE
    try:
        llm = LLM(**engine_kwargs(args))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"nvchat: {e}", file=sys.stderr)
        return 1
    with llm:
        if args.model is None:
            print(f"[{GIBBERISH_NOTE}]", file=sys.stderr)
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], tokenize=False,
                                                   add_generation_prompt=True)
        out = llm.generate([prompt], SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
        print(out[0]["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
