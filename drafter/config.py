"""DrafterServiceConfig: every setting of the drafter service, read once from the command line."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from tandem import args as shared
from tandem import speculative_flags
from tandem import internal_secret
from tandem.errors import ConfigError
from tandem.speculative.drafter import DrafterConfig
from tandem.speculative.head_kv import (DEFAULT_KV_TOKENS, HEAD_KV_SHARE_OF_FREE, HEAD_KV_SHARE_OF_TOTAL,
                                       head_kv_tokens)

log = logging.getLogger("drafter")
MAX_LANE_BUSY_POLL_MS = 1000.0  # the event loop (health, reloads, a new verifier's Hello) waits out a spin


@dataclass(frozen=True)
class DrafterServiceConfig:
    draft_model: str  # EAGLE-3 head folder
    target_model: str  # the target's folder: its embedding and config (validation)
    runtime: DrafterConfig
    host: str = "127.0.0.1"
    port: int = 50052
    otlp_endpoint: str | None = None
    graph_specs: tuple = ()  # SpecConfigs whose draft graphs are captured at start-up (GPU)
    # Between rounds on the round lane, spin this long waiting for the next Round before sleeping on the
    # socket (0: never spin). Costs a core while the verifier decodes; spares the thread's wake-up.
    # Off by default: spinning shortens the drafter's extend a little, but the pair's speed does not move
    # beyond the host's noise — not worth a core. 20 ms outlasts an 8B target's round.
    lane_busy_poll_ms: float = 0.0
    profile_rounds: int = 0  # trace this many rounds (after a warm-up) with the torch profiler; 0: off
    profile_dir: str | None = None  # where the trace goes (default: the working directory)
    # The internal plane's secret (tandem.internal_secret): Rounds and Reload need it when set. Unset is
    # allowed on a loopback address only (a developer's drafter); `tandem up` and compose always set it.
    internal_secret: str | None = None
    # Reload loads only folders below this one (realpath-checked); default: the starting head's parent.
    reload_root: str = ""
    metrics_port: int | None = None  # Prometheus endpoint (drafter/metrics.py); None = off
    # Exit (status 2) once a verifier that was connected has been gone this long with none connecting again, for a
    # supervisor to restart the drafter where the verifier now is (drafter/verifier_watch.py); None: wait forever
    exit_without_verifier_s: float | None = None

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        d = DrafterConfig
        # Its --model is the head (so no --model-path here: SGLang's --model-path is the target).
        speculative_flags.add_speculative(p, draft_names=("--model", *shared.DRAFT_MODEL_NAMES),
                               draft_help="EAGLE-3 draft folder (default: the embedded demo draft)")
        p.add_argument("--target-model", default=None, help="the target's folder (default: the embedded demo target)")
        shared.add(p, shared.DEVICE)
        p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page of the head's cache")
        p.add_argument("--max-kv-tokens", type=int, default=None,
                       help=f"the head's KV cache, in tokens (default: on a GPU, {HEAD_KV_SHARE_OF_TOTAL * 100:.0f}%% of its "
                       f"memory, at most {HEAD_KV_SHARE_OF_FREE * 100:.0f}%% of what is free at start, at least "
                       f"{DEFAULT_KV_TOKENS} where that fits, kept for reloads; on CPU {DEFAULT_KV_TOKENS}; the log "
                       "warns at the verifier's handshake where the verifier's holds more)")
        p.add_argument("--max-topk", type=int, default=d.max_topk, help="the largest --speculative-eagle-topk a "
                                                                        "request may ask for")
        shared.add(p, *shared.DRAFTER_ENGINE_FLAGS)
        p.add_argument("--host", default=cls.host,
                       help="address to bind (default: loopback; the verifier is on the same machine)")
        shared.add(p, shared.INTERNAL_SECRET_FILE, shared.METRICS_PORT, shared.LOG_LEVEL)
        p.add_argument("--reload-root", default=None, metavar="DIR",
                       help="Reload loads only EAGLE-3 folders below DIR (default: the parent folder of --model)")
        p.add_argument("--port", type=shared.port, default=cls.port, help="gRPC port")
        shared.add(p, shared.OTLP_ENDPOINT)
        p.add_argument("--profile-rounds", type=int, default=cls.profile_rounds,
                       help="trace this many rounds, after a warm-up of 32, with the torch profiler: a Chrome trace "
                            "in --profile-dir and the busiest host ops and kernels in the log (0: off)")
        p.add_argument("--profile-dir", default=None, help="folder for the --profile-rounds trace (default: .)")
        p.add_argument("--exit-without-verifier-s", type=float, default=None, metavar="S",
                       help="exit (status 2) when the verifier that was connected has been gone S seconds and none "
                            "connected again, for the supervisor to restart the drafter beside the verifier as it now "
                            "is (compose: the verifier's restarted container has new namespaces); default: wait")
        p.add_argument("--round-lane-busy-poll-ms", type=float, default=cls.lane_busy_poll_ms,
                       help="between rounds on the round lane, busy-poll this long for the next Round before "
                            "sleeping (uses a core; default 0: off)")

    @classmethod
    def from_args(cls, a: argparse.Namespace, draft_model: str, target_model: str) -> "DrafterServiceConfig":
        from tandem.speculative.chain_depth import chain_ladder
        from tandem.speculative.spec_config import SpecConfig

        speculative = speculative_flags.resolve_speculative(a, target_model)
        if a.max_kv_tokens is not None and a.max_kv_tokens < 1:
            raise ConfigError(f"--max-kv-tokens must be >= 1, got {a.max_kv_tokens}")
        device = shared.resolve_device(a.device)
        runtime = DrafterConfig(device=device, dtype=a.dtype, page_size=a.page_size,
                                max_kv_tokens=a.max_kv_tokens or _gpu_kv_tokens(draft_model, device, a.dtype),
                                max_topk=a.max_topk, disable_cuda_graph=a.disable_cuda_graph,
                                cuda_graph_max_bs=a.cuda_graph_max_bs, prefill_graph_tokens=a.prefill_graph_tokens,
                                prefill_graph_max_bs=a.prefill_graph_max_bs)
        if not 0 <= a.round_lane_busy_poll_ms <= MAX_LANE_BUSY_POLL_MS:  # a spin never ended blocks the event loop
            raise ConfigError(f"--round-lane-busy-poll-ms must be in [0, {MAX_LANE_BUSY_POLL_MS:g}], "
                              f"got {a.round_lane_busy_poll_ms}")
        if a.exit_without_verifier_s is not None and not a.exit_without_verifier_s > 0:
            raise ConfigError(f"--exit-without-verifier-s must be > 0, got {a.exit_without_verifier_s}")
        if a.profile_rounds < 0:
            raise ConfigError(f"--profile-rounds must be >= 0, got {a.profile_rounds}")
        spec = SpecConfig(speculative.num_steps, speculative.topk, speculative.num_draft_tokens)
        secret = internal_secret.load_for(a.internal_secret_file, a.host, "the drafter", "the verifier")
        reload_root = os.path.realpath(a.reload_root or os.path.dirname(os.path.abspath(draft_model)))
        return cls(draft_model=draft_model, target_model=target_model, runtime=runtime, host=a.host, port=a.port,
                   # (a verifier's policy may shorten the chain at batch: the shorter chains' graphs too)
                   otlp_endpoint=a.otlp_endpoint, graph_specs=chain_ladder(spec),
                   lane_busy_poll_ms=a.round_lane_busy_poll_ms,
                   profile_rounds=a.profile_rounds, profile_dir=a.profile_dir, internal_secret=secret,
                   reload_root=reload_root, metrics_port=a.metrics_port,
                   exit_without_verifier_s=a.exit_without_verifier_s)


def _gpu_kv_tokens(draft_model: str, device: str, dtype: str) -> int:
    """The head's KV cache where no size is given: DEFAULT_KV_TOKENS on CPU; on a GPU a share of its memory as it is
    at start, before the head loads (tandem.speculative.head_kv; `tandem up` starts the drafter before its verifier,
    which sizes its pool from what is left). Read once: a reload builds the new head's cache at the same size."""
    if not device.startswith("cuda"):
        return DEFAULT_KV_TOKENS
    import torch

    from tandem.configs.eagle3 import DraftConfig
    from tandem.models.loader import resolve_dtype

    head = DraftConfig.from_dir(draft_model)
    per_token = 2 * head.num_kv_heads * head.head_dim * resolve_dtype(dtype, head.dtype, torch.device(device)).itemsize
    free, total = torch.cuda.mem_get_info(torch.device(device))
    tokens = head_kv_tokens(per_token, free, total)
    if tokens < DEFAULT_KV_TOKENS:
        log.warning("the EAGLE-3 head's KV cache holds %d tokens (%.1f GiB free of %.1f on %s): requests past it "
                    "draft from rebuilt entries (--max-kv-tokens sets it)", tokens, free / 2**30, total / 2**30, device)
    return tokens
