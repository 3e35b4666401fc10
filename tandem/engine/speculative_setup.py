"""One process, target and EAGLE-3 head together: the engine ``tandem generate --draft-model``, the
trainer's evaluation and the benchmarks build, configured the same way everywhere."""

from __future__ import annotations

import dataclasses
import logging

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.head_kv import DEFAULT_KV_TOKENS, head_kv_tokens
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.policy import SpeculationPolicy

log = logging.getLogger("tandem.engine")


def verify_widths(chains: tuple) -> tuple[int, ...]:
    """The target's graph widths for a drafter drafting ``chains`` (SpecConfigs): plain decode and each verify."""
    return (1, *sorted({chain.num_draft_tokens for chain in chains}))


def speculative_engine(cfg: EngineConfig, draft_dir: str, spec: SpecConfig, draft_dtype: str = "auto",
                       policy=None, max_topk: int = 8) -> LLMEngine:
    """Validate the head against the target, build the engine with the head's capture layers and verify graphs of
    the tree's width (and of each shorter chain the policy may draft), load the head sharing the target's embedding
    (TP=1, where rank 0 holds the whole vocabulary) and capture its draft, draft-extend and prompt-extend graphs (the
    prefill graphs' widths) in the target's pool."""
    from tandem.configs.model import ModelConfig
    from tandem.configs.eagle3 import DraftConfig, validate_draft

    head_cfg = DraftConfig.from_dir(draft_dir)
    capture = validate_draft(head_cfg, ModelConfig.from_dir(cfg.model), cfg.capture_layers)
    policy = policy or SpeculationPolicy()
    chains = policy.ladder(spec)
    engine = LLMEngine(dataclasses.replace(cfg, capture_layers=capture, cuda_graph_widths=verify_widths(chains)),
                       policy=policy)
    runner = engine.executor.runner
    embed = runner.model.model.embed_tokens.weight if cfg.tp_size == 1 else None
    # The head's KV holds every running request's entries plus a round's reach past them: as many tokens as the
    # target's pool (sized from GPU memory there, not the fixed default), one layer of the head's KV a token.
    reach = max(max((c.num_steps - 1) * c.topk, c.num_steps + 1) for c in chains) + cfg.prefill_graph_tokens
    draft_tokens = max(DEFAULT_KV_TOKENS,
                       engine.allocator.capacity_pages * cfg.page_size + cfg.max_running_requests * reach)
    if runner.device.type == "cuda":  # the target's sizing left nothing for it by name: a share of what it left free
        from tandem.models.loader import resolve_dtype

        head_dtype = resolve_dtype(draft_dtype, head_cfg.dtype, runner.device)  # (as Eagle3Drafter resolves it)
        per_token = 2 * head_cfg.num_kv_heads * head_cfg.head_dim * head_dtype.itemsize
        room = head_kv_tokens(per_token, torch.cuda.mem_get_info(runner.device)[0])
        if draft_tokens > room:
            log.warning("the EAGLE-3 head's KV cache holds %d tokens, not the target's %d: the GPU memory left "
                        "(lower --mem-fraction-static for more)", room, draft_tokens)
            draft_tokens = room
    try:
        drafter = Eagle3Drafter.from_dirs(draft_dir, cfg.model, DrafterConfig(
            device=str(runner.device), dtype=draft_dtype, max_topk=max(max_topk, spec.topk), max_kv_tokens=draft_tokens,
            disable_cuda_graph=cfg.disable_cuda_graph, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            prefill_graph_tokens=cfg.prefill_graph_tokens, prefill_graph_max_bs=cfg.prefill_graph_max_bs,
            defer_chain_tokens=cfg.tp_size == 1),
            capture_layers=capture, embed_weight=embed)
        if runner.graphs is not None:
            drafter.capture_cuda_graphs(list(chains), static=cfg.static_graph_path, pool=runner.graphs.pool)
    except BaseException:
        engine.shutdown()  # the target's TP ranks and memory go with the failed head
        raise
    engine.proposer, engine.default_spec = drafter, spec
    return engine
