"""Paths that only a GPU deployment takes, each run here on the CPU the way serving builds it: the CPU suite's own
engines (torch graph attention, the CPU's fixed KV pools, copies that never wait) hid them."""

from __future__ import annotations

import os
import types

import pytest
import torch

triton = pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton graph backend: set TRITON_INTERPRET=1 on a CPU machine")
def test_a_dense_verify_wider_than_the_paged_kernels_mask_is_left_to_the_eager_path(tmp_path):
    """--speculative-eagle-topk 8 --speculative-num-draft-tokens 80 (or a chain of 64 steps) on a Llama target: the
    verifier's graphs take widths (1, 80). The CPU tests stand the target's graph attention in with torch
    (helpers.TorchGraphBackend), which has no width limit; on the GPU the graphs run tandem/kernels/paged_attention.py,
    whose tree mask is one 64-bit word a row, so capture raised and the verifier did not start. Widths past 64 must
    verify eagerly, as they already do for MLA."""
    from tandem.attention.graph_backend import TritonGraphBackend
    from tandem.engine.config import EngineConfig
    from tandem.engine.cuda_graph import TargetGraphRunner
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.model_runner import graph_widths
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    path = write_random_llama(tmp_path / "t", LlamaShape(vocab_size=300, hidden_size=64, intermediate_size=96,
                                                         num_layers=2, num_heads=4, num_kv_heads=2,
                                                         max_position_embeddings=256), seed=5)
    with LLMEngine(EngineConfig(model=str(path), page_size=4)) as eng:
        runner = eng.executor.runner
        runner.graph_backend = TritonGraphBackend()  # what ModelRunner gives a dense model's graphs
        graphs = TargetGraphRunner(runner, widths=graph_widths((1, 4, 80), latent=False), max_bs=1)
        graphs.run_statically()  # capture's warm-up: every member at its largest bucket
        assert 4 in graphs.families and 80 not in graphs.families


def _reqs():
    from tandem.sampling import SamplingParams

    params = [SamplingParams(max_new_tokens=8, logprobs=2), SamplingParams(max_new_tokens=8),
              SamplingParams(max_new_tokens=8, repetition_penalty=1.3, min_tokens=4, logprobs=1)]
    return [types.SimpleNamespace(rid=f"r{i}", params=p, prompt=[1, 2, 3], output=[4, 5]) for i, p in enumerate(params)]


def test_a_run_queued_behind_another_sends_its_host_lists_without_waiting_for_it(monkeypatch):
    """A run queued after one in flight (overlap, on by default) is built while the device still computes that one.
    ``torch.tensor(list, device=cuda)`` copies from pageable memory, which synchronises the stream: the host then
    waits for the whole run in flight before queuing the next (the device idles at every boundary), and with the
    drafter service a drafter that dies while queuing its half leaves the verifier's engine thread in that wait for
    ever (its deadline release, RemoteDraftSide.wait_drafted, is never reached). StepSampler uploads through pinned
    memory (tandem.staging.upload); RunLogprobs and RunRules must too. On the CPU the copy is what gives it away."""
    from tandem.engine.request_sampling import RunLogprobs
    from tandem.engine.run_rules import RunRules

    pageable, real = [], torch.tensor

    def spy(data, *args, **kwargs):
        if kwargs.get("device") is not None:
            pageable.append(kwargs["device"])
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy)
    reqs, dev = _reqs(), torch.device("cpu")
    first = RunRules.of(reqs, 4, dev, 16, [0])
    pageable.clear()  # (a fresh run's own history may be copied: nothing is in flight then)
    logprobs = RunLogprobs.of(reqs, 4, dev, 6)  # a chain run's (rounds 4, 6 nodes a round)
    rules = RunRules.of(reqs, 4, dev, 16, [0], after=first, queued=4)  # a decode run after another
    assert logprobs is not None and rules is not None
    assert logprobs.rows.tolist() == [0, 2] and rules.rows.tolist() == [2]
    assert not pageable, f"{len(pageable)} pageable host-to-device copies while a run may be in flight"


def test_the_in_process_heads_kv_cache_holds_what_the_targets_holds(pair):
    """On the GPU the target's KV pool is sized from memory (--mem-fraction-static: ~430K tokens for an 8B target on
    an H100) while the head's stays DrafterConfig's fixed 65536 tokens; the CPU tests give both 65536
    (EngineConfig.cpu_kv_tokens) or small explicit pools, so the head never runs out first there. Past 65536 tokens of
    running requests (64 requests of 1K tokens) the head's extend raises OutOfPagesError: ``tandem generate
    --draft-model`` crashes, the verifier's in-process head drops every request's speculation, the drafter service
    closes the connection and the rejoined requests overflow it again. ``kv_pages`` stands in for the GPU's sizing."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.speculative.spec_config import SpecConfig

    cfg = EngineConfig(model=str(pair.target_dir), page_size=4, kv_pages=40_000)  # 160K tokens, as a GPU sizes it
    with speculative_engine(cfg, str(pair.draft_dir), SpecConfig(3, 1, 4)) as eng:
        head = eng.proposer
        assert head.allocator.capacity_pages * head.cfg.page_size >= eng.allocator.capacity_pages * cfg.page_size


def test_a_drafter_service_sizes_its_heads_kv_cache_from_the_gpus_memory():
    """The drafter service's head held a fixed 65536 tokens on any GPU (64 requests of 1K tokens), while its verifier's
    pool holds hundreds of thousands: under load the head's entries went first and requests drafted from rebuilt
    ones. On a GPU it now takes 5 % of the memory, at most half of what is free, at least 65536 tokens where that fits
    (figures here by hand: an 80 GiB GPU, a 4 KiB-a-token head)."""
    from tandem.speculative.head_kv import head_kv_tokens

    gib = 2**30
    assert head_kv_tokens(4096, free=70 * gib, total=80 * gib) == 4 * gib // 4096  # 5 % of 80 GiB: ~1M tokens
    assert head_kv_tokens(4096, free=4 * gib, total=80 * gib) == 2 * gib // 4096  # restarted beside a verifier
    assert head_kv_tokens(4096, free=70 * gib, total=4 * gib) == 65536  # 5 % is less: the old size, which fits
    assert head_kv_tokens(4096, free=256 * 2**20, total=80 * gib) == 128 * 2**20 // 4096  # less than 65536 fit
    assert head_kv_tokens(4096, free=70 * gib) == 35 * gib // 4096  # in process: a share of what the target left


def test_a_head_on_cpu_keeps_the_default_kv_cache(pair):
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
    from tandem.speculative.head_kv import DEFAULT_KV_TOKENS

    head = Eagle3Drafter.from_dirs(str(pair.draft_dir), str(pair.target_dir), DrafterConfig(page_size=16))
    assert head.allocator.capacity_pages * 16 == DEFAULT_KV_TOKENS == 65536


def test_a_drafter_service_on_a_gpu_sizes_its_heads_cache_once_at_start(pair, monkeypatch):
    """The drafter service's flags: no --max-kv-tokens on a GPU reads the memory once, before the head loads, and the
    size is the runtime's, which a reload's new head takes too (sizing again beside a verifier that took the memory
    meanwhile would shrink it); on CPU the default; given, as given. The GPU's memory stood in for: 80 GiB, 70 free."""
    import torch

    from drafter.__main__ import build_parser
    from drafter.config import DrafterServiceConfig
    from tandem.configs.eagle3 import DraftConfig

    head = DraftConfig.from_dir(pair.draft_dir)
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def runtime(*flags):
        args = build_parser().parse_args(["--model", str(pair.draft_dir), "--target-model", str(pair.target_dir),
                                          *flags])
        return DrafterServiceConfig.from_args(args, str(pair.draft_dir), str(pair.target_dir)).runtime

    per_token = 2 * head.num_kv_heads * head.head_dim * 4  # float32 asked for
    assert runtime("--device", "cuda", "--dtype", "float32").max_kv_tokens == 4 * gib // per_token  # 5 % of 80 GiB
    assert runtime("--device", "cpu").max_kv_tokens == 65536
    assert runtime("--device", "cuda", "--max-kv-tokens", "1000").max_kv_tokens == 1000

