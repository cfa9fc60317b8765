"""nvchat: chat with local LLMs on NVIDIA GPUs from a terminal.

The package is layered: a module imports only from its own layer and the layers below it
(tests/test_layering.py checks it), bottom to top:

    paths, default_model, mcp_tools, settings, flags, store, slash_table, startup_trace
        what every mode shares: where files live, MCP servers' tools, the settings and their
        command-line flags, the SQLite conversation store, the table of slash commands, start-up
        timestamps for benchmarks
    conversation, export, attachments, backend, remote_backend
        one chat, its Markdown export, files added to its messages, and what it runs on: the
        in-process engine or a remote server
    app, repl, repl_slash_handlers, repl_tools, pipe, server
        the front-ends: the Textual app, the plain REPL with its slash commands and tool calls, pipe
        mode, `nvchat serve`
    cli
        the `nvchat` command, which picks a front-end
    __main__
        `python -m nvchat`

The engine (engine/) sits below all of it and never imports nvchat.
"""
