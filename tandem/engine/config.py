"""EngineConfig: every setting of the target engine, read once (from flags or code) and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import ConfigError
from tandem.prefill_shapes import PREFILL_GRAPH_MAX_BS, PREFILL_GRAPH_TOKENS


DEFAULT_DECODE_STEPS = 4
DEFAULT_SPEC_ROUNDS = 4
# --chunked-prefill-size: prompt tokens prefilled per engine step (SGLang's default on large GPUs); a prompt
# past what is left of it is prefilled in chunks over several steps, beside the decoding requests.
DEFAULT_CHUNKED_PREFILL_SIZE = 8192


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face model folder
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N" (rank r of a TP group uses GPU N + r)
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    tp_size: int = 1
    attention_backend: str = "auto"
    page_size: int = 16  # tokens per KV page
    kv_pages: int | None = None  # explicit pool size; None = sized from memory
    mem_fraction_static: float = 0.85  # GPU: fraction of total memory for weights + KV pool
    cpu_kv_tokens: int = 65536  # CPU: KV pool size in tokens when kv_pages is None
    max_running_requests: int = 256
    # --chunked-prefill-size: prompt tokens prefilled per step, cutting a long prompt into chunks so running
    # streams keep their pace; -1 (SGLang's "off"): prompts go whole, one past the budget alone (the budget
    # is then DEFAULT_CHUNKED_PREFILL_SIZE)
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    # --disable-prefix-caching turns it off: full KV pages of finished and preempted requests are kept,
    # shared by content with later prompts that start with the same tokens (tandem.prefix_cache)
    enable_prefix_caching: bool = True
    context_length: int | None = None  # --context-length: serve below the model's maximum; None = the model's
    capture_layers: tuple[int, ...] | None = None  # EAGLE-3 feature layers; None = the model's default
    page_shuffle_seed: int | None = None  # scatter page order (testing the paged layout)
    load_format: str = "safetensors"  # or "random": weights drawn on the device, only config.json read (benchmarks)
    disable_cuda_graph: bool = False  # --disable-cuda-graph: every forward eager (CPU runs always are)
    cuda_graph_max_bs: int = 64  # --cuda-graph-max-bs: largest captured batch (requests)
    cuda_graph_widths: tuple[int, ...] = (1,)  # tokens per request the graphs take: 1 (decode) and the verify width
    # --prefill-graph-tokens: prompt chunks up to this long, in batches of prompts alone, run on CUDA graphs (families
    # of widths 16, 32, ... this, each chunk padded to one; tandem.engine.prefill_graphs); 0 = every prefill eager
    # (the drafter's prompt extends are graphed at the same widths: DrafterConfig)
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS
    prefill_graph_max_bs: int = PREFILL_GRAPH_MAX_BS  # --prefill-graph-max-bs: most prompt chunks in one graphed prefill
    graph_decode_features: bool = False  # decode graphs also output EAGLE-3 features (traffic capture without a drafter)
    # The graphed paths' static buffers without capturing graphs (a replay runs the captured code eagerly): how the
    # CPU tests drive those paths, TP ranks included (the attention then needs TRITON_INTERPRET=1 on a CPU)
    static_graph_path: bool = False
    seed: int = 0  # seeds requests that do not bring their own seed
    # --decode-steps: plain decode steps queued back to back per engine step when no request speculates
    # and no prompt waits (tandem.engine.decode_ahead); 1 = read every token back before the next step.
    # None: DEFAULT_DECODE_STEPS with CUDA graphs (where the host's work is worth hiding), else 1.
    decode_steps: int | None = None
    # --spec-rounds: greedy chain rounds of an in-process drafter queued back to back per engine step
    # when nothing else needs the host between them (tandem.engine.rounds_ahead); 1 = one round per
    # step. None: DEFAULT_SPEC_ROUNDS with CUDA graphs, else 1.
    spec_rounds: int | None = None
    # --no-overlap-runs: read every run of decode steps or rounds back before queuing the next (by default the next run
    # is queued first, from the device's state, so the GPU does not wait at a run's boundary)
    overlap_runs: bool = True
    # --enable-mixed-chunk: prompts (or chunks) prefill in the same forward as the running requests' step. Apart (a
    # step of prompts alone, then a step of the running requests) keeps that step on its graphs and queued runs.
    # None: mixed without CUDA graphs (nothing to keep), apart with them.
    mixed_prefill: bool | None = None
    # --logprobs-mode (vLLM's): raw_logprobs, the log-softmax of the target's logits; processed_logprobs, the log of
    # the distribution the request samples from (penalties, min_tokens, temperature, min_p, top-k, top-p applied)
    logprobs_mode: str = "raw_logprobs"

    def decode_steps_with(self, graphed: bool) -> int:
        """The run of plain decode steps the engine queues (``decode_steps``' default resolved)."""
        return self.decode_steps or (DEFAULT_DECODE_STEPS if graphed else 1)

    def __post_init__(self) -> None:
        if self.decode_steps is not None and self.decode_steps < 1:
            raise ConfigError(f"--decode-steps must be >= 1, got {self.decode_steps}")
        if self.spec_rounds is not None and self.spec_rounds < 1:
            raise ConfigError(f"--spec-rounds must be >= 1, got {self.spec_rounds}")
        if self.chunked_prefill_size < 1 and self.chunked_prefill_size != -1:
            raise ConfigError(f"--chunked-prefill-size must be >= 1, or -1 (off), got {self.chunked_prefill_size}")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"--context-length must be >= 2, got {self.context_length}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got '{self.logprobs_mode}'")
        if self.prefill_graph_tokens < 0 or self.prefill_graph_max_bs < 1:
            raise ConfigError(f"--prefill-graph-tokens must be >= 0 (0: off) and --prefill-graph-max-bs >= 1, got "
                              f"{self.prefill_graph_tokens} and {self.prefill_graph_max_bs}")
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests (--max-num-seqs) must be >= 1, got {self.max_running_requests}")
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ConfigError(f"--kv-pages must be >= 1, got {self.kv_pages}")
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.page_size < 1:
            raise ConfigError(f"page size must be >= 1, got {self.page_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.load_format not in ("safetensors", "random"):
            raise ConfigError(f"load format must be safetensors or random, got '{self.load_format}'")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"--device must be cpu or cuda[:N], got '{self.device}'")

    def served_context(self, model_max: int) -> int:
        """The context this engine serves: --context-length, which may not pass the model's ``model_max``."""
        if self.context_length is None:
            return model_max
        if self.context_length > model_max:
            raise ConfigError(f"--context-length {self.context_length} exceeds the model's maximum context "
                              f"({model_max})")
        return self.context_length
