from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateTokensRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class GenerateTokensResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finish_reason", "stop_token_id", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    usage: _common_pb2.Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: EngineStats
    def __init__(self, stats: _Optional[_Union[EngineStats, _Mapping]] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("bounds", "cumulative_counts", "count", "sum")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    cumulative_counts: _containers.RepeatedScalarFieldContainer[int]
    count: int
    sum: float
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., cumulative_counts: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., sum: _Optional[float] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "address", "healthy", "num_blocks", "num_blocks_in_use", "num_cached_free_blocks", "num_running", "num_waiting", "num_steps", "mean_step_seconds", "mean_idle_seconds", "mean_forward_seconds", "mean_gap_seconds", "mean_prepare_seconds", "mean_no_work_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_NO_WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    healthy: bool
    num_blocks: int
    num_blocks_in_use: int
    num_cached_free_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    mean_step_seconds: float
    mean_idle_seconds: float
    mean_forward_seconds: float
    mean_gap_seconds: float
    mean_prepare_seconds: float
    mean_no_work_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., num_blocks_in_use: _Optional[int] = ..., num_cached_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_steps: _Optional[int] = ..., mean_step_seconds: _Optional[float] = ..., mean_idle_seconds: _Optional[float] = ..., mean_forward_seconds: _Optional[float] = ..., mean_gap_seconds: _Optional[float] = ..., mean_prepare_seconds: _Optional[float] = ..., mean_no_work_seconds: _Optional[float] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "requests_finished", "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds", "queue_time_seconds", "num_blocks_in_use", "workers", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
    class RequestsFinishedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    E2E_REQUEST_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    requests_finished: _containers.ScalarMap[str, int]
    time_to_first_token_seconds: Histogram
    inter_token_latency_seconds: Histogram
    e2e_request_latency_seconds: Histogram
    queue_time_seconds: Histogram
    num_blocks_in_use: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., requests_finished: _Optional[_Mapping[str, int]] = ..., time_to_first_token_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., inter_token_latency_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., e2e_request_latency_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., queue_time_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., num_blocks_in_use: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: EngineInfo
    def __init__(self, info: _Optional[_Union[EngineInfo, _Mapping]] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "eos_token_ids", "vocab_size", "block_size", "num_healthy_workers", "max_queued_requests", "stalled", "seconds_without_progress")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEALTHY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_WITHOUT_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    block_size: int
    num_healthy_workers: int
    max_queued_requests: int
    stalled: bool
    seconds_without_progress: float
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_healthy_workers: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., stalled: _Optional[bool] = ..., seconds_without_progress: _Optional[float] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "model", "num_blocks", "block_size", "dtype", "device", "max_model_len")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model: str
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    max_model_len: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("drained", "num_requests_moved")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    num_requests_moved: int
    def __init__(self, drained: _Optional[bool] = ..., num_requests_moved: _Optional[int] = ...) -> None: ...
