"""The CUDA-graph path's static buffers, padding and Triton kernels give the eager path's logits and
features — for a dense model and for a latent-cache one (DeepSeek-V3's MLA) — checked on the CPU under
Triton's interpreter (capture and replay themselves are checked on the GPU in tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="runs the Triton kernels: set TRITON_INTERPRET=1 on a CPU machine")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    path = write_random_llama(tmp_path_factory.mktemp("static") / "t", LlamaShape(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
        max_position_embeddings=256), seed=5, std=0.08)
    eng = LLMEngine(EngineConfig(model=str(path), page_size=4, page_shuffle_seed=7))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def mla_engine(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA + MoE) on the Triton latent kernel's route."""
    from deepseek_checkpoints import write_deepseek
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    path = tmp_path_factory.mktemp("static-mla") / "t"
    write_deepseek(path, seed=6, num_hidden_layers=3)
    eng = LLMEngine(EngineConfig(model=str(path), page_size=4, page_shuffle_seed=7, attention_backend="triton"))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_static_decode_and_verify_match_eager(model, request):
    from tandem.attention.graph_backend import TritonGraphBackend
    from tandem.attention.mla_graph_backend import MLAGraphBackend
    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.engine.cuda_graph import TargetGraphRunner
    from tandem.kv_cache import SequenceKV
    from tandem.speculative.tree import DraftTree

    engine = request.getfixturevalue("engine" if model == "llama" else "mla_engine")
    runner = engine.executor.runner
    runner.graph_backend = TritonGraphBackend() if model == "llama" else MLAGraphBackend()
    graphs = TargetGraphRunner(runner, widths=(1, 5), max_bs=8)
    # A prompt as long as a verify is wide is a prefill (one logits row wanted), not a verify: eager.
    assert not graphs.can_run(ForwardBatch([SequenceChunk([1, 2, 3, 4, 5], 0, [1, 2])]))
    assert graphs.can_run(ForwardBatch([SequenceChunk([1, 2, 3, 4, 5], 0, [1, 2], logits="all")]))
    # a prompt scored from a later position wants its rows from there on: not the graph's every row
    assert not graphs.can_run(ForwardBatch([SequenceChunk([1, 2, 3, 4, 5], 0, [1, 2], logits="all", logits_from=2)]))
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (3, 9, 17):  # prefill eagerly, then compare one decode and one verify step
        prompt = torch.randint(0, 300, (n,), generator=g).tolist()
        kv = SequenceKV(engine.allocator)
        kv.reserve(n + 5)
        runner.forward(ForwardBatch([SequenceChunk(prompt, 0, list(kv.pages))]))
        seqs.append((prompt, kv))
    decode = ForwardBatch([SequenceChunk([7 + i], len(p), list(kv.pages)) for i, (p, kv) in enumerate(seqs)])
    eager_logits, _ = runner.forward(decode)
    static_logits, _ = graphs.run_static_eagerly(decode)
    torch.testing.assert_close(static_logits, eager_logits, rtol=1e-4, atol=1e-4)
    # What a run returned is the caller's: the family's next run (other tokens) leaves it as it was.
    kept = static_logits.clone()
    graphs.run_static_eagerly(ForwardBatch([SequenceChunk([9 + i], len(p), list(kv.pages))
                                            for i, (p, kv) in enumerate(seqs)]))
    assert torch.equal(static_logits, kept)

    tree = DraftTree([5, 11, 12, 13, 14], [-1, 0, 0, 1, 3])
    verify = ForwardBatch([SequenceChunk(tree.tokens, len(p), list(kv.pages),
                                         positions=[len(p) + d for d in tree.depths], tree_mask=tree.ancestor_mask(),
                                         logits="all") for p, kv in seqs], capture_features=True)
    eager_logits, eager_feats = runner.forward(verify)
    static_logits, static_feats = graphs.run_static_eagerly(verify)
    torch.testing.assert_close(static_logits, eager_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(static_feats, eager_feats, rtol=1e-4, atol=1e-4)

    # The same verify with the drafted tokens still on the device (-1 on the host), for two of the
    # three sequences: the graph's inputs take them there, the eager path reads them back first.
    hidden = [tree.tokens[0]] + [-1] * (tree.size - 1)
    on_device = ForwardBatch([
        SequenceChunk(hidden if i < 2 else tree.tokens, len(p), list(kv.pages), positions=[len(p) + d for d in tree.depths],
                      tree_mask=tree.ancestor_mask(), logits="all",
                      device_ids=torch.tensor(tree.tokens) if i < 2 else None)
        for i, (p, kv) in enumerate(seqs)], capture_features=True)
    static_logits, _ = graphs.run_static_eagerly(on_device)
    torch.testing.assert_close(static_logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert graphs.families[5].input_ids[:15].tolist() == tree.tokens * 3
    torch.testing.assert_close(runner.forward(on_device)[0], eager_logits, rtol=0, atol=0)
    for _, kv in seqs:
        kv.release()


def test_a_padded_bucket_stages_its_padding_rows_on_the_dummy_page(engine):
    """Rows of a bucket past the batch (9 sequences in bucket 16) are staged as padding — token 0 at position 0, their
    one key on the dummy page, their whole table the dummy page's, whatever the bucket's last batch left in those rows —
    and the real rows' logits are the eager path's."""
    from tandem.attention.graph_backend import TritonGraphBackend
    from tandem.engine.cuda_graph import TargetGraphRunner
    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.kv_cache import DUMMY_PAGE, SequenceKV

    runner = engine.executor.runner
    runner.graph_backend = TritonGraphBackend()
    graphs = TargetGraphRunner(runner, widths=(1,), max_bs=16)
    g = torch.Generator().manual_seed(3)
    seqs = []
    for n in range(5, 21):  # 16 prompts, prefilled eagerly
        prompt = torch.randint(0, 300, (n,), generator=g).tolist()
        kv = SequenceKV(engine.allocator)
        kv.reserve(n + 2)
        runner.forward(ForwardBatch([SequenceChunk(prompt, 0, list(kv.pages))]))
        seqs.append((prompt, kv))
    try:
        full = ForwardBatch([SequenceChunk([3], len(p), list(kv.pages)) for p, kv in seqs])
        graphs.run_static_eagerly(full)  # every row of bucket 16 real
        fam = graphs.families[1]
        part = ForwardBatch([SequenceChunk([4], len(p) + 1, list(kv.pages)) for p, kv in seqs[:9]])
        eager, _ = runner.forward(part)
        static, _ = graphs.run_static_eagerly(part)
        torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
        ps = engine.allocator.page_size
        assert fam.input_ids[9:16].tolist() == [0] * 7 and fam.positions[9:16].tolist() == [0] * 7
        assert fam.kv_lens[9:16].tolist() == [1] * 7
        assert fam.slots[9:16].tolist() == [DUMMY_PAGE * ps] * 7
        # every column: a run advances padding rows too, their slots through their tables (the full bucket's rows
        # held 6 pages, these 4 at most)
        assert (fam.block_tables[9:16] == DUMMY_PAGE).all()
    finally:
        for _, kv in seqs:
            kv.release()


def test_decode_graphs_without_features_leave_feature_steps_to_the_eager_path(engine):
    """Traffic capture with no drafter asks every decode step for features: the decode graphs must be
    captured with them (graph_decode_features), or such steps run eagerly rather than lose them."""
    import dataclasses

    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.engine.cuda_graph import TargetGraphRunner

    runner = engine.executor.runner
    step = ForwardBatch([SequenceChunk([7], 3, [1])], capture_features=True)
    plain = ForwardBatch([SequenceChunk([7], 3, [1])])
    graphs = TargetGraphRunner(runner, widths=(1,), max_bs=2)
    assert graphs.can_run(plain) and not graphs.can_run(step)
    original = runner.cfg
    runner.cfg = dataclasses.replace(original, graph_decode_features=True)
    try:
        assert TargetGraphRunner(runner, widths=(1,), max_bs=2).can_run(step)
    finally:
        runner.cfg = original


def _one_step_then_queued(engine, graphs, steps: int, prompts, params) -> tuple[list, list]:
    """→ (the engine's outputs decoding one step at a time without graphs, the same on ``graphs`` in runs of
    ``steps``); the engine is left as it was (no graphs, one step)."""
    runner = engine.executor.runner
    engine.decode_steps = 1
    reference = [r.output_token_ids for r in engine.generate(prompts, params)]
    runner.graphs, engine.decode_steps = graphs, steps
    try:
        return reference, [r.output_token_ids for r in engine.generate(prompts, params, spec=None)]
    finally:
        runner.graphs, engine.decode_steps = None, 1


def test_queued_decode_steps_on_the_static_buffers_equal_one_step_decoding(engine, monkeypatch):
    """run_decode_steps (what --decode-steps does with CUDA graphs) advances token, position, KV length
    and slot in the static buffers between replays: with every replay stood in by the captured code run
    eagerly, eight queued steps of a padded batch (3 requests in bucket 4) must give one-step decoding's
    tokens, greedy and seeded-sampled — with the runs after the first queued before the run they follow
    is read back (overlapped runs, going on from the device's inputs), and every page given back."""
    import tandem.engine.decode_ahead as decode_ahead
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.sampling import SamplingParams

    following, queue = [], decode_ahead.queue_decode_steps
    monkeypatch.setattr(decode_ahead, "queue_decode_steps",
                        lambda runner, reqs, steps, after=None, **kw:
                        following.append(after is not None) or queue(runner, reqs, steps, after, **kw))

    runner = engine.executor.runner
    # torch attention: this test is about the inputs advancing between replays (the Triton kernels'
    # static path is the other tests'), and interpreted Triton attention was most of its time
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (4, 13, 21)]
    # 27 tokens: the prefill's, then runs of 8, 8, 8 and 2 (three queued after the run before them)
    for params in (SamplingParams(max_new_tokens=27, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_k=40, seed=4, max_new_tokens=27, ignore_eos=True)):
        following.clear()
        # Another batch's block tables are what the static buffers hold past a run's pages (here: the
        # dummy page): a following run must stage the pages reserved for it.
        graphs.families[1].block_tables.zero_()
        reference, queued = _one_step_then_queued(engine, graphs, 8, prompts, params)
        assert queued == reference
        assert any(following)
        assert engine.run_in_flight is None
        assert engine.allocator.num_free == engine.allocator.capacity_pages


@pytest.mark.parametrize("whole_runs", [False, True])
def test_after_prompts_alone_the_one_step_owed_is_a_run_with_the_next_run_queued_behind_it(engine, monkeypatch,
                                                                                          whole_runs):
    """Prompts apart: right after a step of prompts alone the running requests take one step (their next token one
    step after the stall), queued as a run of one with the next run queued behind it before it is read back, so the
    device does not wait on the host between them — or, where runs are one graph (a step's device time within
    RUN_GRAPH_MAX_STEP_S; static graphs are not timed), a whole run at once; every request's tokens stay one-step
    decoding's."""
    import tandem.engine.decode_ahead as decode_ahead
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.sampling import SamplingParams

    calls, queue, read = [], decode_ahead.queue_decode_steps, decode_ahead.read_decode_steps

    def queued(executor, reqs, steps, after=None, **kw):
        run = queue(executor, reqs, steps, after, **kw)
        calls.append(("queue", id(run), steps, None if after is None else id(after)))
        return run

    monkeypatch.setattr(decode_ahead, "queue_decode_steps", queued)
    monkeypatch.setattr(decode_ahead, "read_decode_steps",
                        lambda runner, run: calls.append(("read", id(run))) or read(runner, run))
    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=4, run_steps=4 if whole_runs else 1)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (6, 11, 9)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine.decode_steps = 1
    reference = [r.output_token_ids for r in engine.generate(prompts, params)]
    monkeypatch.setattr(engine, "prefill_apart", True)
    monkeypatch.setattr(engine.accounting, "prefill_apart", True)
    runner.graphs, engine.decode_steps = graphs, 4
    try:
        rids = [engine.add_request(p, params) for p in prompts[:2]]
        for _ in range(4):
            engine.step()
        assert engine.run_in_flight is not None  # runs while no prompt waits
        rids.append(engine.add_request(prompts[2], params))
        kinds = []
        while engine.has_unfinished():
            calls.clear()
            engine.step()
            kinds.append((engine.last_step.num_prefill, engine.last_step.steps, list(calls)))
        prompt_step = next(i for i, (prefilled, _, _) in enumerate(kinds) if prefilled)
        _, steps, owed = kinds[prompt_step + 1]
        assert len(owed) >= 3 and [call[0] for call in owed[:3]] == ["queue", "queue", "read"], owed
        (_, one, one_steps, _), (_, following, _, after), (_, read_first) = owed[:3]
        # the run of one (or a whole run), the run behind it queued before it is read back
        assert steps == one_steps == (4 if whole_runs else 1), owed
        assert after == one and read_first == one and following != one, owed
        outputs = [engine.requests[rid].output for rid in rids]
    finally:
        runner.graphs, engine.decode_steps = None, 1
    assert outputs == reference
    assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_a_run_going_on_restages_block_tables_only_after_new_pages(engine, monkeypatch):
    """Runs of 2 steps on 4-token pages: a run queued after another stages the block tables again only where a page
    was reserved for it (every other run here); the tokens stay one-step decoding's, the tables of the runs that
    skip it being those staged before — a table not staged after a new page would leave that page's column at the
    staging's zero padding (the dummy page) and change the tokens."""
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.sampling import SamplingParams

    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=4, run_steps=2)
    restaged, restage = [], graphs.restage_pages
    monkeypatch.setattr(graphs, "restage_pages", lambda fam, tables: restaged.append(tables is not None) or restage(fam, tables))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (4, 8)]  # (their pages fill in step)
    params = SamplingParams(max_new_tokens=21, ignore_eos=True)
    graphs.families[1].block_tables.zero_()
    reference, queued = _one_step_then_queued(engine, graphs, 2, prompts, params)
    assert queued == reference
    assert restaged.count(True) >= 3 and restaged.count(False) >= 3, restaged


def test_runs_replay_one_graph_a_run_and_equal_one_step_decoding(engine, monkeypatch):
    """A run of plain steps at a bucket up to RUN_GRAPH_MAX_BS replays one member once (each step's token and the
    next step's inputs inside it), overlapped runs included: greedy, sampled (a greedy row and a seeded one), or
    sampled with a top-p cut; its tokens equal one-step decoding's. A run it cannot take — penalties in the batch, a
    run shorter than the captured one (a request's budget), a bucket past RUN_GRAPH_MAX_BS — replays the decode graph
    a step."""
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.engine.run_graphs import RUN_GRAPH_MAX_BS, run_member
    from tandem.sampling import SamplingParams

    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=RUN_GRAPH_MAX_BS + 1, run_steps=4)
    assert graphs.run_graphs.buckets(run_member(False, "greedy")) == list(range(1, RUN_GRAPH_MAX_BS + 1))
    replays, body = [], graphs._body
    monkeypatch.setattr(graphs, "_body", lambda member, bs: replays.append((member, bs)) or body(member, bs))
    g = torch.Generator().manual_seed(6)
    greedy = SamplingParams(max_new_tokens=14, ignore_eos=True)  # the prefill's token, runs of 4, 4, 4 and 1
    sampled = SamplingParams(temperature=0.9, seed=2, max_new_tokens=14, ignore_eos=True)
    cut = SamplingParams(temperature=1.2, top_p=0.7, seed=3, max_new_tokens=14, ignore_eos=True)
    top_k = SamplingParams(temperature=0.8, top_k=20, min_p=0.05, seed=5, max_new_tokens=14, ignore_eos=True)
    min_p = SamplingParams(temperature=1.1, min_p=0.1, seed=6, max_new_tokens=14, ignore_eos=True)
    penalised = SamplingParams(temperature=0.9, seed=4, presence_penalty=0.5, max_new_tokens=14, ignore_eos=True)
    for n, second, member in ((3, greedy, run_member(False, "greedy")), (3, sampled, run_member(False, "sampled")),
                              (2, cut, run_member(False, "sampled with a cut")),
                              (2, top_k, run_member(False, "sampled with a cut")), (2, min_p, run_member(False, "sampled")),
                              (3, penalised, None),
                              (RUN_GRAPH_MAX_BS + 1, greedy, None)):
        prompts = [torch.randint(0, 300, (5 + 2 * i,), generator=g).tolist() for i in range(n)]
        params = [second if i == 1 else greedy for i in range(n)]
        replays.clear()
        reference, queued = _one_step_then_queued(engine, graphs, 4, prompts, params)
        assert queued == reference, (n, member)
        whole = [(m, bs) for m, bs in replays if m != 1]
        steps = [bs for m, bs in replays if m == 1]
        if member is not None:
            assert whole == [(member, n)] * 3 and steps == [n], replays  # three whole runs (two overlapped), then a step
        else:
            assert whole == [] and len(steps) == 13, replays
        assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_queued_decode_steps_record_logprobs_and_apply_penalties_as_one_step_decoding(engine, monkeypatch):
    """Runs queued on the static buffers (overlapped: each after one not read back) record each step's
    log-probabilities on the device for the request that asks, and apply penalties and min_tokens from
    the token counts they keep there: tokens and logprobs equal one-step decoding's (whose logits rules
    and logprobs tests/test_sampling_fields.py holds to transformers and exact distributions)."""
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.sampling import SamplingParams

    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 11, 17)]
    engine.decode_steps = 1
    free = [r.output_token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=19))]
    params = [SamplingParams(temperature=0.8, seed=0, min_p=0.05, max_new_tokens=19, ignore_eos=True,
                             repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3),
              SamplingParams(temperature=0.8, seed=1, min_p=0.05, max_new_tokens=19, ignore_eos=True, logprobs=4),
              # greedy wants free[2][3] fourth: masked until the 16th token, which a run of 6 steps crosses
              SamplingParams(max_new_tokens=19, min_tokens=15, stop_token_ids=(free[2][3],))]

    def run():
        rids = [engine.add_request(p, sp, spec=None) for p, sp in zip(prompts, params)]
        tokens, logprobs, steps = {r: [] for r in rids}, {r: [] for r in rids}, []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.rid] += out.new_token_ids
                logprobs[out.rid] += out.logprobs or []
            steps.append(engine.last_step.steps if engine.last_step else 1)
        for r in rids:
            engine.requests.pop(r)
        return [tokens[r] for r in rids], [logprobs[r] for r in rids], max(steps)

    engine.decode_steps = 1
    reference, reference_logprobs, _ = run()
    runner.graphs, engine.decode_steps = graphs, 6
    try:
        queued, queued_logprobs, most_steps = run()
    finally:
        runner.graphs, engine.decode_steps = None, 1
    assert queued == reference and most_steps == 6
    assert reference[2][3] != free[2][3] and free[2][3] not in reference[2][:15]  # the mask mattered
    assert queued_logprobs[0] == [] == queued_logprobs[2] and len(queued_logprobs[1]) == 19
    for got, want in zip(queued_logprobs[1], reference_logprobs[1]):
        assert abs(got.logprob - want.logprob) <= 1e-4
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got.top, want.top)) <= 1e-4


def test_queued_decode_steps_of_a_latent_model_on_the_static_buffers_equal_one_step_decoding(mla_engine, monkeypatch):
    """The MLA graph backend under queued runs: the latent kernel reads the lengths and slots the device
    advanced between replays (a padded batch: 3 requests in bucket 4)."""
    import tandem.engine.decode_ahead as decode_ahead
    from helpers import static_target_graphs
    from tandem.attention.mla_graph_backend import MLAGraphBackend
    from tandem.sampling import SamplingParams

    engine, runner = mla_engine, mla_engine.executor.runner
    backend, calls = MLAGraphBackend(), {"attend": 0, "runs": 0}
    attend, queue = backend.forward_absorbed, decode_ahead.queue_decode_steps
    monkeypatch.setattr(backend, "forward_absorbed", lambda *a, **k: calls.__setitem__("attend", calls["attend"] + 1) or attend(*a, **k))
    monkeypatch.setattr(decode_ahead, "queue_decode_steps",
                        lambda *a, **kw: calls.__setitem__("runs", calls["runs"] + 1) or queue(*a, **kw))
    monkeypatch.setattr(runner, "graph_backend", backend, raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 10, 18)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)  # the prefill's token, a run of 6, a run of 1
    engine.decode_steps = 1
    reference = [r.output_token_ids for r in engine.generate(prompts, params)]
    runner.graphs, engine.decode_steps = graphs, 6
    try:
        queued = [r.output_token_ids for r in engine.generate(prompts, params)]
    finally:
        runner.graphs, engine.decode_steps = None, 1
    assert queued == reference and calls["runs"] >= 2 and calls["attend"] >= 6 * 3  # runs of 6 steps, 3 layers
    assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_verify_widths_past_the_latent_kernels_mask_are_not_captured():
    from tandem.engine.model_runner import graph_widths

    assert graph_widths((1, 4, 65), latent=False) == (1, 4)  # the paged kernel's mask is 64 keys wide too
    assert graph_widths((1, 4, 64, 65), latent=True) == (1, 4, 64)


def test_steps_whose_features_no_drafter_keeps_replay_twins_without_them(engine, monkeypatch):
    """A speculative engine's decode and prefill graphs compute the EAGLE-3 features for a drafter that keeps
    them; a step that asks for none (the drafter detached) replays a twin captured without them — what
    target-only's graphs compute — with the same logits. Target-only graphs have no twins."""
    from helpers import TorchGraphBackend
    from tandem.engine.cuda_graph import PLAIN_DECODE, TargetGraphRunner
    from tandem.forward_batch import ForwardBatch, SequenceChunk

    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    plain_only = TargetGraphRunner(runner, widths=(1,), max_bs=2, use_graphs=False, prefill_widths=(16,))
    assert plain_only.plain_decode is None and not plain_only.plain_prefill
    graphs = TargetGraphRunner(runner, widths=(1, 4), max_bs=2, use_graphs=False, prefill_widths=(16,),
                               prefill_max_bs=2)
    graphs.run_statically()
    members, body = [], graphs._body
    monkeypatch.setattr(graphs, "_body", lambda member, bs: members.append(member) or body(member, bs))

    def run(chunk, features: bool):
        members.clear()
        logits, feats = graphs.run(ForwardBatch([chunk], capture_features=features))
        return members[-1], logits.clone(), feats

    for chunk, kept, twin in ((SequenceChunk([7], 3, [1]), 1, PLAIN_DECODE),
                              (SequenceChunk(list(range(1, 7)), 0, [1, 2]), ("prefill", 16, True),
                               ("prefill", 16, False))):
        member, logits, feats = run(chunk, True)
        assert member == kept and feats is not None and feats.shape[-1] == 3 * runner.model_cfg.hidden_size
        member, twin_logits, feats = run(chunk, False)
        assert member == twin and feats is None
        assert torch.equal(twin_logits, logits)
    # the twin's step is target-only's, op for op (the featured family's has the capture layers' ops on top)
    plain_only.run_statically()
    step = lambda g, features: ops_of(lambda: g.run(ForwardBatch([SequenceChunk([7], 3, [1])],  # noqa: E731
                                                                    capture_features=features)))
    assert step(graphs, False) == step(plain_only, False) != step(graphs, True)
    # a run of decode steps without features replays the twin at every step
    members.clear()
    graphs.run_decode_steps(ForwardBatch([SequenceChunk([7], 3, [1])]), 3, lambda logits, feats, k: logits.argmax(-1))
    assert members == [PLAIN_DECODE] * 3


def test_a_run_keeps_each_steps_features_as_a_step_at_a_time_does(engine, monkeypatch):
    """An attached drafter's plain run (features kept) replays a member on the decode family with features, once;
    without features one on the twin. Tokens and each step's features equal the same runs replayed a step at a time
    (its pick sampling with the same StepSampler and copying the features), for a batch of two at different
    positions, a second run going on from the first: greedy, sampled, and sampled with top-p / top-k cuts."""
    from helpers import TorchGraphBackend
    from tandem.engine.cuda_graph import PLAIN_DECODE, TargetGraphRunner
    from tandem.engine.run_graphs import run_member
    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.sampling import SamplingParams, StepSampler

    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = TargetGraphRunner(runner, widths=(1, 4), max_bs=2, use_graphs=False, run_steps=3)
    graphs.run_statically()
    assert graphs._family_of(run_member(False, "greedy")) is graphs.plain_decode
    assert graphs._family_of(run_member(True, "sampled")) is graphs.families[1]
    members, body = [], graphs._body
    monkeypatch.setattr(graphs, "_body", lambda member, bs: members.append(member) or body(member, bs))

    def run(features: bool, whole: bool, params: list[SamplingParams]):
        """Two runs of 3 steps, the second going on from the first (``after``) → (members replayed, tokens [6, 2],
        features [6, 2, F] or None)."""
        members.clear()
        tokens, feats = [], []
        batch = ForwardBatch([SequenceChunk([7], 1, [1, 4]), SequenceChunk([9], 3, [2, 3, 5])], capture_features=features)
        state = None
        for first in (0, 3):
            run_tokens, stepped = torch.empty(3, 2, dtype=torch.int64), []
            sampler = StepSampler(params, [(p.seed or 0, 10 + first) for p in params], torch.device("cpu"), 300, 3)

            def pick(logits, step_features, k):
                if step_features is not None:
                    stepped.append(step_features.clone())
                run_tokens[k] = sampler(logits, k)
                return run_tokens[k]

            kept = [] if features else None
            state = graphs.run_decode_steps(None if state else batch, 3, pick, after=state, features=features,
                                            whole_run=(run_tokens, kept, sampler) if whole else None)
            tokens.append(run_tokens)
            if features:
                feats.append(kept[0] if whole else torch.stack(stepped))
        return list(members), torch.cat(tokens), torch.cat(feats) if features else None

    greedy = [SamplingParams(), SamplingParams()]
    sampled = [SamplingParams(temperature=1.5, seed=5), SamplingParams()]
    cut = [SamplingParams(temperature=1.5, top_p=0.8, seed=6), SamplingParams(temperature=0.7, top_k=30, seed=7)]
    for features, params, sampling, step_member in ((True, greedy, "greedy", 1), (False, greedy, "greedy", PLAIN_DECODE),
                                                    (True, sampled, "sampled", 1), (True, cut, "sampled with a cut", 1)):
        stepped_members, stepped_tokens, stepped_features = run(features, False, params)
        whole_members, whole_tokens, whole_features = run(features, True, params)
        assert stepped_members == [step_member] * 6 and whole_members == [run_member(features, sampling)] * 2
        assert torch.equal(whole_tokens, stepped_tokens)
        if features:
            assert whole_features.shape == (6, 2, 3 * runner.model_cfg.hidden_size)
            assert torch.equal(whole_features, stepped_features)


def test_a_detached_speculative_engine_decodes_on_the_twins_as_target_only(pair, monkeypatch):
    """With the drafter detached, a speculative engine's plain steps — a prefill graph, queued decode runs — replay
    only the twins without features, and greedy output equals a target-only engine's (float32, eager)."""
    import tandem.attention.graph_backend as graph_backend
    from helpers import TorchGraphBackend
    from tandem.engine.config import EngineConfig
    from tandem.engine.cuda_graph import PLAIN_DECODE
    from tandem.engine.run_graphs import run_member
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig

    prompts, params = [[5, 6, 7, 8, 9, 10], [11, 12, 13]], SamplingParams(max_new_tokens=12, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(pair.target_dir), page_size=4)) as plain:
        reference = [r.output_token_ids for r in plain.generate(prompts, params)]
    monkeypatch.setattr(graph_backend, "make_graph_backend", lambda latent: TorchGraphBackend())
    cfg = EngineConfig(model=str(pair.target_dir), page_size=4, static_graph_path=True, decode_steps=4,
                       cuda_graph_max_bs=2, prefill_graph_tokens=16, prefill_graph_max_bs=2)
    with speculative_engine(cfg, str(pair.draft_dir), SpecConfig(3, 1, 4)) as engine:
        graphs = engine.executor.runner.graphs
        members, body = [], graphs._body
        monkeypatch.setattr(graphs, "_body", lambda member, bs: members.append(member) or body(member, bs))
        engine.attachment.hold_detached()
        assert [r.output_token_ids for r in engine.generate(prompts, params)] == reference
    # (runs of greedy steps replay their own member: the twin's buffers too)
    greedy_run = run_member(False, "greedy")
    assert set(members) == {PLAIN_DECODE, greedy_run, ("prefill", 16, False)}
    assert graphs._family_of(greedy_run) is graphs.plain_decode


def ops_of(fn) -> list[str]:
    """The aten ops ``fn`` runs, in order (what a CUDA graph of it would launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ops: list[str] = []
    with Recorder():
        fn()
    return ops


def test_the_twins_without_features_are_dropped_where_they_do_not_pay(engine, monkeypatch):
    """Where a decode step with features is long on the device (``_twins_pay`` False), the capture plan keeps no
    twin: plain decode steps, prompts and runs replay the families with features, whose logits are the eager path's."""
    from tandem.attention.graph_backend import TritonGraphBackend
    from tandem.engine.cuda_graph import PLAIN_DECODE, TargetGraphRunner
    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.kv_cache import SequenceKV

    runner = engine.executor.runner
    runner.graph_backend = TritonGraphBackend()
    build = lambda: TargetGraphRunner(runner, widths=(1, 4), max_bs=8, prefill_widths=(16,), run_steps=4)  # noqa: E731
    kept = [name for name, _ in build().capture_plan()]
    twins = [name for name in kept if "without features" in name or ("run" in name and "with features" not in name)]
    assert {"decode without features", "prefill(width=16) without features"} <= set(twins) and len(twins) == 5

    graphs = build()
    monkeypatch.setattr(graphs, "_twins_pay", lambda: False)
    plan = [name for name, _ in graphs.capture_plan()]
    assert plan == [name for name in kept if name not in twins]
    assert graphs.plain_decode is None and graphs.plain_prefill == {} and PLAIN_DECODE not in graphs._members
    assert graphs.run_graphs.families and all(fam is graphs.families[1] for fam in graphs.run_graphs.families.values())

    kv = SequenceKV(engine.allocator)
    kv.reserve(8)
    prompt = [5, 6, 7, 8, 9]
    runner.forward(ForwardBatch([SequenceChunk(prompt, 0, list(kv.pages))]))
    step = ForwardBatch([SequenceChunk([11], len(prompt), list(kv.pages))])  # (no features asked)
    eager, _ = runner.forward(step)
    static, _ = graphs.run_static_eagerly(step)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
    assert graphs.prepare(step)[0] is graphs.families[1]
    kv.release()
