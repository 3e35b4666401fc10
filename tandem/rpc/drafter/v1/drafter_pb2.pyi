from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RingSpec(_message.Message):
    __slots__ = ("kind", "name", "num_rows", "row_width", "dtype", "owner_pid", "cuda_ipc_handle", "gpu_uuid")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    num_rows: int
    row_width: int
    dtype: str
    owner_pid: int
    cuda_ipc_handle: bytes
    gpu_uuid: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., num_rows: _Optional[int] = ..., row_width: _Optional[int] = ..., dtype: _Optional[str] = ..., owner_pid: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model", "hidden_size", "vocab_size", "num_layers", "capture_layers", "kv_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    kv_tokens: int
    def __init__(self, model: _Optional[str] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., capture_layers: _Optional[_Iterable[int]] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "ring", "target", "round_lane", "round_lane_token", "mailbox")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ROUND_LANE_FIELD_NUMBER: _ClassVar[int]
    ROUND_LANE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAILBOX_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    ring: RingSpec
    target: TargetInfo
    round_lane: str
    round_lane_token: bytes
    mailbox: RoundMailbox
    def __init__(self, protocol_version: _Optional[int] = ..., ring: _Optional[_Union[RingSpec, _Mapping]] = ..., target: _Optional[_Union[TargetInfo, _Mapping]] = ..., round_lane: _Optional[str] = ..., round_lane_token: _Optional[bytes] = ..., mailbox: _Optional[_Union[RoundMailbox, _Mapping]] = ...) -> None: ...

class RoundMailbox(_message.Message):
    __slots__ = ("storage", "flags", "max_batch", "max_draft_tokens")
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    storage: RingSpec
    flags: str
    max_batch: int
    max_draft_tokens: int
    def __init__(self, storage: _Optional[_Union[RingSpec, _Mapping]] = ..., flags: _Optional[str] = ..., max_batch: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("protocol_version", "draft_model", "draft_vocab_size", "round_lane", "chain_runs")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUND_LANE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_RUNS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    draft_model: str
    draft_vocab_size: int
    round_lane: bool
    chain_runs: bool
    def __init__(self, protocol_version: _Optional[int] = ..., draft_model: _Optional[str] = ..., draft_vocab_size: _Optional[int] = ..., round_lane: _Optional[bool] = ..., chain_runs: _Optional[bool] = ...) -> None: ...

class SpecParams(_message.Message):
    __slots__ = ("num_steps", "topk", "num_draft_tokens")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    topk: int
    num_draft_tokens: int
    def __init__(self, num_steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class Extend(_message.Message):
    __slots__ = ("request_id", "token_ids", "ring_offset", "ring_rows", "prefix", "release_after")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RING_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    RELEASE_AFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ring_offset: int
    ring_rows: int
    prefix: PrefixStart
    release_after: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., ring_offset: _Optional[int] = ..., ring_rows: _Optional[int] = ..., prefix: _Optional[_Union[PrefixStart, _Mapping]] = ..., release_after: _Optional[bool] = ...) -> None: ...

class PrefixStart(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("request_id", "spec", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    spec: SpecParams
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., spec: _Optional[_Union[SpecParams, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ChainRun(_message.Message):
    __slots__ = ("first_round", "rounds", "request_ids", "spec", "continues")
    FIRST_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    first_round: int
    rounds: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    spec: SpecParams
    continues: bool
    def __init__(self, first_round: _Optional[int] = ..., rounds: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., spec: _Optional[_Union[SpecParams, _Mapping]] = ..., continues: _Optional[bool] = ...) -> None: ...

class Round(_message.Message):
    __slots__ = ("seq", "release", "extend", "draft", "chain_run")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_RUN_FIELD_NUMBER: _ClassVar[int]
    seq: int
    release: _containers.RepeatedScalarFieldContainer[str]
    extend: _containers.RepeatedCompositeFieldContainer[Extend]
    draft: _containers.RepeatedCompositeFieldContainer[DraftRequest]
    chain_run: ChainRun
    def __init__(self, seq: _Optional[int] = ..., release: _Optional[_Iterable[str]] = ..., extend: _Optional[_Iterable[_Union[Extend, _Mapping]]] = ..., draft: _Optional[_Iterable[_Union[DraftRequest, _Mapping]]] = ..., chain_run: _Optional[_Union[ChainRun, _Mapping]] = ...) -> None: ...

class Drafts(_message.Message):
    __slots__ = ("seq", "draft_seconds", "extend_seconds", "tree_sizes", "tree_tokens", "tree_parents", "tree_scores", "chain_run_refused", "chain_run_fits")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZES_FIELD_NUMBER: _ClassVar[int]
    TREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    TREE_SCORES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_RUN_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CHAIN_RUN_FITS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    draft_seconds: float
    extend_seconds: float
    tree_sizes: _containers.RepeatedScalarFieldContainer[int]
    tree_tokens: _containers.RepeatedScalarFieldContainer[int]
    tree_parents: _containers.RepeatedScalarFieldContainer[int]
    tree_scores: _containers.RepeatedScalarFieldContainer[float]
    chain_run_refused: str
    chain_run_fits: int
    def __init__(self, seq: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., extend_seconds: _Optional[float] = ..., tree_sizes: _Optional[_Iterable[int]] = ..., tree_tokens: _Optional[_Iterable[int]] = ..., tree_parents: _Optional[_Iterable[int]] = ..., tree_scores: _Optional[_Iterable[float]] = ..., chain_run_refused: _Optional[str] = ..., chain_run_fits: _Optional[int] = ...) -> None: ...

class VerifierMessage(_message.Message):
    __slots__ = ("hello", "round")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    round: Round
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., round: _Optional[_Union[Round, _Mapping]] = ...) -> None: ...

class DrafterMessage(_message.Message):
    __slots__ = ("welcome", "drafts")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    drafts: Drafts
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., drafts: _Optional[_Union[Drafts, _Mapping]] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("draft_model",)
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    draft_model: str
    def __init__(self, draft_model: _Optional[str] = ...) -> None: ...

class ReloadReply(_message.Message):
    __slots__ = ("draft_model", "generation", "requests_on_previous", "load_seconds")
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ON_PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    draft_model: str
    generation: int
    requests_on_previous: int
    load_seconds: float
    def __init__(self, draft_model: _Optional[str] = ..., generation: _Optional[int] = ..., requests_on_previous: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...
