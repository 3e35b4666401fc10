"""Command-line flags that several Tandem CLIs share, defined once: ``tandem up``, ``tandem generate``,
``python -m verifier`` and ``python -m drafter`` (the gateway takes the model alias). SGLang's and vLLM's
spellings are aliases of ours where they mean the same thing (``--model-path``, ``--tensor-parallel-size``
/ ``--tp`` / ``-tp``, ``--speculative-draft-model-path``, ``--max-num-seqs``, ``--enforce-eager``,
``--disable-radix-cache``, ``--random-seed``, ``--dtype half``), switches that ask for what Tandem does anyway
are accepted (``--enable-prefix-caching``, ``--enable-chunked-prefill``, ``--trust-remote-code``: no remote code
is ever run). The speculative flags, in every spelling, live in tandem.speculative_flags.

Torch-free: ``--device auto`` is decided by ``resolve_device`` in the process that runs the model.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem import internal_secret
from tandem.engine.config import LOGPROBS_MODES, EngineConfig
from tandem.errors import ConfigError

log = logging.getLogger("tandem")

DEFAULT_DEVICE = "auto"


@dataclass(frozen=True)
class Flag:
    """One flag: its names (ours first, then the aliases) and its add_argument options."""
    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.names[0].lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.options.get("default")

    def add(self, p: argparse.ArgumentParser, **override: Any) -> None:
        p.add_argument(*self.names, **{**self.options, **override})

    def argv(self, args: argparse.Namespace) -> list[str]:
        """The flag in our spelling as given in ``args``; nothing when it holds its default."""
        value = getattr(args, self.dest)
        if value == self.options.get("default") or value is None:
            return []
        if self.options.get("action") == "store_true":
            return [self.names[0]] if value else []
        return [self.names[0], str(value)]


e = EngineConfig
MODEL = Flag(("--model", "--model-path"), dict(default=None, help="target model: a folder (Hugging Face format) or "
                                                                   "a Hugging Face id resolved through its cache "
                                                                   "(default: the embedded demo target)"))
REVISION = Flag(("--revision",), dict(default=None, help="the target's revision, with a Hugging Face id (default: main)"))
DRAFT_MODEL_NAMES = ("--draft-model", "--speculative-draft-model-path")
API_KEY_ENV = "TANDEM_API_KEY"  # the gateway's API key where --api-key is not given (tandem up passes its own so)
NO_DRAFT = "none"  # --draft-model none: no draft (tandem up: not the demo's head; the verifier: target-only)


def ranks(value: str) -> int:
    """A tensor-parallel size: refused below 1 as the command line is read (tandem up: before any service starts)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of ranks: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


TP_SIZE = Flag(("--tp-size", "--tensor-parallel-size", "--tp", "-tp"),
               dict(type=ranks, default=e.tp_size, help="tensor-parallel ranks (one process per rank)"))
DEVICE = Flag(("--device",), dict(default=DEFAULT_DEVICE, help="auto (cuda when torch sees a GPU, else cpu), cpu, "
                                                                "cuda or cuda:N"))
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}


def _dtype(value: str) -> str:
    return DTYPE_ALIASES.get(value.lower(), value.lower())


def port(value: str) -> int:
    """A TCP port, 0 (any free one) to 65535: a larger number is refused, not wrapped to another port by bind."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a port (0 to 65535)")
    return number


TOKEN_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _tokens(value: str) -> int:
    """A token count as vLLM's --max-model-len takes it: 4096; 32k = 32000 and 25.6k (decimal suffixes k, m, g);
    32K = 32768 (binary suffixes K, M, G, whole numbers only)."""
    value = value.strip()
    scale = TOKEN_SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if scale > 1 else value
    try:
        return int(float(number) * scale) if scale > 1 and value[-1].islower() else int(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {value!r} (e.g. 4096, 32k = 32000, 32K = 32768)") from None


DTYPE = Flag(("--dtype",), dict(default=e.dtype, type=_dtype, choices=["auto", "bfloat16", "float16", "float32"],
                                help="weights and activations (also half, bf16, float); auto: the checkpoint's dtype "
                                     "on GPU, float32 on CPU"))
MEM_FRACTION = Flag(("--mem-fraction-static", "--gpu-memory-utilization"), dict(type=float, default=e.mem_fraction_static,
                                                     help="GPU: fraction of the device's memory for weights + KV"))
KV_PAGES = Flag(("--kv-pages",), dict(type=int, default=None,
                                      help="KV pool size in pages, page 0 reserved (default: from "
                                           f"--mem-fraction-static on GPU, {e.cpu_kv_tokens} tokens on CPU)"))
MAX_TOTAL_TOKENS = Flag(("--max-total-tokens",), dict(
    type=_tokens, default=None, metavar="TOKENS", help="KV pool size in tokens (SGLang's flag): --kv-pages of it, "
                                                       "rounded up to whole pages (page 0 reserved)"))
MAX_RUNNING = Flag(("--max-running-requests", "--max-num-seqs"),
                   dict(type=int, default=e.max_running_requests, help="requests in the running batch at most"))
DISABLE_GRAPH = Flag(("--disable-cuda-graph", "--enforce-eager"),
                     dict(action="store_true", help="run every forward eagerly (no CUDA graphs)"))
GRAPH_MAX_BS = Flag(("--cuda-graph-max-bs",), dict(type=int, default=e.cuda_graph_max_bs,
                                                   help="largest batch (requests) captured as a CUDA graph"))
PREFILL_GRAPH_TOKENS = Flag(("--prefill-graph-tokens",), dict(
    type=int, default=e.prefill_graph_tokens, help="prompt chunks up to this many tokens, in steps of prompts alone, "
                                                   "run on CUDA graphs (each padded to a width 16, 32, ... this); "
                                                   "0: prefill eagerly"))
PREFILL_GRAPH_MAX_BS = Flag(("--prefill-graph-max-bs",), dict(
    type=int, default=e.prefill_graph_max_bs, help="most prompt chunks in one graphed prefill step"))
DECODE_STEPS = Flag(("--decode-steps",), dict(
    type=int, default=None, help="plain decode steps queued back to back while no request speculates and no prompt "
                                 "waits; their tokens stream together (default: 4 with CUDA graphs, else 1; one "
                                 "step at a time with --capture-traffic, or --tp-size > 1 without CUDA graphs)"))
SPEC_ROUNDS = Flag(("--spec-rounds",), dict(
    type=int, default=None, help="greedy chain rounds queued back to back while no prompt waits, with the head in "
                                 "process or (on one GPU rank) in the drafter service; their tokens stream together "
                                 "(default: 4 with CUDA graphs, else 1; one round at a time with --capture-traffic)"))
NO_OVERLAP = Flag(("--no-overlap-runs",), dict(
    action="store_true", help="read each run of --decode-steps or --spec-rounds back before queuing the next "
                              "(default: the next run is queued first, from the device's state)"))
CHUNKED_PREFILL = Flag(("--chunked-prefill-size", "--max-num-batched-tokens"), dict(
    type=int, default=e.chunked_prefill_size, help="prompt tokens prefilled per step: a longer prompt is prefilled in "
                                                   "chunks beside the decoding requests; -1: prompts go whole"))
MIXED_CHUNK = Flag(("--enable-mixed-chunk",), dict(
    action="store_true", help="prefill prompts in the same forward as the running requests' step (default: in a step "
                              "of their own with CUDA graphs, so the running requests' steps stay graphed)"))
DISABLE_PREFIX_CACHING = Flag(("--disable-prefix-caching", "--disable-radix-cache", "--no-enable-prefix-caching"), dict(
    action="store_true", help="prefill every prompt from its first token (default: a prompt starts on the KV "
                              "pages of earlier requests that began with the same tokens)"))
LOGPROBS_MODE = Flag(("--logprobs-mode",), dict(
    default=e.logprobs_mode, choices=LOGPROBS_MODES,
    help="what logprobs report, as vLLM's flag: raw_logprobs, the target's log-softmax; processed_logprobs, after "
         "penalties, min_tokens, temperature, min_p, top-k and top-p (what the request samples from)"))
CONTEXT_LENGTH = Flag(("--context-length", "--max-model-len"), dict(
    type=_tokens, default=None, help="tokens a request may reach (prompt + output), at most the model's maximum "
                                 "(default: the model's)"))
SEED = Flag(("--seed", "--random-seed"), dict(type=int, default=None,
                                            help=f"seeds the requests that bring no seed of their own (default: {e.seed})"))
ATTENTION_BACKENDS = {"auto": "auto", "flashinfer": "flashinfer", "triton": "triton", "torch": "torch",
                      "torch_native": "torch"}  # (SGLang's name for the reference)
ATTENTION_BACKEND = Flag(("--attention-backend",), dict(
    default=e.attention_backend, type=lambda v: ATTENTION_BACKENDS.get(v.lower(), v), choices=sorted(set(ATTENTION_BACKENDS.values())),
    help="eager attention: auto (FlashInfer on a GPU where installed, else the torch reference; MLA: the Triton latent "
         "kernel), flashinfer, triton or torch (SGLang's torch_native); a name with no path for the model is taken as "
         "auto; CUDA graphs always run Tandem's Triton kernels"))
# Switches of SGLang / vLLM that ask for what Tandem does anyway: taken, so their command lines run here.
ENABLE_PREFIX_CACHING = Flag(("--enable-prefix-caching",), dict(
    action="store_true", help="vLLM's switch; prefix caching is on unless --disable-prefix-caching"))
ENABLE_CHUNKED_PREFILL = Flag(("--enable-chunked-prefill",), dict(
    action="store_true", help="vLLM's switch; long prompts are always prefilled in chunks (--chunked-prefill-size)"))
TRUST_REMOTE_CODE = Flag(("--trust-remote-code",), dict(
    action="store_true", help="taken for vLLM / SGLang command lines; Tandem runs only its own model code"))
QUANTIZATION = Flag(("--quantization", "-q"), dict(
    default=None, help="as vLLM / SGLang name it (fp8, compressed-tensors): checked against the checkpoint's "
                       "quantization_config, which is what Tandem reads (default: whatever the checkpoint holds)"))


def _kv_cache_dtype(value: str) -> str:
    if value.lower() != "auto":
        quantized = value.lower().startswith(("fp8", "int8", "fp4"))
        raise argparse.ArgumentTypeError(f"{value!r}: the KV cache always keeps the model's dtype: give auto"
                                         + ("; quantized KV caches are not supported" if quantized else ""))
    return "auto"


KV_CACHE_DTYPE = Flag(("--kv-cache-dtype",), dict(default="auto", type=_kv_cache_dtype,
                                                  help="auto: the model's dtype (the only one Tandem keeps)"))
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every process's lines, tandem up's own too
LOG_LEVEL = Flag(("--log-level",), dict(default="info", type=str.lower, choices=LOG_LEVELS, help="log threshold"))
# The gateway's admission and logging flags: python -m gateway takes them, tandem up passes them on.
MAX_TOKENS_LIMIT = Flag(("--max-tokens-limit",), dict(
    type=int, default=None, help="largest max_tokens accepted (default: only the model's context bounds it)"))
MAX_BODY_BYTES = Flag(("--max-body-bytes",), dict(type=int, default=4 << 20, help="largest request body (413 above)"))
MAX_CONNECTIONS_PER_ADDRESS = Flag(("--max-connections-per-address",), dict(
    type=int, default=1024, help="open REST connections one client (its IPv4 address or IPv6 /64) may hold (more: "
                                 "429 and closed); 0: no limit. Behind a proxy every client shares the proxy's "
                                 "address: raise it there"))
MAX_CONCURRENT = Flag(("--max-concurrent-requests",), dict(
    type=int, default=256, help="generations in flight, REST and gRPC together (above: REST requests queue, "
                                "--max-queue-wait-s; gRPC calls are refused)"))
MAX_QUEUE_WAIT = Flag(("--max-queue-wait-s",), dict(
    type=float, default=600.0, help="how long a REST request waits in line for its generations at capacity before "
                                    "a 429 (0: refused at once)"))
GENERATION_CONFIG = Flag(("--generation-config",), dict(
    default="auto", help="sampling defaults for requests that leave them unset (temperature, top_p, top_k, min_p, "
                         "repetition_penalty; chat's max_tokens from max_new_tokens), as vLLM: auto = the model "
                         "folder's generation_config.json, vllm = none, or a folder holding one"))
LOG_REQUESTS = Flag(("--log-requests", "--enable-log-requests"), dict(
    action="store_true", help="log a line per finished generation (tokens, finish reason, latencies, accept length)"))
LOG_REQUESTS_LEVEL = Flag(("--log-requests-level",), dict(
    type=int, default=0, choices=[0, 1, 2],
    help="with --log-requests: 0 the numbers, 1 also sampling settings, 2 also prompt and output text"))
# Longer than clients keep idle connections (httpx, the OpenAI client: 5 s; uvicorn's own default is 5 s too): with
# equal timeouts a client reuses a connection at the moment the server closes it, and its request is reset.
TIMEOUT_KEEP_ALIVE = Flag(("--timeout-keep-alive",), dict(
    type=float, default=75.0, help="seconds an idle HTTP keep-alive connection stays open (longer than clients' "
                                   "pools keep theirs, or a reused connection can be reset); the public gRPC port "
                                   "closes a connection without calls after as long"))
CHAT_TEMPLATE = Flag(("--chat-template",), dict(
    default=None, metavar="FILE_OR_TEMPLATE", help="the chat template, as vLLM takes it (a Jinja file, or the template "
                                                  "itself), instead of the model folder's (default: the folder's)"))
DISABLE_LOG_REQUESTS = Flag(("--disable-log-requests",), dict(
    action="store_true", help="vLLM's switch; requests are logged only with --log-requests"))
DISABLE_ACCESS_LOG = Flag(("--disable-uvicorn-access-log",), dict(
    action="store_true", help="no line per HTTP request (uvicorn's access log: method, path, status, refusals included)"))
ENABLE_METRICS = Flag(("--enable-metrics",), dict(
    action="store_true", help="SGLang's switch; the gateway always serves Prometheus metrics at /metrics"))


def _normal(value):
    """A flag's value as compared with a no-op one: numbers by value (``01``, ``1.0``), words case-blind."""
    if not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        return value.lower()


def _refused(why: str, takes_value: bool | str = True, no_op: str | None = None) -> type[argparse.Action]:
    """An argparse action that stops with ``why`` (a peer's flag for something Tandem does not do: said, not an
    "unrecognized arguments"); ``takes_value``: True (one), False (none) or an argparse nargs ("+"); ``no_op``: the
    value that asks for nothing (``--ep-size 1``, a peer's default), taken."""

    class Refused(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            nargs = takes_value if isinstance(takes_value, str) else (None if takes_value else 0)
            super().__init__(option_strings, dest, nargs=nargs, default=None, help=kwargs.get("help"))

        def __call__(self, parser, namespace, values, option_string=None):
            if no_op is None or _normal(values) != _normal(no_op):
                parser.error(f"{option_string}: {why}")

    return Refused


# what the gateway reads out of a chat answer's text (gateway/tool_calls.py, gateway/reasoning.py)
TOOL_CALL_PARSERS = ("kimi_k2", "deepseek_v3", "deepseekv3", "deepseek_v31", "deepseekv31", "hermes", "qwen25", "qwen",
                     "llama3_json", "llama3", "llama4_json")
REASONING_PARSERS = ("deepseek_r1", "deepseek-r1", "qwen3", "kimi_k2", "deepseek_v3", "deepseek-v3")
TOOL_CALL_PARSER = Flag(("--tool-call-parser",), dict(
    default=None, choices=TOOL_CALL_PARSERS, metavar="NAME",
    help=f"read tool calls out of chat answers written in this model family's markup ({', '.join(TOOL_CALL_PARSERS)}): "
         "requests with tools and tool_choice auto get tool_calls (vLLM / SGLang flag)"))
AUTO_TOOL_CHOICE = Flag(("--enable-auto-tool-choice",), dict(
    action="store_true", help="vLLM's switch, taken: --tool-call-parser alone answers tool_choice auto (as SGLang)"))
REASONING_PARSER = Flag(("--reasoning-parser",), dict(
    default=None, choices=REASONING_PARSERS, metavar="NAME",
    help=f"split chat answers' <think> reasoning into reasoning_content ({', '.join(REASONING_PARSERS)}; vLLM / SGLang "
         "flag)"))
_NO_EXPERT_PARALLEL = ("expert parallelism is not supported: with --tp N every rank holds a 1/N slice of every expert "
                       "(the experts' intermediate dimension is split)")
EXPERT_PARALLEL = Flag(("--enable-expert-parallel", "--enable-ep-moe"), dict(
    action=_refused(_NO_EXPERT_PARALLEL, takes_value=False), help="refused: no expert parallelism (vLLM / SGLang flag)"))
EP_SIZE = Flag(("--ep-size", "--expert-parallel-size"), dict(action=_refused(_NO_EXPERT_PARALLEL, no_op="1"),
                                                             help="refused past 1: no expert parallelism (SGLang flag)"))
# The multi-host and multi-replica layouts of SGLang and vLLM: a stack is one host, one replica
_ONE_REPLICA = ("data parallelism is not built in: run one stack per replica behind a load balancer (each gateway's "
                "/health says when it can take work)")
DATA_PARALLEL = Flag(("--dp-size", "--dp", "--data-parallel-size"), dict(
    action=_refused(_ONE_REPLICA, no_op="1"), help="refused past 1: one replica a stack (SGLang / vLLM flag)"))
DP_ATTENTION = Flag(("--enable-dp-attention",), dict(
    action=_refused("data-parallel attention is not supported: MLA's heads are split across the --tp ranks, each "
                    "holding the whole latent cache", takes_value=False), help="refused (SGLang flag)"))
_ONE_HOST = "one host only: --tp splits the model across the GPUs of one machine (up to 8)"
NNODES = Flag(("--nnodes",), dict(action=_refused(_ONE_HOST, no_op="1"), help="refused past 1 (SGLang / vLLM flag)"))
NODE_RANK = Flag(("--node-rank",), dict(action=_refused(_ONE_HOST, no_op="0"), help="refused past 0 (SGLang flag)"))
DIST_INIT = Flag(("--dist-init-addr",), dict(action=_refused(_ONE_HOST), help="refused (SGLang flag)"))
PIPELINE_PARALLEL = Flag(("--pp-size", "--pipeline-parallel-size"), dict(
    action=_refused("pipeline parallelism is not supported: " + _ONE_HOST.split(": ")[1], no_op="1"),
    help="refused past 1 (SGLang / vLLM flag)"))
_OWN_MOE = ("Tandem runs its own fused MoE kernels (no backend to choose) and places no experts (every rank holds a "
            "slice of each): nothing to balance")
MOE_BACKEND = Flag(("--moe-runner-backend",), dict(action=_refused(_OWN_MOE, no_op="auto"),
                                                   help="refused past auto (SGLang flag)"))
EPLB = Flag(("--enable-eplb",), dict(action=_refused(_OWN_MOE, takes_value=False), help="refused (SGLang / vLLM flag)"))
TOKENIZER = Flag(("--tokenizer", "--tokenizer-path"), dict(
    default=None, metavar="PATH", help="taken where it names the model folder, whose tokenizer is used; refused "
                                       "otherwise (vLLM / SGLang flag)"))
GRAPH_BATCH_SIZES = Flag(("--cuda-graph-bs",), dict(
    action=_refused("the graphs' batch sizes are 1 to 8, every 8 to 64, then every 16 up to --cuda-graph-max-bs: give "
                    "that",
                    takes_value="+"), help="refused: give --cuda-graph-max-bs (SGLang flag)"))
TORCH_COMPILE = Flag(("--enable-torch-compile",), dict(
    action="store_true", help="SGLang's switch, taken: serving runs CUDA graphs of Tandem's own kernels"))
PEER_LAYOUT_FLAGS = (DATA_PARALLEL, DP_ATTENTION, NNODES, NODE_RANK, DIST_INIT, PIPELINE_PARALLEL, MOE_BACKEND, EPLB,
                     TOKENIZER, GRAPH_BATCH_SIZES, TORCH_COMPILE)
API_SERVER_COUNT = Flag(("--api-server-count",), dict(
    action=_refused("one gateway process a stack serves the API (one event loop: REST, gRPC, metrics); for more, run "
                    "more stacks behind a load balancer", no_op="1"), help="refused past 1 (vLLM flag)"))
GATEWAY_FLAGS = (MAX_TOKENS_LIMIT, MAX_BODY_BYTES, MAX_CONNECTIONS_PER_ADDRESS, MAX_CONCURRENT, MAX_QUEUE_WAIT,
                 GENERATION_CONFIG,
                 LOG_REQUESTS, LOG_REQUESTS_LEVEL, TIMEOUT_KEEP_ALIVE, CHAT_TEMPLATE, DISABLE_LOG_REQUESTS,
                 DISABLE_ACCESS_LOG, ENABLE_METRICS, TOOL_CALL_PARSER, AUTO_TOOL_CHOICE, REASONING_PARSER, API_SERVER_COUNT)
METRICS_PORT = Flag(("--metrics-port",), dict(type=port, default=None, help="serve Prometheus metrics on this port "
                                                                         "(default: off)"))
INTERNAL_SECRET_FILE = Flag(("--internal-secret-file",), dict(
    default=None, metavar="FILE", help=f"the internal plane's shared secret (the drafter's Rounds and Reload, the "
                                       f"verifier's Generate), from FILE instead of ${internal_secret.ENV}"))
OTLP_ENDPOINT = Flag(("--otlp-endpoint",), dict(
    default=None, metavar="URL", help="OTLP collector for traces, over gRPC (OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf: "
                                      "over HTTP); default: $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else off"))
# The target engine's flags: tandem generate and the verifier take them, tandem up passes them to the verifier.
ENGINE_FLAGS = (DTYPE, MEM_FRACTION, KV_PAGES, MAX_TOTAL_TOKENS, MAX_RUNNING, DISABLE_GRAPH, GRAPH_MAX_BS, PREFILL_GRAPH_TOKENS,
                PREFILL_GRAPH_MAX_BS, DECODE_STEPS, SPEC_ROUNDS,
                NO_OVERLAP, CHUNKED_PREFILL, MIXED_CHUNK, DISABLE_PREFIX_CACHING, CONTEXT_LENGTH, LOGPROBS_MODE, SEED,
                ATTENTION_BACKEND, ENABLE_PREFIX_CACHING, ENABLE_CHUNKED_PREFILL, TRUST_REMOTE_CODE, QUANTIZATION,
                KV_CACHE_DTYPE, EXPERT_PARALLEL, EP_SIZE, *PEER_LAYOUT_FLAGS)
# The drafter service takes these of them too (its own graphs and dtype; its prompt extends' graphs take the prefill
# graphs' widths).
DRAFTER_ENGINE_FLAGS = (DTYPE, DISABLE_GRAPH, GRAPH_MAX_BS, PREFILL_GRAPH_TOKENS, PREFILL_GRAPH_MAX_BS)

CONFIG = Flag(("--config",), dict(
    default=None, metavar="FILE", help="flags from a YAML or JSON file, as vLLM's --config: keys are flag names "
                                       "(model, tp-size or tp_size, ...), values their values; the command line wins"))


def add(p: argparse.ArgumentParser, *flags: Flag) -> None:
    for flag in flags:
        flag.add(p)


def engine_settings(a: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's fields that ENGINE_FLAGS set (tandem generate and the verifier), from parsed flags."""
    return dict(dtype=a.dtype, mem_fraction_static=a.mem_fraction_static, kv_pages=_kv_pages(a),
                max_running_requests=a.max_running_requests, disable_cuda_graph=a.disable_cuda_graph,
                cuda_graph_max_bs=a.cuda_graph_max_bs, prefill_graph_tokens=a.prefill_graph_tokens,
                prefill_graph_max_bs=a.prefill_graph_max_bs, decode_steps=a.decode_steps, spec_rounds=a.spec_rounds,
                overlap_runs=not a.no_overlap_runs, chunked_prefill_size=a.chunked_prefill_size,
                context_length=a.context_length, mixed_prefill=a.enable_mixed_chunk or None,
                logprobs_mode=a.logprobs_mode, enable_prefix_caching=not a.disable_prefix_caching,
                attention_backend=a.attention_backend, **({} if a.seed is None else {"seed": a.seed}))


def _kv_pages(a: argparse.Namespace) -> int | None:
    """--kv-pages, or SGLang's --max-total-tokens in whole pages of --page-size (the engine's default where a CLI has
    no --page-size)."""
    tokens = getattr(a, "max_total_tokens", None)
    if tokens is None:
        return a.kv_pages
    if a.kv_pages is not None:
        raise ConfigError("--kv-pages and --max-total-tokens both size the KV pool: give one")
    if tokens < 1:
        raise ConfigError(f"--max-total-tokens must be at least 1, got {tokens}")
    page = getattr(a, "page_size", None) or e.page_size
    return -(-tokens // page)


def resolve_device(device: str) -> str:
    """``auto``: cuda when torch sees a GPU, else cpu, said in the log; other values as given — a GPU asked of a torch
    that sees none refused in one line (not torch's AttributeError deep in the first CUDA call)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ConfigError(f"--device {device}: torch {torch.__version__} sees no GPU ({build}); use --device cpu or auto")
    if device != "auto":
        return device

    picked = "cuda" if torch.cuda.is_available() else "cpu"
    log.info("--device auto: %s (%s)", picked,
             f"torch sees {torch.cuda.device_count()} GPU(s)" if picked == "cuda" else "torch sees no GPU")
    return picked


def resolve_target(args: argparse.Namespace) -> str | None:
    """The target folder ``--model`` (with ``--revision``) names, or None when none is given (the demo's)."""
    if getattr(args, "trust_remote_code", False):
        log.info("--trust-remote-code: taken; Tandem runs its own code for the architectures it knows, never a "
                 "checkpoint's")
    if args.model is None:
        _check_tokenizer(getattr(args, "tokenizer", None), None, None)
        return None
    from tandem.model_source import resolve_model

    model = resolve_model(args.model, getattr(args, "revision", None))
    _check_tokenizer(getattr(args, "tokenizer", None), args.model, model)
    check_quantization(getattr(args, "quantization", None), model)
    return model


def _check_tokenizer(tokenizer: str | None, given: str | None, model: str | None) -> None:
    """``--tokenizer`` as peers' launch scripts pass it (the model's own path again) is taken; another tokenizer is
    refused: the gateway detokenizes with the model folder's."""
    if tokenizer is None or tokenizer == given:
        return
    try:
        if model is not None and Path(tokenizer).resolve() == Path(model).resolve():
            return
    except OSError:
        pass
    where = f"the model folder's ({model})" if model else "the model folder's (give --model)"
    raise ConfigError(f"--tokenizer {tokenizer}: the tokenizer is {where}; a separate tokenizer is not supported")


def check_quantization(asked: str | None, model: str) -> None:
    """``--quantization``, where given, must name what the checkpoint's quantization_config holds: Tandem reads that
    (a flag cannot quantize a checkpoint here, nor load one as another method)."""
    if asked is None:
        return
    from tandem.configs.quantization import find_quantization_config

    try:
        raw = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # (the model's loader says what is wrong with its config)
    held = (find_quantization_config(raw) or {}).get("quant_method")
    name = asked.lower().replace("_", "-")  # (compressed_tensors and compressed-tensors alike)
    if name != (held or "none"):
        raise ConfigError(f"--quantization {asked}: the checkpoint's quantization_config says "
                          f"{held or 'none (not quantized)'}; Tandem loads what the checkpoint holds (leave the flag out)")


def served_name(model_dir: str, served_model_name: str | None) -> str:
    """The model's name to clients and in metrics: --served-model-name, else the Hugging Face id of a cache
    snapshot, else the folder's name (never its path, which is the server's business)."""
    from tandem.model_source import hub_id

    return served_model_name or hub_id(model_dir) or Path(model_dir).resolve().name
