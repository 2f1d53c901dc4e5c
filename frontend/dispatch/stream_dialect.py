"""What the proxy reads from an engine's answer, per API: OpenAI's SSE chunks or Anthropic's events.

The stream proxy, the usage tap and the unary path ask the dialect where the first token is, how many
tokens a chunk carries, where the usage is and how a failure after the response started is told to
the client; everything else about relaying a stream is the same for both APIs.
"""

from __future__ import annotations

import re

from frontend.observability.parity import parse_usage as parse_openai_usage
from frontend.request.errors import openai_error_body
from kvroute_common import anthropic_api

_DONE = b"data: [DONE]"
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class OpenAIStream:
    """``data: {...}`` chunks, ``data: [DONE]`` at the end; vLLM's first chunk carries only the role."""

    usage_key = b'"prompt_tokens"'  # only a usage object has it (a quote inside content is escaped)

    @staticmethod
    def has_token(chunk: bytes) -> bool:
        return not (
            chunk.count(b"data:") == 1
            and b'"role"' in chunk
            and (b'"content":""' in chunk or b'"content": ""' in chunk)
        )

    @staticmethod
    def tokens(chunk: bytes) -> int:
        n = chunk.count(b"data:")
        if n:
            if _DONE in chunk:
                n -= 1
            if b'"content":""' in chunk or b'"choices":[]' in chunk:  # role-only / usage-only events
                n -= chunk.count(b'"content":""') + chunk.count(b'"choices":[]')
        return n

    parse_usage = staticmethod(parse_openai_usage)

    @staticmethod
    def body_tokens(body: bytes) -> int:
        m = _COMPLETION_TOKENS.search(body)
        return int(m.group(1)) if m else 0

    @staticmethod
    def failure(status: int, message: str) -> bytes:
        return b"data: " + openai_error_body(status, message) + b"\n\ndata: [DONE]\n\n"


class AnthropicStream:
    """``event: NAME`` + ``data: {...}``: message_start, content blocks (a token per delta), message_delta
    with the usage, message_stop."""

    usage_key = anthropic_api.USAGE_KEY

    @staticmethod
    def has_token(chunk: bytes) -> bool:
        return b"event: content_block_" in chunk

    @staticmethod
    def tokens(chunk: bytes) -> int:
        return chunk.count(b"event: content_block_delta")

    parse_usage = staticmethod(anthropic_api.parse_usage)
    body_tokens = staticmethod(anthropic_api.output_tokens)

    @staticmethod
    def failure(status: int, message: str) -> bytes:
        return anthropic_api.error_event(status, message)


OPENAI = OpenAIStream()
ANTHROPIC = AnthropicStream()
StreamDialect = OpenAIStream | AnthropicStream
