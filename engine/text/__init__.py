"""Text in and out: loading a model's tokenizer and its end-of-sequence ids, and incremental
detokenization that streams whole characters and holds back what could begin a stop string.

May import: engine.checkpoints (a GGUF file's tokenizer).
"""
