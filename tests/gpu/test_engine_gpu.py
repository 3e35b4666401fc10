"""On the GPU: greedy outputs with CUDA graphs equal outputs without graphs and equal the torch
attention backend's, for target-only and speculative decoding, at several batch sizes.

float32 makes the paths agree to rounding, so greedy tokens must be identical; a bf16 run checks the
graphed path end to end against the eager one on its first tokens (bf16 near-ties may legitimately
flip later tokens between kernels).
"""

from __future__ import annotations


import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    shape = LlamaShape(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=6, num_heads=8,
                       num_kv_heads=2, max_position_embeddings=1024)
    return write_random_llama(tmp_path_factory.mktemp("gpu") / "t", shape, dtype="float32", seed=3, std=0.05)


def prompts(n):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 4096, (int(l),), generator=g).tolist() for l in torch.randint(3, 90, (n,), generator=g)]


def run(target, batch, dtype="float32", graphs=True, backend="auto", proposer_rate=None, spec=None, new=40,
        decode_steps=None, params=None, spec_rounds=None, accepted=None, policy=None):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams
    from proposers import always_speculate

    from tandem.speculative.chain_depth import chain_ladder

    chains = chain_ladder(spec) if policy is not None and spec is not None else (spec,)  # a policy may shorten it
    widths = (1,) if spec is None else (1, *(c.num_draft_tokens for c in chains))
    cfg = EngineConfig(model=str(target), device="cuda", dtype=dtype, disable_cuda_graph=not graphs,
                       cuda_graph_max_bs=16, cuda_graph_widths=widths, attention_backend=backend, page_size=16,
                       kv_pages=2048, decode_steps=decode_steps, spec_rounds=spec_rounds)
    # Counting accepted drafts per round compares runs round for round: no timing-driven policy then.
    policy = policy or (always_speculate() if accepted is not None else None)
    with LLMEngine(cfg, policy=policy) as eng:
        params = params or SamplingParams(max_new_tokens=new, ignore_eos=True)
        if spec is None:
            return [r.output_token_ids for r in eng.generate(batch, params)]
        from tandem.speculative.controlled import ControlledAcceptanceProposer
        from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
        from tandem.configs.model import ModelConfig
        from tandem.models.eagle3_checkpoint import write_random_eagle3

        reference = [r.output_token_ids for r in eng.generate(batch, SamplingParams(max_new_tokens=new + 16,
                                                                                      ignore_eos=True), spec=None)]
        runner = eng.executor.runner
        draft_dir = target.parent / "draft"
        if not (draft_dir / "config.json").exists():
            write_random_eagle3(draft_dir, ModelConfig.from_dir(target), draft_vocab_size=1024, seed=1,
                                aux_layer_ids=tuple(k - 1 for k in runner.capture_layers))
        # With graphs, the drafter's graphs too, and (chains) their tokens left on the device for the verify.
        drafter = Eagle3Drafter.from_dirs(str(draft_dir), str(target), DrafterConfig(
            device="cuda", dtype=dtype, disable_cuda_graph=not graphs, cuda_graph_max_bs=16, defer_chain_tokens=True),
            capture_layers=runner.capture_layers, embed_weight=runner.model.model.embed_tokens.weight)
        if graphs:
            drafter.capture_cuda_graphs(list(chains), pool=runner.graphs.pool)
        proposer = ControlledAcceptanceProposer(drafter, proposer_rate, seed=2)
        eng.proposer, eng.default_spec = proposer, spec
        rids = [eng.add_request(p, params) for p in batch]
        for rid, p, ref in zip(rids, batch, reference):
            proposer.set_reference(rid, len(p), ref)
        while eng.has_unfinished():
            eng.step()
        outs = [eng.requests.pop(r) for r in rids]
        assert all(o.spec_stats.rounds > 0 for o in outs)
        if graphs:
            assert drafter.graphs.replays["draft"] > 0 and drafter.graphs.replays["draft_extend"] > 0
        assert [o.output for o in outs] == [ref[:new] for ref in reference], "speculative != target-only"
        if accepted is not None:  # the caller wants each request's accepted drafts per round
            accepted.extend(o.spec_stats.accepted_per_round for o in outs)
        return [o.output for o in outs]


@pytest.mark.parametrize("bs", [1, 3, 8, 13])
def test_target_only_graphs_equal_eager_equal_torch_backend(target, bs):
    batch = prompts(bs)
    graphed = run(target, batch, graphs=True)
    eager = run(target, batch, graphs=False)
    torch_ref = run(target, batch, graphs=False, backend="torch")
    assert graphed == eager == torch_ref


@pytest.mark.parametrize("bs", [1, 6])
def test_decode_ahead_on_graphs_equals_one_step_decoding_bf16(target, bs):
    """bf16 (the Triton GEMVs and programmatic dependent launch in the graphs): eight decode steps
    queued per engine step give the tokens of one step at a time, greedy and seeded-sampled."""
    from tandem.sampling import SamplingParams

    batch = prompts(bs)
    assert run(target, batch, dtype="bfloat16", decode_steps=8) == run(target, batch, dtype="bfloat16", decode_steps=1)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=40, ignore_eos=True)
    assert (run(target, batch, dtype="bfloat16", decode_steps=8, params=sampled)
            == run(target, batch, dtype="bfloat16", decode_steps=1, params=sampled))


def test_eager_bf16_forwards_repeat_exactly_with_and_without_pdl(target):
    """Eager bf16 forwards (the Triton GEMVs and kernels launched one by one, with programmatic
    dependent launch, between FlashInfer's and torch's kernels) give the same greedy tokens every time,
    and the same as with plain launches: a kernel that read its input early would make runs differ."""
    from tandem.kernels.pdl import set_pdl

    batch = prompts(3)
    first = run(target, batch, dtype="bfloat16", graphs=False, new=24)
    assert run(target, batch, dtype="bfloat16", graphs=False, new=24) == first
    set_pdl(False)
    try:
        assert run(target, batch, dtype="bfloat16", graphs=False, new=24) == first
    finally:
        set_pdl(True)


@pytest.mark.parametrize("bs", [1, 5])
@pytest.mark.parametrize("steps,topk,ndt", [(4, 1, 5), (3, 2, 6)])
def test_speculative_graphs_equal_eager(target, bs, steps, topk, ndt):
    from tandem.speculative.spec_config import SpecConfig

    spec = SpecConfig(steps, topk, ndt)
    batch = prompts(bs)
    graphed = run(target, batch, graphs=True, proposer_rate=0.3, spec=spec)
    eager = run(target, batch, graphs=False, proposer_rate=0.3, spec=spec)
    assert graphed == eager == run(target, batch, graphs=False)


def test_overlapped_chain_runs_are_committed_while_the_next_run_computes(target, monkeypatch):
    """Batch 1, chain runs of 4 rounds, every draft accepted: each step that reads a run back and
    commits it (tokens, drafter state) returns before the run queued after it has finished on the
    device (its end delayed there by the test). Committing once indexed the drafter's snapshot with a
    Python list, a pageable host-to-device copy that waited for that run: the device then idled at
    every run boundary."""
    import tandem.engine.rounds_ahead as rounds_ahead
    from tandem.speculative.spec_config import SpecConfig

    queue, read_back = rounds_ahead.queue_chain_rounds, rounds_ahead._read_back
    following_done: list[torch.cuda.Event] = []
    still_running: list[bool] = []

    def queue_and_mark(graphs, drafter, reqs, spec, rounds, steer=None, after=None, *rest):
        run = queue(graphs, drafter, reqs, spec, rounds, steer, after, *rest)
        if after is not None:  # a tiny model's rounds are shorter than the host's work between them
            torch.cuda._sleep(50_000_000)
            following_done.append(torch.cuda.Event())
            following_done[-1].record()
        return run

    def read_back_and_check(*args, **kwargs):
        outputs = read_back(*args, **kwargs)
        if following_done:
            still_running.append(not following_done.pop().query())
        return outputs

    torch.cuda._sleep(1000)  # loaded once first: a first launch may wait for the device
    torch.cuda.synchronize()
    monkeypatch.setattr(rounds_ahead, "queue_chain_rounds", queue_and_mark)
    monkeypatch.setattr(rounds_ahead, "_read_back", read_back_and_check)
    accepted: list = []  # (asks run() for a fixed policy: a timed one turns slowed rounds off)
    run(target, prompts(1), graphs=True, proposer_rate=0.0, spec=SpecConfig(3, 1, 4), spec_rounds=4, new=80,
        accepted=accepted)
    assert len(still_running) >= 3 and all(still_running), still_running


@pytest.mark.parametrize("bs", [1, 6])
def test_chain_rounds_queued_on_the_device_equal_one_round_steps(target, bs, monkeypatch):
    """--spec-rounds 4 (greedy chains; acceptance, inputs and the drafter's extend decided on the
    device between graph replays) emits target-only greedy tokens and accepts, round for round, what
    one round per step accepts; runs after the first are queued before the run they follow is read back
    (overlapped runs, going on from the device's state)."""
    import tandem.engine.rounds_ahead as rounds_ahead
    from tandem.speculative.spec_config import SpecConfig

    runs, real = [], rounds_ahead.queue_chain_rounds
    monkeypatch.setattr(rounds_ahead, "queue_chain_rounds", lambda *a: runs.append((a[4], a[6] is not None)) or real(*a))
    ahead, read_back = [], rounds_ahead._read_back  # (what each step says of its run: the stats line's overlapped)

    def read_and_note(engine, *rest, **kw):
        outputs = read_back(engine, *rest, **kw)
        ahead.append(engine.last_step.queued_ahead)
        return outputs

    monkeypatch.setattr(rounds_ahead, "_read_back", read_and_note)
    spec, batch = SpecConfig(3, 1, 4), prompts(bs)
    queued, one_round = [], []
    run(target, batch, graphs=True, proposer_rate=0.3, spec=spec, spec_rounds=4, accepted=queued)
    assert runs and max(rounds for rounds, _ in runs) > 1
    assert sum(following for _, following in runs) >= 2  # overlapped runs
    # each run read back says whether it was queued behind another (a run whose requests all ended is read unsaid)
    assert 2 <= sum(ahead) <= sum(following for _, following in runs) and not all(ahead)
    runs.clear()
    run(target, batch, graphs=True, proposer_rate=0.3, spec=spec, spec_rounds=1, accepted=one_round)
    assert not runs
    assert queued == one_round


@pytest.mark.parametrize("spec_rounds", [1, 4])
def test_chains_the_policy_shortens_between_steps_stay_target_greedy(target, spec_rounds, monkeypatch):
    """Graphs for every chain (verify widths 2-4, draft graphs of 1-3 steps); a policy switching the chain decision
    by decision, one round per step or runs of four queued on the device: each chain runs graphed and the tokens are
    target-only greedy (run() compares them)."""
    import tandem.engine.rounds_ahead as rounds_ahead
    from proposers import CyclingChains
    from tandem.speculative.spec_config import SpecConfig

    widths, real = [], rounds_ahead.queue_chain_rounds
    monkeypatch.setattr(rounds_ahead, "queue_chain_rounds", lambda *a: widths.append(a[3].num_draft_tokens) or real(*a))
    run(target, prompts(6), graphs=True, proposer_rate=0.3, spec=SpecConfig(3, 1, 4), spec_rounds=spec_rounds,
        new=60, policy=CyclingChains())
    if spec_rounds > 1:
        assert set(widths) == {2, 3, 4}


def test_bf16_graphed_decode_logits_match_eager(target):
    """bf16: the graphed decode step's logits equal the eager step's within bf16 rounding (greedy tokens
    may differ on near-ties between two correct kernels, so compare logits, not tokens)."""
    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.kv_cache import SequenceKV

    cfg = EngineConfig(model=str(target), device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, kv_pages=512)
    with LLMEngine(cfg) as eng:
        runner = eng.executor.runner
        chunks = []
        for p in prompts(5):
            kv = SequenceKV(eng.allocator)
            kv.reserve(len(p) + 1)
            runner.forward(ForwardBatch([SequenceChunk(p, 0, list(kv.pages))]))
            chunks.append(SequenceChunk([17], len(p), list(kv.pages)))
        batch = ForwardBatch(chunks)
        assert runner.graphs.can_run(batch)
        graphed, _ = runner.graphs.run(batch)
        graphs, runner.graphs = runner.graphs, None
        eager, _ = runner.forward(batch)
        runner.graphs = graphs
    # Element-wise bf16 tolerances fail on near-zero logits; the norm of the difference is the measure
    # (eager rotates in bf16 torch ops, the graph in float32 inside one kernel: 6 layers of such rounding).
    rel = ((graphed - eager).norm() / eager.norm()).item()
    assert rel < 3e-2, f"graphed vs eager bf16 logits: relative error {rel:.3g}"
    assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.6


def test_capture_logs_time_and_memory(target, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="tandem.cuda_graph")
    run(target, prompts(1), graphs=True, new=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Capture decode cuda graph end.")]
    assert lines and "Time elapsed:" in lines[0] and "mem usage=" in lines[0] and "avail mem=" in lines[0]


def test_a_second_start_replays_the_products_the_first_capture_recorded(target, tmp_path, monkeypatch):
    """tandem/matmul_warm.py in an engine: the first start (no file) records its capture's cuBLAS products, the second
    replays every one of them while its weights load, and serves the same tokens."""
    import json

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    cfg = EngineConfig(model=str(target), device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, page_size=16,
                       kv_pages=512)
    params, outputs = SamplingParams(max_new_tokens=8, ignore_eos=True), []
    for start in range(2):
        with LLMEngine(cfg) as eng:
            warm = eng.executor.runner.matmul_warm
            if start == 0:
                (path,) = (tmp_path / "matmul-shapes").glob("*.json")
                entries = json.loads(path.read_text())
                assert entries and warm.thread is None
            else:
                assert warm.ran == len(entries)
            outputs.append([r.output_token_ids for r in eng.generate(prompts(4), params)])
    assert outputs[0] == outputs[1]


def _greedy_with_arrivals(target, graphs: bool) -> list[list[int]]:
    """float32 greedy: two prompts, then two more at each of steps 3 and 6 while they decode (steps of prompts
    apart, on the prefill graphs when ``graphs``)."""
    from helpers import generate_with_arrivals
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    batch, params = prompts(6), SamplingParams(max_new_tokens=24, ignore_eos=True)
    cfg = EngineConfig(model=str(target), device="cuda", dtype="float32", disable_cuda_graph=not graphs,
                       cuda_graph_max_bs=16, page_size=16, kv_pages=2048, decode_steps=1)
    with LLMEngine(cfg) as eng:
        return generate_with_arrivals(eng, batch, params)[1]


def test_prefill_graphs_greedy_equals_eager(target, monkeypatch):
    """Prompts arriving while others decode are prefilled on the prefill graph families (captured for real):
    greedy output identical to --disable-cuda-graph's in float32, and the prefill graphs were replayed."""
    from tandem.engine.cuda_graph import TargetGraphRunner

    launched = []
    launch = TargetGraphRunner._launch
    monkeypatch.setattr(TargetGraphRunner, "_launch", lambda self, member, bs: launched.append(member) or
                        launch(self, member, bs))
    graphed = _greedy_with_arrivals(target, True)
    assert sum(isinstance(m, tuple) for m in launched) >= 3, launched  # the first prompts, then each arrival pair
    assert graphed == _greedy_with_arrivals(target, False)


def test_timing_prefill_step_of_8_prompts_graphed_vs_eager(tmp_path):
    """Not a check (run with -s): one prefill step of 8 prompts of 100 tokens on a Llama-3-8B-shaped random
    target in bf16, replayed on the prefill graphs vs run eagerly; and what capturing the prefill families cost."""
    import dataclasses
    import json
    import time

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.kv_cache import SequenceKV
    from tandem.models.random_checkpoint import LLAMA_8B, hf_config

    shape = dataclasses.replace(LLAMA_8B, max_position_embeddings=4096)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(shape, "bfloat16")))
    cfg = EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", load_format="random", kv_pages=1024,
                       cuda_graph_max_bs=16)
    with LLMEngine(cfg) as eng:
        runner = eng.executor.runner
        for name, (seconds, gb) in runner.graph_report.items():
            print(f"capture {name}: {seconds:.2f} s, {gb:.2f} GB")
        g = torch.Generator().manual_seed(0)
        chunks = []
        for _ in range(8):
            kv = SequenceKV(eng.allocator)
            kv.reserve(100)
            chunks.append(SequenceChunk(torch.randint(0, 128000, (100,), generator=g).tolist(), 0, list(kv.pages)))
        batch = ForwardBatch(chunks)
        assert runner.graphs.can_run(batch)

        def per_step_ms(reps=20):
            for _ in range(3):
                runner.forward(batch)
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(reps):
                runner.forward(batch)
            torch.cuda.synchronize()
            return (time.perf_counter() - started) / reps * 1e3

        graphed = per_step_ms()
        graphs, runner.graphs = runner.graphs, None
        eager = per_step_ms()
        runner.graphs = graphs
    print(f"prefill step, 8 prompts x 100 tokens, 8B-shaped bf16: graphed {graphed:.2f} ms, eager {eager:.2f} ms")


def test_after_the_warm_up_no_request_mix_compiles_a_kernel(target, tmp_path):
    """Ready means ready (issue 19): the warm-up (tandem.engine.warmup) runs what requests run, so that after it a mix
    of requests — batch sizes between the warm-up's, the policy's chains switched between runs, prompts arriving while
    others speculate, sampled requests — compiles no Triton kernel (tandem.kernels.compile_watch logs any that is)."""
    from proposers import CyclingChains
    from tandem.configs.model import ModelConfig
    from tandem.engine.config import EngineConfig
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.engine.warmup import warm_up
    from tandem.kernels import compile_watch
    from tandem.models.eagle3_checkpoint import write_random_eagle3
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig

    cfg = EngineConfig(model=str(target), device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, page_size=16,
                       kv_pages=2048)
    write_random_eagle3(tmp_path / "draft", ModelConfig.from_dir(target), draft_vocab_size=1024, seed=1,
                        aux_layer_ids=(1, 2, 3))
    with speculative_engine(cfg, str(tmp_path / "draft"), SpecConfig(3, 1, 4)) as eng:
        warm_up(eng)
        assert compile_watch.watch_compiles()
        before = len(compile_watch.compiled_while_serving)
        eng.policy = CyclingChains()  # every decision another chain: each switch between runs at each batch size
        greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, ignore_eos=True)
        for n in (1, 3, 5, 11, 16):
            eng.generate(prompts(n), greedy)
        rids = [eng.add_request(p, greedy) for p in prompts(6)]
        for _ in range(3):
            eng.step()
        rids += [eng.add_request(p, sampled) for p in prompts(4)]  # arriving while the others speculate
        while eng.has_unfinished():
            eng.step()
        compiled = compile_watch.compiled_while_serving[before:]
        assert not compiled, compiled


@pytest.mark.parametrize("twins", [True, False])
def test_plain_steps_on_the_families_with_features_equal_eager(target, twins, monkeypatch):
    """A speculative engine's graphs (widths 1 and 4) serving plain requests: with twins without features, and where
    the capture found them not to pay (forced here: this target's steps are short), the families with features
    replay instead — greedy tokens as the eager path's, prompts on the prefill graphs included."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.cuda_graph import TargetGraphRunner
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    monkeypatch.setattr(TargetGraphRunner, "_twins_pay", lambda self: twins)
    batch, params = prompts(5), SamplingParams(max_new_tokens=40, ignore_eos=True)
    cfg = EngineConfig(model=str(target), device="cuda", dtype="float32", cuda_graph_max_bs=16,
                       cuda_graph_widths=(1, 4), page_size=16, kv_pages=2048)
    with LLMEngine(cfg) as eng:
        graphs = eng.executor.runner.graphs
        assert (graphs.plain_decode is not None) == twins and bool(graphs.plain_prefill) == twins
        graphed = [r.output_token_ids for r in eng.generate(batch, params, spec=None)]
    assert graphed == run(target, batch, graphs=False)
