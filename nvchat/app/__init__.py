"""nvchat's Textual app.

Its modules are layered as nvchat's are (tests/test_layering.py checks it), bottom to top:

    bindings, events, pacing, frame_stats, code_block, chat_screen, footer, open_tabs
        parts that use no other part of the app: the key table, the prompt box's events, draw
        pacing, the screen's compositor, the key footer, the list of open chats kept for a restart
    streaming_markdown, message_view, tool_views, prompt_input, chat_pane, kv_panel
        the widgets: a reply as it streams, messages, tool calls, the prompt box, one chat's tab,
        the KV panel
    loading_screen, rename_screen, system_prompt_screen, sampling_screen, conversations_screen,
    help_screen, file_picker_screen, tool_approval_screen, command_palette
        the screens and dialogs, and the command palette's commands
    services, chat_tabs, stream_pump, tool_rounds, actions
        the app's jobs: the backend's start-up and shutdown, the tabs, the stream pump, tool calls
        through MCP, the actions
    app
        NvchatApp, which composes the screen from these parts and wires them together

Widgets never reach up into the app: they are handed what they need and post messages.
"""
from nvchat.app.app import NvchatApp

__all__ = ["NvchatApp"]
