"""MCP servers' tools (nvchat/mcp_tools.py) against a real MCP server written with the official SDK
(tests/mcp_test_server.py), over stdio and over streamable HTTP; config.toml's [mcp_servers]; and
how a conversation stores calls and their results and bounds calling replies."""
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nvchat import paths
from nvchat.conversation import MAX_TOOL_ROUNDS, NOT_RUN, Conversation, Message
from nvchat.mcp_tools import McpServerSpec, McpTools, server_specs
from nvchat.settings import Settings, SettingsError, load_settings, save_setting
from nvchat.store import ChatStore

SERVER = str(Path(__file__).resolve().parent / "mcp_test_server.py")


@pytest.fixture(autouse=True)
def xdg_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


class Reports:
    """What McpTools reports from its thread, and a way to wait until every server has reported."""

    def __init__(self, expected: int):
        self.expected = expected
        self.items: list[tuple[str, str, str]] = []
        self.all_in = threading.Event()

    def __call__(self, kind: str, server: str, text: str) -> None:
        self.items.append((kind, server, text))
        if len(self.items) >= self.expected:
            self.all_in.set()

    def wait(self) -> dict[str, tuple[str, str]]:
        assert self.all_in.wait(60), f"only {self.items} reported"
        return {server: (kind, text) for kind, server, text in self.items}


def started(specs: list[McpServerSpec], tmp_path) -> tuple[McpTools, dict]:
    reports = Reports(len(specs))
    tools = McpTools(specs, reports, log_dir=tmp_path / "logs").start()
    return tools, reports.wait()


def test_a_stdio_servers_tools_are_offered_and_called_and_a_server_that_cannot_start_is_reported(tmp_path):
    tools, reports = started([McpServerSpec("test", command=sys.executable, args=(SERVER,)),
                              McpServerSpec("gone", command=str(tmp_path / "no-such-server"))], tmp_path)
    try:
        assert reports["test"] == ("ready", "weather, broken")
        kind, why = reports["gone"]
        assert kind == "failed" and "No such file" in why and "gone.log" in why
        assert tools.status == {"test": "ready", "gone": f"failed: {why}"}
        weather = tools.definitions[0]["function"]
        assert weather["name"] == "weather" and weather["description"] == "Today's weather in a city."
        assert weather["parameters"]["properties"]["city"]["enum"] == ["Paris", "Oslo"]
        result = tools.call("weather", '{"city": "Oslo"}').result(30)
        assert (result.text, result.error) == ("Oslo: 21 degrees and sunny", False)
        assert tools.call("broken", '{"part": "disk"}').result(30).error
        assert tools.call("weather", '{"city": ').result(30).text.startswith("The arguments are not JSON")
        assert tools.call("nothing", "{}").result(30).text == "There is no tool named 'nothing'."
    finally:
        tools.close()
    assert tools._thread is not None and not tools._thread.is_alive()


def test_a_streamable_http_server_is_reached_by_its_url(tmp_path):
    server = subprocess.Popen([sys.executable, SERVER, "http"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        port = server.stdout.readline().strip()  # printed once the server's socket listens
        assert port.isdigit(), f"the HTTP server did not start (exit status {server.wait(10)})"
        tools, reports = started([McpServerSpec("web", url=f"http://127.0.0.1:{port}/mcp")], tmp_path)
        try:
            assert reports["web"] == ("ready", "weather, broken")
            assert tools.call("weather", '{"city": "Paris"}').result(30).text == "Paris: 21 degrees and sunny"
        finally:
            tools.close()
    finally:
        server.terminate()
        server.wait(10)
        server.stdout.close()


def test_servers_come_from_config_toml_and_survive_saving_another_setting():
    config = paths.config_file()
    config.parent.mkdir(parents=True)
    config.write_text('theme = "nvchat-light"\n\n[mcp_servers.files]\ncommand = "uvx"\n'
                      'args = ["mcp-server-filesystem", "/tmp"]\nenv = { LOG_LEVEL = "warning" }\n\n'
                      '[mcp_servers.search]\nurl = "http://localhost:8000/mcp"\nheaders = { Authorization = "Bearer x" }\n')
    expected = [McpServerSpec("files", command="uvx", args=("mcp-server-filesystem", "/tmp"),
                              env={"LOG_LEVEL": "warning"}),
                McpServerSpec("search", url="http://localhost:8000/mcp", headers={"Authorization": "Bearer x"})]
    assert server_specs(load_settings().mcp_servers) == expected
    save_setting("theme", "nvchat-dark")
    settings = load_settings()
    assert settings.theme == "nvchat-dark" and server_specs(settings.mcp_servers) == expected
    assert Settings().mcp_servers == {}


@pytest.mark.parametrize("table, words", [
    ("[mcp_servers.x]\nargs = []\n", "mcp_servers.x needs either command"),
    ('[mcp_servers.x]\ncommand = "a"\nurl = "http://h"\n', "not both"),
    ('[mcp_servers.x]\ncommand = "a"\nargs = "b"\n', "mcp_servers.x.args must be a list of strings"),
    ('[mcp_servers.x]\nurl = "ftp://h"\n', "mcp_servers.x.url must be an http"),
    ('[mcp_servers.x]\ncommand = "a"\ncwd = "/"\n', "unknown key(s) cwd"),
    ('[mcp_servers."a b"]\ncommand = "a"\n', "a server's name"),
    ('mcp_servers = 3\n', "mcp_servers must be a table"),
])
def test_a_bad_server_in_config_toml_is_named(table, words):
    paths.config_file().parent.mkdir(parents=True)
    paths.config_file().write_text(table)
    with pytest.raises(SettingsError, match="config.toml: ") as error:
        load_settings()
    assert words in str(error.value)


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


class Offered:
    definitions = [WEATHER]


def call(n: int) -> dict:
    return {"id": f"call_{n}", "type": "function", "function": {"name": "weather", "arguments": "{}"}}


def conversation(store=None) -> Conversation:
    return Conversation(None, store, system_prompt="", model_name="demo", settings=Settings())


def test_calls_and_results_are_stored_and_a_call_left_without_a_result_is_sent_as_not_run(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat = conversation(store)
    question = chat._add(Message("user", "weather?"), None)
    reply = chat._add(Message("assistant", "", tool_calls=[call(1), call(2)]), question)
    assert chat.pending_tool_calls == [call(1), call(2)]
    chat.add_tool_result(call(1), "sunny")
    assert chat.pending_tool_calls == [call(2)]
    with pytest.raises(ValueError, match="every call's result"):
        chat.continue_after_tools()
    chat._add(Message("user", "never mind"), chat.messages[-1])  # the app quit before call 2 was approved
    loaded = Conversation.load(None, store, chat.id, Settings())
    assert [(m.role, m.tool_calls) for m in loaded.messages] == [
        ("user", None), ("assistant", [call(1), call(2)]), ("tool", [call(1)]), ("user", None)]
    assert loaded.engine_messages()[1:4] == [
        {"role": "assistant", "content": "", "tool_calls": [call(1), call(2)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": NOT_RUN}]
    assert "## Tool result: weather" in loaded.to_markdown() and "*Calls `weather({})`*" in loaded.to_markdown()
    store.close()


def test_tools_are_offered_until_max_tool_rounds_calling_replies_in_a_row_then_named_but_not_offered():
    chat = conversation()
    chat.toolbox = Offered()
    messages = [Message("user", "go")]
    for n in range(MAX_TOOL_ROUNDS):
        tools = chat._tools(messages)
        assert tools.choice == "auto" and tools.offered
        messages += [Message("assistant", "", tool_calls=[call(n)]), Message("tool", "x", tool_calls=[call(n)])]
    assert chat._tools(messages).choice == "none"
    assert chat._tools(messages + [Message("assistant", "ok"), Message("user", "again")]).offered
    chat.toolbox = None  # the server is gone: the calls made still need their function named
    assert chat._tools(messages).definitions == [{"type": "function", "function": {"name": "weather",
                                                                                    "parameters": {}}}]
    assert chat._tools([Message("user", "hi")]) is None
