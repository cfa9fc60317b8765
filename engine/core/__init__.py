"""The scheduling core: what nano-vllm's engine/ holds, in plain Python.

Requests (`Sequence`) and how to sample them (`SamplingParams`), the paged KV cache's bookkeeping
with its chained-hash prefix cache (`BlockManager`), the scheduler that picks each step's work
and preempts when blocks run out (`Scheduler`), and the plain-data plan of one step that the runner
executes (`StepPlan`). No torch: this is the part to read first, and it runs anywhere.

May import: the standard library and xxhash only.
"""
