"""Request bodies of the OpenAI-compatible server: models, validation, and their SamplingParams.

Every problem with a request becomes an :class:`APIError` whose body has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` and whose message names the offending field.
Types are checked strictly (``"0.5"`` is not a number, ``1`` is not a bool, ``1.5`` is not an integer;
an integral number such as ``2.0`` is an integer, as in JSON Schema and OpenAI's API):
OpenAI rejects them, and coercing them would hide client bugs. Fields that OpenAI defines but this
server does not implement are refused by name (unless given their no-op value), and so is any field
nobody defines — never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema

from inflight.sampling_params import GuidedDecodingParams, SamplingParams

# OpenAI's default for /v1/completions (chat has no default: until EOS or the context is full).
DEFAULT_COMPLETION_MAX_TOKENS = 16


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------- models


def _integral(value: Any) -> Any:
    """2.0 -> 2 (JSON Schema's "integer" includes integral numbers); everything else is left to the
    strict int check (1.5, "2" and True stay errors)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field: strict, except that an integral float is accepted.
Integer = Annotated[int, BeforeValidator(_integral)]

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
# The prompt forms of OpenAI's /v1/completions; parse_prompt checks them (with named errors).
PromptField = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                _TOKEN_IDS,
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ],
            "description": "a text, a list of token ids, or a list of either",
        }
    ),
]
MessagesField = Annotated[
    Any,
    WithJsonSchema(
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "role": {"type": "string"},
                    "content": {"type": "string"},
                    "name": {"type": "string"},
                },
                "required": ["role", "content"],
            },
        }
    ),
]
StopField = Annotated[
    Any,
    WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
    ),
]
TokenIdsField = Annotated[Any, WithJsonSchema({"anyOf": [_TOKEN_IDS, {"type": "null"}]})]
GuidedField = Annotated[
    Any, WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}]})
]
ResponseFormatField = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"type": {"enum": ["text", "json_object"]}},
                    "required": ["type"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "json_schema"},
                        "json_schema": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": {"type": "boolean"},
                                "description": {"type": "string"},
                            },
                            "required": ["schema"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["type", "json_schema"],
                    "additionalProperties": False,
                },
                {"type": "null"},
            ]
        }
    ),
]
ChoiceField = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "null"},
            ]
        }
    ),
]
PredictionField = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "content"},
                        "content": {
                            "anyOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                                        "required": ["type", "text"],
                                    },
                                },
                            ]
                        },
                    },
                    "required": ["type", "content"],
                },
                {"type": "null"},
            ]
        }
    ),
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields common to both endpoints. Extra fields are kept (``extra="allow"``) so that
    :func:`check_extra_fields` can refuse each by name with a useful message."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    n: Integer = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # str or list of str: checked by SamplingParams, whose message is clearer than a union error.
    stop: StopField = None
    seed: Integer | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # an end-user id for abuse monitoring: accepted, not used
    # vLLM's extensions
    ignore_eos: bool = False
    top_k: Integer | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Integer = 0
    stop_token_ids: TokenIdsField = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's predicted outputs: {"type": "content", "content": str | [{"type": "text", "text": str}]}
    prediction: PredictionField = None
    prompt_logprobs: Integer | None = None  # vLLM's: the prompt's log-probabilities (stream: 1st chunk)
    # Structured output: OpenAI's response_format, and vLLM's guided_* fields (checked by parse_guided).
    response_format: ResponseFormatField = None
    guided_json: GuidedField = None
    guided_regex: str | None = None
    guided_choice: ChoiceField = None
    guided_grammar: str | None = None
    # Beam search (vLLM's and TensorRT-LLM's fields): best_of beams, the n best returned.
    use_beam_search: bool = False
    best_of: Integer | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False


class CompletionRequest(_Request):
    # str | list[int] | list[str] | list[list[int]]: checked by parse_prompt (named errors).
    prompt: PromptField
    max_tokens: Integer | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Integer | None = None


class ChatCompletionRequest(_Request):
    messages: MessagesField
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    logprobs: bool = False
    top_logprobs: Integer | None = None
    add_generation_prompt: bool = True  # vLLM's extension


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a ``prompt`` (tokenised as /v1/completions does) or ``messages``
    (rendered by the chat template as /v1/chat/completions does), exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: MessagesField = None
    add_special_tokens: bool | None = None  # a prompt: default True; messages: the template places them
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``: the text of ``tokens``."""

    model: str | None = None
    tokens: TokenIdsField


# OpenAI fields this server does not implement, with the values that mean "not used" (accepted).
_NOOP: dict[str, Any] = {
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "web_search_options": (),
    "store": (False,),
    "metadata": (),
    "service_tier": (),
}
UNSUPPORTED_FIELDS = frozenset(_NOOP)


def check_extra_fields(req: _Request) -> None:
    """Refuses, by name, every field of the body that is not implemented (see the module doc)."""
    for name, value in (req.model_extra or {}).items():
        if name in _NOOP:
            if value is None or any(value == v and type(value) is type(v) for v in _NOOP[name]):
                continue
            raise bad_request(
                f"{name} is not supported by this server", param=name, code="unsupported_parameter"
            )
        raise bad_request(f"unrecognized request field: {name}", param=name, code="unrecognized_parameter")
    if req.use_beam_search and req.stream:
        raise bad_request("use_beam_search is not supported with stream=true", param="use_beam_search")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


# ---------------------------------------------------------------------------------------------- prompts


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompt(prompt: Any) -> list[str | list[int]]:
    """``prompt`` (a string, a list of token ids, or a list of either) -> a non-empty list of prompts."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif _is_ids(prompt) and prompt:
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        items = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    else:
        raise bad_request(
            "prompt must be a string, a list of token ids, or a list of strings or of token-id "
            f"lists, got {_short(prompt)}",
            param="prompt",
        )
    for i, p in enumerate(items):
        if len(p) == 0:
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            raise bad_request(f"{where} must not be empty", param="prompt")
        if not isinstance(p, str) and any(t < 0 for t in p):
            raise bad_request(f"prompt token ids must be >= 0, got {min(p)}", param="prompt")
    return items


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_field(req: _Request) -> str | None:
    """The request field that carries its structured-output constraint, if one does."""
    return next((n for n in GUIDED_FIELDS if getattr(req, n) is not None), None)


def parse_guided(req: _Request) -> GuidedDecodingParams | None:
    """The request's structured-output constraint: OpenAI's ``response_format`` (``json_schema``
    with its ``schema``, ``json_object``, or ``text``: none) or one of vLLM's ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at most one of them."""
    given = {name: getattr(req, name) for name in GUIDED_FIELDS if getattr(req, name) is not None}
    fmt = given.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "text" and set(fmt) == {"type"}:
        del given["response_format"]  # plain text: no constraint
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(
            f"at most one of response_format, guided_json, guided_regex, guided_choice, guided_grammar may be "
            f"set, got {sorted(given)}",
            param=sorted(given)[1],
        )
    ((name, value),) = given.items()
    try:
        if name == "response_format":
            kind = value.get("type") if isinstance(value, dict) else None
            if kind == "json_object" and set(value) == {"type"}:
                return GuidedDecodingParams(json_object=True)
            if kind == "json_schema" and set(value) == {"type", "json_schema"}:
                spec = value["json_schema"]
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise ValueError("response_format.json_schema must be an object with a 'schema' object")
                extra = set(spec) - {"name", "schema", "strict", "description"}
                if extra:
                    raise ValueError(f"response_format.json_schema has unknown fields {sorted(extra)}")
                return GuidedDecodingParams(json=spec["schema"])
            raise ValueError(
                'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                f'"json_schema": {{"name": ..., "schema": {{...}}}}}}, got {_short(value)}'
            )
        field = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        return GuidedDecodingParams(**{field[name]: value})
    except ValueError as exc:
        raise bad_request(str(exc).replace("guided_decoding", name), param=name) from None


def parse_prediction(prediction: Any) -> str | None:
    """OpenAI's ``prediction`` -> the predicted text (its tokens become draft tokens), or None."""
    if prediction is None:
        return None
    if (
        not isinstance(prediction, dict)
        or prediction.get("type") != "content"
        or set(prediction) - {"type", "content"}
    ):
        raise bad_request(
            f'prediction must be {{"type": "content", "content": ...}}, got {_short(prediction)}',
            param="prediction",
        )
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") == "text"
        and isinstance(p.get("text"), str)
        and set(p) == {"type", "text"}
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_request(
        'prediction.content must be a string or a list of {"type": "text", "text": ...} parts, got '
        f"{_short(content)}",
        param="prediction",
    )


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages -> [{"role": str, "content": str}]. Content may be a string, null, or a list of
    ``{"type": "text", "text": ...}`` parts (joined); other part types are refused."""
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            f"messages must be a non-empty list of {{role, content}} objects, got {_short(messages)}",
            param="messages",
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object, got {_short(m)}", param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(
                f"messages[{i}].role must be a non-empty string, got {_short(role)}", param="messages"
            )
        for key in m:
            if key not in ("role", "content", "name"):
                raise bad_request(f"messages[{i}].{key} is not supported by this server", param="messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise bad_request(
                        f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': "
                        f"...}}) are supported, got {_short(part)}",
                        param="messages",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad_request(
                f"messages[{i}].content must be a string or a list of text parts, got {_short(content)}",
                param="messages",
            )
        out.append({"role": role, "content": content})
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- sampling


_PARAM_FIELDS = (
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "logprobs",
    "prompt_logprobs",
    "n",
    "skip_special_tokens",
    "use_beam_search",
    "best_of",
    "length_penalty",
    "early_stopping",
)


def build_sampling_params(
    req: _Request, max_tokens: int | None, logprobs: int | None, rename: dict[str, str] | None = None
) -> SamplingParams:
    """SamplingParams of a request (OpenAI defaults for what it leaves out); a ValueError of
    SamplingParams becomes a 400 naming the request's field (``rename`` maps SamplingParams names to
    the request's, e.g. ``logprobs`` -> ``top_logprobs`` for chat)."""
    kwargs = {
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_k": 0 if req.top_k is None else req.top_k,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "presence_penalty": 0.0 if req.presence_penalty is None else req.presence_penalty,
        "frequency_penalty": 0.0 if req.frequency_penalty is None else req.frequency_penalty,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": req.prompt_logprobs,
        "n": req.n,
        "skip_special_tokens": req.skip_special_tokens,
        "prediction": parse_prediction(req.prediction),
        "guided_decoding": parse_guided(req),
        "use_beam_search": req.use_beam_search,
        "best_of": req.best_of,
        "length_penalty": req.length_penalty,
        "early_stopping": req.early_stopping,
    }
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        field = next((f for f in _PARAM_FIELDS if message.startswith(f + " ")), None)
        if field is not None and rename and field in rename:
            message = rename[field] + message[len(field) :]
            field = rename[field]
        raise bad_request(message, param=field) from None


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """The top-N of a chat request (``logprobs`` bool + ``top_logprobs``), checked."""
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.top_logprobs < 0:  # the upper bound is the engine's max_logprobs (LLM checks it)
            raise bad_request(f"top_logprobs must be >= 0, got {req.top_logprobs}", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def validation_error_to_api_error(errors: list[dict]) -> APIError:
    """FastAPI/pydantic validation errors -> one 400 naming the first bad field."""
    if not errors:
        return bad_request("invalid request")
    err = errors[0]
    kind = err.get("type", "")
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error", "") if isinstance(err.get("ctx"), dict) else ""
        return bad_request(
            f"malformed JSON in the request body{': ' + detail if detail else ''}", code="invalid_json"
        )
    if not loc:
        if kind == "missing":
            return bad_request("the request body must be a JSON object (it is empty)")
        return bad_request(f"the request body must be a JSON object, got {_short(err.get('input'))}")
    param = ".".join(loc)
    msg = err.get("msg", "invalid value")
    if kind == "missing":
        return bad_request(f"{param} is required", param=param)
    if kind == "extra_forbidden":
        return bad_request(f"unrecognized field: {param}", param=param, code="unrecognized_parameter")
    return bad_request(f"{param}: {msg}, got {_short(err.get('input'))}", param=param)
