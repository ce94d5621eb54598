"""A new gated tool, as a newcomer writes it: one file (and its manifest entry).

`count_words` counts the words of a text, at most `max_words` (a new setting: one field of the
plugin's settings, its value in plugins-enabled.json). Its gate is declared next to it: every call
asks (or follows gate-defaults.json for `count_words`).
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

from plugin_api import BasePlugin, PluginSettings, current_turn, parse_settings


class WordsSettings(PluginSettings):
    """`plugin_config.plugin_tool_words` in plugins-enabled.json."""

    #: The new setting: the most words counted.
    max_words: int = Field(default=100, ge=1)


class _Text(BaseModel):
    text: str = Field(description="the text whose words to count")


class WordsPlugin(BasePlugin):
    PLUGIN_NAME = "plugin_tool_words"
    PLUGIN_TYPE = "data_tool"

    def init(self, config: dict[str, Any]) -> bool:
        self.settings = parse_settings(self.PLUGIN_NAME, WordsSettings, config)
        return True

    def shutdown(self) -> None:
        pass

    def get_tools(self) -> dict[str, Any]:
        async def count_words(text: str) -> str:
            turn = current_turn()
            counted = min(len(text.split()), self.settings.max_words)
            return f"{counted} words (asked by {turn.client_id if turn else 'nobody'})"

        return {"lc": [StructuredTool.from_function(coroutine=count_words, name="count_words",
                                                     description="Count the words of a text.", args_schema=_Text)]}

    def get_gate_tools(self) -> dict[str, Any]:
        return {"count_words": {"type": "words", "operation": "read"}}
