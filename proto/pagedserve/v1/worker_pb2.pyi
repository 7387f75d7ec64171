from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepsRequest(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ...) -> None: ...

class StepsResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: StepResult
    def __init__(self, result: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("slot", "request_id", "token_ids", "prompt_len", "num_computed_tokens", "sampling", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    num_computed_tokens: int
    sampling: _common_pb2.SamplingParams
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, slot: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "finished_slots", "preempted_slots", "new_requests", "copy_src_blocks", "copy_dst_blocks", "slots", "num_scheduled_tokens", "num_new_blocks", "new_block_ids", "replaced_slots", "replaced_block_indices", "replaced_block_ids", "mask_slots", "token_masks", "draft_slots", "num_draft_tokens", "draft_token_ids", "num_draft_layers")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    finished_slots: _containers.RepeatedScalarFieldContainer[int]
    preempted_slots: _containers.RepeatedScalarFieldContainer[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    copy_src_blocks: _containers.RepeatedScalarFieldContainer[int]
    copy_dst_blocks: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    replaced_slots: _containers.RepeatedScalarFieldContainer[int]
    replaced_block_indices: _containers.RepeatedScalarFieldContainer[int]
    replaced_block_ids: _containers.RepeatedScalarFieldContainer[int]
    mask_slots: _containers.RepeatedScalarFieldContainer[int]
    token_masks: bytes
    draft_slots: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_layers: int
    def __init__(self, step_id: _Optional[int] = ..., finished_slots: _Optional[_Iterable[int]] = ..., preempted_slots: _Optional[_Iterable[int]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., copy_src_blocks: _Optional[_Iterable[int]] = ..., copy_dst_blocks: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., replaced_slots: _Optional[_Iterable[int]] = ..., replaced_block_indices: _Optional[_Iterable[int]] = ..., replaced_block_ids: _Optional[_Iterable[int]] = ..., mask_slots: _Optional[_Iterable[int]] = ..., token_masks: _Optional[bytes] = ..., draft_slots: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_draft_layers: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("slot", "start_position", "logprobs")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    start_position: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, slot: _Optional[int] = ..., start_position: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("idle_seconds", "prepare_seconds", "forward_seconds", "sample_seconds", "num_tokens", "gap_seconds")
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    idle_seconds: float
    prepare_seconds: float
    forward_seconds: float
    sample_seconds: float
    num_tokens: int
    gap_seconds: float
    def __init__(self, idle_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., sample_seconds: _Optional[float] = ..., num_tokens: _Optional[int] = ..., gap_seconds: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_slots", "sampled_token_ids", "sampled_logprobs", "sampled_ranks", "num_top_logprobs", "top_token_ids", "top_logprobs", "prompt_logprobs", "timings", "refused_slots", "refused_messages", "num_accepted_tokens", "draft_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_slots: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled_ranks: _containers.RepeatedScalarFieldContainer[int]
    num_top_logprobs: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    timings: StepTimings
    refused_slots: _containers.RepeatedScalarFieldContainer[int]
    refused_messages: _containers.RepeatedScalarFieldContainer[str]
    num_accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., sampled_slots: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., sampled_ranks: _Optional[_Iterable[int]] = ..., num_top_logprobs: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., refused_slots: _Optional[_Iterable[int]] = ..., refused_messages: _Optional[_Iterable[str]] = ..., num_accepted_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "num_blocks", "block_size", "dtype", "device", "max_model_len", "vocab_size", "num_layers", "num_kv_heads", "head_dim", "block_bytes", "eos_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_bytes: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
