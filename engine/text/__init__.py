"""Text in and out: loading a model's tokenizer and its end-of-sequence ids, incremental
detokenization that streams whole characters and holds back what could begin a stop string, and
structured output's grammars and token masks (llguidance), and tool calls in a model's own format
(tool_calls: rendered, parsed, constrained).

May import: engine.core (what a request asks for), engine.checkpoints (a GGUF file's tokenizer).
"""
