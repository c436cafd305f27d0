"""OpenAI request shapes (pydantic) and what DSpark does with them.

Unknown fields are refused (as OpenAI does), and so are known options DSpark does not
implement (`best_of`, `suffix`, `functions`, tools on completions), each naming the field:
never silently ignored. Sampling: `n`, `logprobs` (chat: true with `top_logprobs` 0-20;
completions: 0-20) and `echo` (completions), `presence_penalty`, `frequency_penalty`,
`logit_bias`, and vLLM's `repetition_penalty`, `min_p`, `top_k`. Extensions:
`speculative_decoding` (default true) and `speculative_config` (`method`: hybrid, lookup or
draft; `draft_model`, `max_window`), `cache_prompt` (default true; false: the prompt neither
reuses nor fills the prefix cache). Structured output: `response_format` json_object or
json_schema; `tools` + `tool_choice` on chat (runtime/grammar, server/tool_calls.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dspark.runtime.errors import RequestError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["hybrid", "lookup", "draft"] | None = None
    draft_model: str | None = None
    max_window: int | None = Field(None, ge=1, le=64)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# Known OpenAI options DSpark does not implement, with the values that mean "off".
NO_OP: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
}
MAX_N = 16  # choices per request
CHAT_ONLY = ("tools", "tool_choice")  # implemented for chat completions


class GenerationParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative_decoding: bool = True
    speculative_config: SpeculativeConfig | None = None
    cache_prompt: bool = True  # false: neither reuse a cached prefix nor cache this prompt
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # vLLM's
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's
    logit_bias: dict[str, float] | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None

    def unsupported(self) -> str | None:
        """The first option set to something DSpark does not implement."""
        return next((k for k, ok in NO_OP.items() if getattr(self, k, None) not in ok), None)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias), its keys token ids (JSON object keys are
        strings); a RequestError naming the field otherwise."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}",
                                   "logit_bias")
            out.append((int(key), float(value)))
        return tuple(sorted(out))

    def top_logprobs_count(self) -> int | None:
        """How many top logprobs each token reports (None: no logprobs)."""
        return None


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def unsupported(self) -> str | None:
        return next((k for k, ok in NO_OP.items()
                     if k not in CHAT_ONLY and getattr(self, k, None) not in ok), None)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationParams):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def limit(self) -> int | None:
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class CacheResizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_length: int = Field(ge=16)


class WarmupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    draft_tokens: int = Field(8, ge=0, le=512)
    main_tokens: int = Field(1, ge=1, le=512)
