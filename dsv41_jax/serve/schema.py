"""Request bodies of the OpenAI API as pydantic models: what is accepted, with ranges.

Unknown fields are refused (``extra="forbid"``); fields of the API that this server does not implement are
accepted only at their neutral value, so a client is told instead of silently getting something else.
Validation errors become OpenAI-style 400 bodies naming the field (``api.validation_error``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (as vLLM): 0 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False  # extension (as vLLM): the generated ids in each choice
    cache_salt: str = ""  # extension (as vLLM): prefix-cache entries are shared only within one salt

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return tuple(stops)

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v != 0:
            raise ValueError("penalties are not supported: leave it at 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v


class CompletionRequest(_Common):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)  # the API's default
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] = False
    suffix: None = None
    best_of: int = Field(1, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if len(v) == 0:
            raise ValueError("the prompt is empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1)  # data:image/...;base64,..., a local path or file:// URL (dsv41_jax.serve.images)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor's own resolution rules apply


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # earlier turns' reasoning: dropped by the template


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: Literal["low", "high", "max"] | int | None = None  # spec model §9.6
    chat_template_kwargs: dict[str, Any] | None = None  # {"thinking": bool}
    tools: None = None
    tool_choice: None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v and v.get("type", "text") != "text":
            raise ValueError("only {'type': 'text'} is supported")
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v):
        if isinstance(v, int) and not 1 <= v <= 100:
            raise ValueError("an integer reasoning effort lies in [1, 100]")
        return v
