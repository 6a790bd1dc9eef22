"""Chat messages (OpenAI's shape, as dicts) -> the chat template's messages and the rendered prompt."""

from __future__ import annotations

from typing import Any

from rxf.core.echo import echo
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.tool_parsers import ToolCallParser
from rxf.plugins.chat_templates.tools import HermesSyntax

_IMAGE_PARTS = ("image_url", "input_image", "image")
_VIDEO_PARTS = ("video_url", "video")


def template_messages(
    messages: list[dict[str, Any]], images: list[Any] | None = None, videos: list[Any] | None = None
) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: the keys given (nulls dropped), with OpenAI's
    "developer" role as the "system" role it replaces. Media parts are refused unless `images` /
    `videos` are given (the model takes them): then each image becomes an `image_url` part with its
    URL appended to `images`, each video (a file URL or a list of frame URLs) a `video` part with
    it appended to `videos`, in prompt order. A tool message must answer a call of an earlier
    assistant message, by its id (as OpenAI's API requires; a conversation with a call that has no
    id is taken as it is)."""
    out = []
    called: set[str] | None = set()  # the ids of the calls so far (None: a call without one)
    for i, msg in enumerate(messages):
        item = {key: value for key, value in msg.items() if value is not None}
        called = _check_tool_result(item, i, called)
        if isinstance(item.get("content"), list):
            parts = item["content"] = list(item["content"])
            for j, part in enumerate(parts):
                kind, where = part.get("type"), f"messages[{i}].content[{j}]"
                if kind in _IMAGE_PARTS:
                    if images is None:
                        raise ChatInputError(f"{where}: images are not supported by this model", "messages")
                    images.append(_image_url(part, where))
                    parts[j] = {"type": "image_url"}
                elif kind in _VIDEO_PARTS:
                    if videos is None:
                        raise ChatInputError(f"{where}: videos are not supported by this model", "messages")
                    videos.append(_video(part, where))
                    parts[j] = {"type": "video"}
        if item["role"] == "developer":
            item["role"] = "system"
        out.append(item)
    return out


def _check_tool_result(item: dict[str, Any], i: int, called: set[str] | None) -> set[str] | None:
    """`called` with the ids of message i's calls; refuses a tool result that answers none before it."""
    for call in item.get("tool_calls") or ():
        call_id = call.get("id") if isinstance(call, dict) else None
        if not call_id:
            return None
        if called is not None:
            called.add(call_id)
    if item.get("role") == "tool" and called is not None and item.get("tool_call_id") not in called:
        raise ChatInputError(f"messages[{i}].tool_call_id: {echo(item.get('tool_call_id'))} answers no tool call "
                             f"of an earlier assistant message", "messages")
    return called


def _video(part: dict[str, Any], where: str) -> str | list[str]:
    """The video of a `video` / `video_url` part: one video file URL (data:, or http(s)/file when
    the server allows them) or a list of frame image URLs, as `{"type": "video_url", "video_url":
    {"url": ...}}` or `{"type": "video", "video": ...}`."""
    value = part.get(part["type"])
    video = value.get("url") if isinstance(value, dict) else value
    if isinstance(video, str) and video:
        return video
    if not isinstance(video, list) or not video or not all(isinstance(f, str) and f for f in video):
        raise ChatInputError(
            f"{where}: a video is a video file URL or a non-empty list of frame URLs; got {type(video).__name__}",
            "messages",
        )
    return video


def _image_url(part: dict[str, Any], where: str) -> Any:
    """The image of an `image_url` / `input_image` / `image` part: a URL (data:, or http(s)/file
    when the server allows them) or base64."""
    value = part.get(part["type"])
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ChatInputError(f"{where}: expected {part['type']!r} to hold a URL string (or {{'url': ...}})", "messages")
    return url


def render_messages(
    items: list[dict[str, Any]],
    chat_template: Any,
    tool_parser: ToolCallParser | None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The rendered prompt for template messages. Messages with tool calls or results, or offered
    `tools`, go through the template's tool rendering (in `tool_parser`'s format where the template
    has none; Hermes' for a parser that gives none). Raises ChatInputError naming "messages" for
    messages the template refuses."""
    with_tools = tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in items)
    try:
        if with_tools:
            syntax = tool_parser.syntax if tool_parser is not None and tool_parser.syntax else HermesSyntax()
            return chat_template.render_with_tools(items, tools or [], syntax, add_generation_prompt)
        return chat_template.render(items, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # the template names the offending message
        raise ChatInputError(str(exc), "messages") from None
