"""Text in and out of the server: the chat template, streaming detokenisation and stop strings.

The chat format follows DeepSeek-V4's published reference encoder (``encoding/encoding_dsv4.py`` of the
DeepSeek-V4-Flash release, whose README documents it; our spec has no chat section): BOS, the system prompt,
then ``<｜User｜>{content}`` and ``<｜Assistant｜>`` turns; an assistant turn closes with EOS. In thinking mode the
generation prompt ends in ``<think>`` and the model writes its reasoning before ``</think>``; in chat mode the
prompt ends in ``</think>``. Earlier assistant turns are rendered without their reasoning (the encoder's
``drop_thinking``). A ``chat_template`` in ``tokenizer_config.json`` replaces this encoder when present.

Reasoning effort (spec model §9.6): V4.1 conditions on a scalar b ∈ [1, 100] in the system prompt, with API
presets low / high / max = 50 / 75 / 100. The exact wording of that line is not public [OPEN]: we write
``Reasoning Effort: {b}`` as the system prompt's first line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
EFFORT_PRESETS = {"low": 50, "high": 75, "max": 100}  # spec model §9.6


class TemplateError(ValueError):
    """A conversation the template cannot render; ``param`` names the request field."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def effort_value(effort: str | int | None) -> int | None:
    """``low`` / ``high`` / ``max`` or an integer in [1, 100] -> b (None: no effort line)."""
    if effort is None:
        return None
    if isinstance(effort, str):
        if effort not in EFFORT_PRESETS:
            raise TemplateError(f"reasoning_effort {effort!r}: expected one of {sorted(EFFORT_PRESETS)} or an "
                                "integer in [1, 100]", "reasoning_effort")
        return EFFORT_PRESETS[effort]
    if not 1 <= effort <= 100:
        raise TemplateError(f"reasoning_effort {effort}: integers must lie in [1, 100]", "reasoning_effort")
    return effort


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise TemplateError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part.get("text", ""))
        return "".join(parts)
    return content


def image_parts(messages: list[dict], placeholder: str) -> tuple[list[dict], list[tuple[str, str]]]:
    """The messages with each ``image_url`` content part replaced by a text part holding ``placeholder`` (the image
    token, where the image's span goes), and each image's (request field, URL) in order."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    images.append((f"messages[{i}].content[{j}].image_url.url", part["image_url"]["url"]))
                    part = {"type": "text", "text": placeholder}
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out, images


@dataclass
class ChatTemplate:
    """Renders OpenAI messages as the model's prompt text."""

    bos: str
    eos: str
    jinja: str | None = None  # tokenizer_config.json's chat_template

    @classmethod
    def from_tokenizer_dir(cls, directory: Path, tok: Tokenizer, bos_id: int, eos_id: int) -> ChatTemplate:
        path = directory / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        return cls(tok.id_to_token(bos_id), tok.id_to_token(eos_id), config.get("chat_template"))

    def render(self, messages: list[dict], *, thinking: bool = False, effort: int | None = None) -> str:
        if not messages:
            raise TemplateError("messages is empty: give at least one message")
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "developer", "user", "assistant"):
                raise TemplateError(f"messages[{i}].role {m.get('role')!r}: expected system, user or assistant",
                                    f"messages[{i}].role")
        if self.jinja is not None:
            return self._render_jinja(messages, thinking, effort)
        system = [_content(m, i) for i, m in enumerate(messages) if m["role"] in ("system", "developer")]
        if effort is not None:
            system.insert(0, f"Reasoning Effort: {effort}")
        out = [self.bos, "\n\n".join(system)]
        for i, m in enumerate(messages):
            if m["role"] == "user":
                out.append(USER + _content(m, i))
            elif m["role"] == "assistant":  # earlier turns: the answer only (drop_thinking)
                out.append(ASSISTANT + END_THINK + _content(m, i) + self.eos)
        out.append(ASSISTANT + (THINK if thinking else END_THINK))
        return "".join(out)

    def _render_jinja(self, messages: list[dict], thinking: bool, effort: int | None) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.jinja).render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos,
            thinking=thinking, reasoning_effort=effort)


@dataclass
class TextStream:
    """Token ids -> text pieces that never split a character, held back while a stop string may be forming.

    ``push`` returns the text that is safe to send; once a stop string appears, :attr:`stopped` is set and the
    text ends just before it. ``finish`` returns what was held back.
    """

    tok: Tokenizer
    stops: tuple[str, ...] = ()
    text: str = ""
    sent: int = 0
    stopped: bool = False
    _decoder: DecodeStream = field(default_factory=lambda: DecodeStream(skip_special_tokens=False))

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        piece = self._decoder.step(self.tok, token)
        if piece:
            self.text += piece
            hits = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
                return self._flush(len(self.text))
        hold = max((len(s) - 1 for s in self.stops), default=0)
        return self._flush(max(self.sent, len(self.text) - hold))

    def finish(self) -> str:
        return self._flush(len(self.text))

    def _flush(self, upto: int) -> str:
        out, self.sent = self.text[self.sent: upto], upto
        return out


@dataclass
class ReasoningSplit:
    """Splits thinking-mode output at ``</think>``: (reasoning, content) pieces, the marker held back while
    it may still be forming across pieces."""

    thinking: bool
    buffer: str = ""

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        self.buffer += text
        if END_THINK in self.buffer:
            reasoning, _, content = self.buffer.partition(END_THINK)
            self.thinking, self.buffer = False, ""
            return reasoning, content
        keep = 0 if final else next((k for k in range(len(END_THINK) - 1, 0, -1)
                                     if self.buffer.endswith(END_THINK[:k])), 0)
        out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out, ""
