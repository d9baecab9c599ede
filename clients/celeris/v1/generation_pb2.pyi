import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Remasking(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REMASKING_UNSPECIFIED: _ClassVar[Remasking]
    REMASKING_LOW_CONFIDENCE: _ClassVar[Remasking]
    REMASKING_RANDOM: _ClassVar[Remasking]
    REMASKING_MARGIN: _ClassVar[Remasking]
    REMASKING_ENTROPY: _ClassVar[Remasking]

class KvCache(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_UNSPECIFIED: _ClassVar[KvCache]
    KV_CACHE_NONE: _ClassVar[KvCache]
    KV_CACHE_PREFIX: _ClassVar[KvCache]
    KV_CACHE_DUAL: _ClassVar[KvCache]
    KV_CACHE_EXACT: _ClassVar[KvCache]

class FactorRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FACTOR_RULE_UNSPECIFIED: _ClassVar[FactorRule]
    FACTOR_RULE_FAST_DLLM: _ClassVar[FactorRule]
    FACTOR_RULE_PAPER: _ClassVar[FactorRule]

class DecodingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODING_MODE_UNSPECIFIED: _ClassVar[DecodingMode]
    DECODING_MODE_AR: _ClassVar[DecodingMode]
    DECODING_MODE_DIFFUSION: _ClassVar[DecodingMode]
    DECODING_MODE_LINEAR_SPEC: _ClassVar[DecodingMode]

class Schedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_UNSPECIFIED: _ClassVar[Schedule]
    SCHEDULE_LLADA: _ClassVar[Schedule]
    SCHEDULE_DREAM: _ClassVar[Schedule]

class StreamMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_MODE_UNSPECIFIED: _ClassVar[StreamMode]
    STREAM_MODE_EVERY_K_STEPS: _ClassVar[StreamMode]
    STREAM_MODE_BLOCK_COMPLETE: _ClassVar[StreamMode]
    STREAM_MODE_FINAL_ONLY: _ClassVar[StreamMode]

class SnapshotFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SNAPSHOT_FORMAT_UNSPECIFIED: _ClassVar[SnapshotFormat]
    SNAPSHOT_FORMAT_FULL: _ClassVar[SnapshotFormat]
    SNAPSHOT_FORMAT_DELTA: _ClassVar[SnapshotFormat]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class ToolChoiceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_MODE_UNSPECIFIED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NONE: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_AUTO: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_REQUIRED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_FUNCTION: _ClassVar[ToolChoiceMode]
REMASKING_UNSPECIFIED: Remasking
REMASKING_LOW_CONFIDENCE: Remasking
REMASKING_RANDOM: Remasking
REMASKING_MARGIN: Remasking
REMASKING_ENTROPY: Remasking
KV_CACHE_UNSPECIFIED: KvCache
KV_CACHE_NONE: KvCache
KV_CACHE_PREFIX: KvCache
KV_CACHE_DUAL: KvCache
KV_CACHE_EXACT: KvCache
FACTOR_RULE_UNSPECIFIED: FactorRule
FACTOR_RULE_FAST_DLLM: FactorRule
FACTOR_RULE_PAPER: FactorRule
DECODING_MODE_UNSPECIFIED: DecodingMode
DECODING_MODE_AR: DecodingMode
DECODING_MODE_DIFFUSION: DecodingMode
DECODING_MODE_LINEAR_SPEC: DecodingMode
SCHEDULE_UNSPECIFIED: Schedule
SCHEDULE_LLADA: Schedule
SCHEDULE_DREAM: Schedule
STREAM_MODE_UNSPECIFIED: StreamMode
STREAM_MODE_EVERY_K_STEPS: StreamMode
STREAM_MODE_BLOCK_COMPLETE: StreamMode
STREAM_MODE_FINAL_ONLY: StreamMode
SNAPSHOT_FORMAT_UNSPECIFIED: SnapshotFormat
SNAPSHOT_FORMAT_FULL: SnapshotFormat
SNAPSHOT_FORMAT_DELTA: SnapshotFormat
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode
TOOL_CHOICE_MODE_NONE: ToolChoiceMode
TOOL_CHOICE_MODE_AUTO: ToolChoiceMode
TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode
TOOL_CHOICE_MODE_FUNCTION: ToolChoiceMode

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoiceMode
    name: str
    def __init__(self, mode: _Optional[_Union[ToolChoiceMode, str]] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("mode", "every_k_steps", "format", "provisional")
    MODE_FIELD_NUMBER: _ClassVar[int]
    EVERY_K_STEPS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    mode: StreamMode
    every_k_steps: int
    format: SnapshotFormat
    provisional: bool
    def __init__(self, mode: _Optional[_Union[StreamMode, str]] = ..., every_k_steps: _Optional[int] = ..., format: _Optional[_Union[SnapshotFormat, str]] = ..., provisional: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "token_ids", "chat", "gen_length", "steps", "block_length", "temperature", "remasking", "threshold", "factor", "cfg_scale", "seed", "stream_options", "kv_cache", "factor_rule", "schedule", "eps", "top_k", "top_p", "min_p", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "stop", "n", "frequency_penalty", "presence_penalty", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold", "structured_output", "editing_threshold", "max_post_steps", "cache_salt", "tools", "tool_choice", "parallel_tool_calls", "decoding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    GEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REMASKING_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    FACTOR_RULE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_DENOISING_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_BOUND_FIELD_NUMBER: _ClassVar[int]
    T_MIN_FIELD_NUMBER: _ClassVar[int]
    T_MAX_FIELD_NUMBER: _ClassVar[int]
    STABILITY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EDITING_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_POST_STEPS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    token_ids: TokenIds
    chat: ChatMessages
    gen_length: int
    steps: int
    block_length: int
    temperature: float
    remasking: Remasking
    threshold: float
    factor: float
    cfg_scale: float
    seed: int
    stream_options: StreamOptions
    kv_cache: KvCache
    factor_rule: FactorRule
    schedule: Schedule
    eps: float
    top_k: int
    top_p: float
    min_p: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    n: int
    frequency_penalty: float
    presence_penalty: float
    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int
    confidence_threshold: float
    structured_output: StructuredOutput
    editing_threshold: float
    max_post_steps: int
    cache_salt: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    decoding: DecodingMode
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., gen_length: _Optional[int] = ..., steps: _Optional[int] = ..., block_length: _Optional[int] = ..., temperature: _Optional[float] = ..., remasking: _Optional[_Union[Remasking, str]] = ..., threshold: _Optional[float] = ..., factor: _Optional[float] = ..., cfg_scale: _Optional[float] = ..., seed: _Optional[int] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCache, str]] = ..., factor_rule: _Optional[_Union[FactorRule, str]] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., eps: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., n: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., max_denoising_steps: _Optional[int] = ..., entropy_bound: _Optional[float] = ..., t_min: _Optional[float] = ..., t_max: _Optional[float] = ..., stability_threshold: _Optional[int] = ..., confidence_threshold: _Optional[float] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., editing_threshold: _Optional[float] = ..., max_post_steps: _Optional[int] = ..., cache_salt: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., decoding: _Optional[_Union[DecodingMode, str]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: Choices
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., json_object: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("id", "text", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "masked", "committed_this_step", "confidence", "logprob", "top_logprobs", "piece", "final")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_THIS_STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    masked: bool
    committed_this_step: bool
    confidence: float
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    piece: str
    final: bool
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., masked: _Optional[bool] = ..., committed_this_step: _Optional[bool] = ..., confidence: _Optional[float] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., piece: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class TokenUpdate(_message.Message):
    __slots__ = ("position", "token")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    position: int
    token: Token
    def __init__(self, position: _Optional[int] = ..., token: _Optional[_Union[Token, _Mapping]] = ...) -> None: ...

class CanvasLayout(_message.Message):
    __slots__ = ("gen_length", "block_length", "num_blocks", "prompt_tokens", "mask_token_id", "mask_text", "revising")
    GEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MASK_TEXT_FIELD_NUMBER: _ClassVar[int]
    REVISING_FIELD_NUMBER: _ClassVar[int]
    gen_length: int
    block_length: int
    num_blocks: int
    prompt_tokens: int
    mask_token_id: int
    mask_text: str
    revising: bool
    def __init__(self, gen_length: _Optional[int] = ..., block_length: _Optional[int] = ..., num_blocks: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., mask_text: _Optional[str] = ..., revising: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "forward_passes", "cached_tokens", "verify_passes", "accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PASSES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    forward_passes: int
    cached_tokens: int
    verify_passes: int
    accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., forward_passes: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., verify_passes: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "step", "total_steps", "block_index", "num_blocks", "text", "tokens", "committed_positions", "committed_confidences", "done", "finish_reason", "seed", "usage", "elapsed", "kv_cache", "choice", "updates", "layout", "provisional", "format", "text_positions", "final_positions", "revising", "tool_calls", "reasoning", "content", "choice_probabilities")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TEXT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    FINAL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REVISING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step: int
    total_steps: int
    block_index: int
    num_blocks: int
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    committed_positions: _containers.RepeatedScalarFieldContainer[int]
    committed_confidences: _containers.RepeatedScalarFieldContainer[float]
    done: bool
    finish_reason: FinishReason
    seed: int
    usage: Usage
    elapsed: _duration_pb2.Duration
    kv_cache: KvCache
    choice: int
    updates: _containers.RepeatedCompositeFieldContainer[TokenUpdate]
    layout: CanvasLayout
    provisional: _containers.RepeatedCompositeFieldContainer[TokenUpdate]
    format: SnapshotFormat
    text_positions: int
    final_positions: int
    revising: bool
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning: str
    content: str
    choice_probabilities: _containers.RepeatedCompositeFieldContainer[ChoiceProbability]
    def __init__(self, request_id: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., block_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., committed_positions: _Optional[_Iterable[int]] = ..., committed_confidences: _Optional[_Iterable[float]] = ..., done: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., elapsed: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCache, str]] = ..., choice: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[TokenUpdate, _Mapping]]] = ..., layout: _Optional[_Union[CanvasLayout, _Mapping]] = ..., provisional: _Optional[_Iterable[_Union[TokenUpdate, _Mapping]]] = ..., format: _Optional[_Union[SnapshotFormat, str]] = ..., text_positions: _Optional[int] = ..., final_positions: _Optional[int] = ..., revising: _Optional[bool] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning: _Optional[str] = ..., content: _Optional[str] = ..., choice_probabilities: _Optional[_Iterable[_Union[ChoiceProbability, _Mapping]]] = ...) -> None: ...

class ChoiceProbability(_message.Message):
    __slots__ = ("option", "probability")
    OPTION_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    option: str
    probability: float
    def __init__(self, option: _Optional[str] = ..., probability: _Optional[float] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_prompt_tokens", "max_gen_length", "max_batch", "max_queue")
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_GEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    max_prompt_tokens: int
    max_gen_length: int
    max_batch: int
    max_queue: int
    def __init__(self, max_prompt_tokens: _Optional[int] = ..., max_gen_length: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_queue: _Optional[int] = ...) -> None: ...

class SamplingDefaults(_message.Message):
    __slots__ = ("gen_length", "steps", "block_length", "temperature", "remasking", "kv_cache", "schedule", "frequency_penalty", "presence_penalty", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold")
    GEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REMASKING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_DENOISING_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_BOUND_FIELD_NUMBER: _ClassVar[int]
    T_MIN_FIELD_NUMBER: _ClassVar[int]
    T_MAX_FIELD_NUMBER: _ClassVar[int]
    STABILITY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    gen_length: int
    steps: int
    block_length: int
    temperature: float
    remasking: Remasking
    kv_cache: KvCache
    schedule: Schedule
    frequency_penalty: float
    presence_penalty: float
    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int
    confidence_threshold: float
    def __init__(self, gen_length: _Optional[int] = ..., steps: _Optional[int] = ..., block_length: _Optional[int] = ..., temperature: _Optional[float] = ..., remasking: _Optional[_Union[Remasking, str]] = ..., kv_cache: _Optional[_Union[KvCache, str]] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., max_denoising_steps: _Optional[int] = ..., entropy_bound: _Optional[float] = ..., t_min: _Optional[float] = ..., t_max: _Optional[float] = ..., stability_threshold: _Optional[int] = ..., confidence_threshold: _Optional[float] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("name", "architecture", "parameter_count", "vocab_size", "mask_token_id", "eos_token_id", "limits", "defaults", "dtype", "device", "family", "token_editing", "decoding_modes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EDITING_FIELD_NUMBER: _ClassVar[int]
    DECODING_MODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    parameter_count: int
    vocab_size: int
    mask_token_id: int
    eos_token_id: int
    limits: Limits
    defaults: SamplingDefaults
    dtype: str
    device: str
    family: str
    token_editing: bool
    decoding_modes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., parameter_count: _Optional[int] = ..., vocab_size: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., defaults: _Optional[_Union[SamplingDefaults, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., family: _Optional[str] = ..., token_editing: _Optional[bool] = ..., decoding_modes: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "apply_chat_template")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    text: str
    apply_chat_template: bool
    def __init__(self, text: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids", "tokens")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...
