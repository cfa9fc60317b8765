"""Text in and out: loading a model's tokenizer and its end-of-sequence ids, incremental
detokenization that streams whole characters and holds back what could begin a stop string, and
structured output's grammars and token masks (llguidance).

May import: engine.core (what a request asks for), engine.checkpoints (a GGUF file's tokenizer).
"""
