"""nvchat: chat with local LLMs on NVIDIA GPUs from a terminal."""
