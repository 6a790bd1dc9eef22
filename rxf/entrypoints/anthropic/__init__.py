"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): a translation layer over
the chat path of the OpenAI-compatible API, as that one is over the native request.

`router` holds its routes; the HTTP server includes it, and answers every error under
`errors.PATH_PREFIX` in Anthropic's shape.
"""

from __future__ import annotations

from rxf.entrypoints.anthropic.serving_messages import router

__all__ = ["router"]
