"""Pydantic models of the OpenAI-compatible HTTP API: what the server accepts and answers.

Request models are strict (no string-to-number coercion, no NaN or infinity) and forbid unknown
fields, so a typo such as ``max_token`` is an error rather than silently ignored; every string a
client sends must be valid Unicode (no lone surrogates). Fields that SDKs and agent frameworks
send and that cannot change the result here (``store``, ``metadata``, ``user``...,
``IGNORED_FIELDS``) are accepted and ignored; fields that would change the result but are not
implemented (``functions``, ``function_call``, ``modalities``: ``UNSUPPORTED_FIELDS``) are a 400
unless they hold their neutral value (``[]``, ``"none"``, ``["text"]``). The agent fields
(``tools``, ``tool_choice``, ``response_format``, ``structured_outputs``...) are modelled in
:mod:`prefixserve.server.openai.agent_protocol`. The
constraints here are those of the OpenAI API where it sets one and those of ``SamplingParams``
otherwise, so ``/openapi.json`` describes what is accepted. Fields outside the OpenAI API
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``cache_salt``...) follow vLLM's names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from prefixserve.outputs import FinishReason
from prefixserve.sampling_params import MAX_LOGPROBS
from prefixserve.server.config import MAX_N
from prefixserve.server.openai.agent_protocol import (
    DeltaToolCall,
    ResponseFormat,
    ResponseToolCall,
    StructuredOutputsField,
    ToolCall,
    ToolChoice,
    ToolDefinition,
)
from prefixserve.server.openai.retention_protocol import RetentionSpec

#: The most stop strings one request may give.
MAX_STOP_STRINGS = 16
#: Seeds are 64-bit signed integers (``n`` sequences use ``seed``, ``seed + 1``, ...).
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]


def _kind(value: Any) -> str | None:
    """The union branch a JSON value belongs to: a string, or a list judged by its first item."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        if value and isinstance(value[0], str):
            return "strings"
        if value and isinstance(value[0], list):
            return "token_id_lists"
        return "token_ids"
    return None


Prompt = Annotated[
    Annotated[Text, Tag("string")]
    | Annotated[list[Text], Tag("strings"), Field(min_length=1)]
    | Annotated[list[TokenId], Tag("token_ids"), Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Tag("token_id_lists"),
                Field(min_length=1)],
    Discriminator(_kind, custom_error_type="prompt_type",
                  custom_error_message="must be a string, a list of strings, a list of token "
                  "ids or a list of lists of token ids"),
]

Stop = Annotated[
    Annotated[NonEmptyText, Tag("string")]
    | Annotated[list[NonEmptyText], Tag("strings"), Field(max_length=MAX_STOP_STRINGS)],
    Discriminator(_kind, custom_error_type="stop_type",
                  custom_error_message="must be a string or a list of strings"),
]


_IGNORED = "Accepted and ignored."
_UNSUPPORTED = "Not supported: a 400 unless it holds its neutral value"

#: Fields accepted for compatibility with SDKs and agent frameworks that do not change the result.
IGNORED_FIELDS = frozenset({
    "user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "reasoning_effort", "verbosity", "priority"})
#: Fields that would change the result and are not implemented, with the values that do not.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
}
#: Bias values of ``logit_bias`` (OpenAI's range).
LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    """Options of a streamed response."""

    include_usage: bool | None = Field(
        None, description="Send one more chunk before `data: [DONE]` whose `usage` holds the "
        "token counts of the whole request (and whose `choices` is empty); the other chunks "
        "carry `usage: null`.")


class GenerationRequest(_Strict):
    """The fields both endpoints share: model, sampling, stopping, streaming, cache salt."""

    model: Text | None = Field(None, description="A served model name (see `/v1/models`); "
                               "omitted means the served model.")
    n: int | None = Field(None, ge=1, le=MAX_N, description="Sequences to generate (default 1).")
    temperature: float | None = Field(None, ge=0, le=2, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling (default 1).")
    top_k: int | None = Field(None, ge=-1, description="Keep the k most likely tokens; 0 or -1 "
                              "(the default) mean all.")
    min_p: float | None = Field(None, ge=0, le=1, description="Drop tokens less likely than "
                                "min_p times the most likely one (default 0).")
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED,
                             description="Makes sampling reproducible.")
    stop: Stop | None = Field(None, description="Up to 16 strings that end the generation; "
                              "they are not part of the output.")
    stop_token_ids: list[TokenId] | None = Field(None, description="Token ids that end the "
                                                 "generation.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, description="Divides the logits of "
                                             "tokens already seen (default 1: off).")
    min_tokens: int | None = Field(None, ge=0, description="Tokens to generate before EOS or "
                                   "a stop can end the generation.")
    ignore_eos: bool | None = Field(None, description="Keep generating past the end-of-text "
                                    "token.")
    stream: bool | None = Field(None, description="Answer as server-sent events, ending with "
                                "`data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Only with `stream`.")
    cache_salt: NonEmptyText | None = Field(
        None, description="Requests share prefix-cache blocks only when their salts are equal "
        "(so a tenant cannot probe another's prompts by timing). With the server's "
        "API keys each key gets its own salt too, unless `--share-cache-across-keys`.")
    retention: RetentionSpec | None = Field(
        None, description="Keep this prompt in the prefix cache at a priority for a while "
        "(see docs/explicit-caching.md).")
    skip_special_tokens: bool | None = Field(None, description="Leave special tokens out of "
                                             "the text (default true).")
    include_stop_str_in_output: bool | None = Field(None, description="Keep the stop string "
                                                    "that ended a choice in its text.")
    # Accepted and ignored: they cannot change what this server generates.
    user: Text | None = Field(None, description=_IGNORED)
    store: bool | None = Field(None, description=_IGNORED)
    metadata: dict[str, Any] | None = Field(None, description=_IGNORED)
    service_tier: Text | None = Field(None, description=_IGNORED)
    prompt_cache_key: Text | None = Field(None, description=_IGNORED)
    prompt_cache_retention: Text | None = Field(None, description=_IGNORED)
    safety_identifier: Text | None = Field(None, description=_IGNORED)
    reasoning_effort: Text | None = Field(None, description=_IGNORED + " (no served model "
                                          "reasons)")
    verbosity: Text | None = Field(None, description=_IGNORED)
    priority: int | None = Field(None, description=_IGNORED)
    # Token controls and structured outputs.
    logit_bias: LogitBias | None = Field(None, description="Token id (as a string) -> bias "
                                         "in [-100, 100], added to the logits.")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, description="Only "
                                                    "these token ids may be sampled.")
    response_format: ResponseFormat | None = Field(None, description="`json_object` or "
                                                   "`json_schema`: the output is JSON that "
                                                   "follows it, enforced by a grammar.")
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="vLLM's form: one of json, json_object, regex, choice, grammar.")
    guided_json: dict[str, Any] | str | None = Field(None, description="Older vLLM "
                                                            "name of structured_outputs.json.")
    guided_regex: Text | None = Field(None, description="structured_outputs.regex")
    guided_choice: list[Text] | None = Field(None, min_length=1,
                                             description="structured_outputs.choice")
    guided_grammar: Text | None = Field(None, description="structured_outputs.grammar")
    # Not implemented: a 400 unless neutral.
    functions: list[Any] | None = Field(None, description=_UNSUPPORTED + " (`[]` accepted)")
    function_call: Any = Field(None, description=_UNSUPPORTED + " (`\"none\"` and `\"auto\"` "
                               "accepted)")
    modalities: list[Any] | None = Field(None, description=_UNSUPPORTED + " (`[\"text\"]` "
                                         "accepted)")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def unsupported_field(self) -> str | None:
        """The first field given that is not implemented and holds a value that would change
        the result, or None."""
        for name, neutral in UNSUPPORTED_FIELDS.items():
            if name in self.model_fields_set and getattr(self, name) not in neutral:
                return name
        return None

    def ignored_fields(self) -> list[str]:
        """The fields given that do not change the result (accepted and ignored), sorted."""
        return sorted(name for name in self.model_fields_set
                      if name in IGNORED_FIELDS or name in UNSUPPORTED_FIELDS)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: continue a prompt (or several)."""

    prompt: Prompt = Field(description="A string, a list of strings, a list of token ids or a "
                           "list of token-id lists; each prompt yields `n` choices, numbered "
                           "prompt by prompt.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most (16 "
                                   "when absent or null, as OpenAI's API); the prompt plus this "
                                   "must fit the context.")
    echo: bool | None = Field(None, description="Put the prompt before the generated text.")
    suffix: Text | None = Field(None, description="Not supported: a 400 unless empty.")
    best_of: int | None = Field(None, ge=1, description="Not supported: a 400 unless 1 or "
                                "equal to `n`.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return the "
                                 "logprob of each token and of this many most likely "
                                 "alternatives (with `echo`, of the prompt's tokens too).")


    def unsupported_field(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of not in (1, self.n or 1):
            return "best_of"
        return super().unsupported_field()

    def ignored_fields(self) -> list[str]:
        extra = [name for name in ("suffix", "best_of") if name in self.model_fields_set]
        return sorted([*super().ignored_fields(), *extra])


class TextContentPart(_Strict):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class ImageUrl(_Strict):
    """Where an image part's image is: a ``data:image/...;base64`` URL, or an ``http(s)`` URL
    on a host ``--allowed-media-domains`` names."""

    url: Text
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted; every "
                                                          "image is seen at the model's size.")


class ImageContentPart(_Strict):
    """An image part of a user message's content (a model that takes images)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


def _content_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "string"
    return "parts" if isinstance(value, list) else None


MessageContent = Annotated[
    Annotated[Text, Tag("string")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(_content_kind, custom_error_type="content_type",
                  custom_error_message="must be a string or a list of text and image_url "
                  "parts"),
]


class ChatMessage(_Strict):
    """One message of a conversation. ``developer`` is treated as ``system``; ``tool`` carries
    the result of the call ``tool_call_id`` of an earlier assistant message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = Field(None, description="Text, or a list of parts "
                                           "joined by newlines: text, and in a user message "
                                           "image_url (only an assistant message with "
                                           "tool_calls may leave it out).")
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="Calls the assistant made.")
    tool_call_id: Text | None = Field(None, description="On a tool message: the call it "
                                      "answers.")

    @model_validator(mode="after")
    def _content_and_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with "
                             "tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message "
                             "has one")
        if self.role != "user" and isinstance(self.content, list) and \
                any(isinstance(part, ImageContentPart) for part in self.content):
            raise ValueError("only user messages may hold image_url parts")
        return self


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: the assistant's next message in a conversation."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, rendered "
                                        "with the model's chat template.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Tokens to generate at "
                                              "most (default: until the context is full).")
    max_tokens: int | None = Field(None, ge=1, description="Older name of "
                                   "`max_completion_tokens`, used when that is not given.")
    logprobs: bool | None = Field(None, description="Return the logprob of each output token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With "
                                     "`logprobs`: this many most likely alternatives per token.")
    add_generation_prompt: bool | None = Field(None, description="End the rendered prompt with "
                                               "the assistant's header (default true).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="More variables for the chat template (e.g. `enable_thinking`); "
        "names the server sets itself cannot be overridden.")
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may "
                                               "call (see README, Tool calling).")
    tool_choice: ToolChoice | None = Field(None, description="`none`, `auto` (the default "
                                           "with tools), `required` or a named function.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one "
                                             "answer (default true).")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    cached_tokens_by_tier: dict[str, int] | None = Field(
        None, description="An extension: with KV cache tiers (--kv-disk-dir, --kv-redis-url), "
        "`cached_tokens` split by where the blocks were found: `pool` (in memory), `disk`, "
        "`redis`; null without tiers.")


class Usage(BaseModel):
    """Token counts of a request; each prompt counts once whatever ``n`` is."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Per token: its text, its offset in the choice's text, its logprob and the most likely
    alternatives (``null`` for the first prompt token, which nothing predicts)."""

    tokens: list[str]
    text_offset: list[int]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(None, description="The stop string or stop token id "
                                          "that ended the choice, if one did.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="Always set, except on streamed chunks.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | Literal["tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | Literal["tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixserve"
    root: str = Field(description="The base model's id (never a path on the server).")
    parent: str | None = Field(default=None, description="For a LoRA adapter, the base "
                               "model it applies to (its root is the adapter's content id).")
    max_model_len: int = Field(description="Context length in tokens (prompt plus output).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StatusResponse(BaseModel):
    status: str


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str = Field(description="What is wrong, in words.")
    type: str = Field(description="invalid_request_error, authentication_error, "
                      "permission_error, not_found_error, service_unavailable_error or "
                      "server_error.")
    param: str | None = Field(None, description="The request field at fault, if one is.")
    code: str | None = Field(None, description="A stable name of the error.")


class ErrorResponse(BaseModel):
    """The body of every error response, as the OpenAI API's."""

    error: ErrorDetail
