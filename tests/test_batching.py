"""Packing several sequences into one forward changes nothing: logits and greedy tokens equal each
sequence run alone (and HF), through prefill, decode, mixed steps, scattered KV pages and tree masks."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel, forward_fresh, greedy_alone, hf_logits, manual_greedy_logits, random_prompt
from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.kv_cache import SequenceKV
from tandem.sampling import SamplingParams

LENGTHS = [1, 5, 16, 17, 33, 9]  # a single token, page-aligned and page-crossing prompts
MAX_NEW = [20, 5, 24, 12, 1, 16]  # requests finish at different steps, so the batch shrinks


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(100 + i, n) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def alone(llama, prompts):
    """Each prompt's greedy continuation, run by itself."""
    return [greedy_alone(llama.path, p, n) for p, n in zip(prompts, MAX_NEW)]


def test_packed_prefill_logits_match_each_alone(llama, prompts):
    with LLMEngine(EngineConfig(model=llama.path)) as eng:
        packed, _ = forward_fresh(eng, prompts)
        singles = [eng.prompt_logits(p) for p in prompts]
    assert packed.shape[0] == sum(LENGTHS)
    start = 0
    for p, single in zip(prompts, singles):
        mine = packed[start : start + len(p)]
        start += len(p)
        assert_rel(mine, single, 1e-4)
        assert_rel(mine, hf_logits(llama.hf, p), 1e-4)


def test_packed_decode_logits_match_hf(llama, prompts):
    """Prefill packed, then decode steps packed (one token per sequence, different prefix lengths):
    every row equals HF's logits at that position of the sequence's full token list."""
    with LLMEngine(EngineConfig(model=llama.path, page_size=4, page_shuffle_seed=11)) as eng:
        kvs = [SequenceKV(eng.allocator) for _ in prompts]
        seqs = [list(p) for p in prompts]
        rows = [[] for _ in prompts]
        chunks = []
        for kv, seq in zip(kvs, seqs):
            kv.reserve(len(seq))
            chunks.append(SequenceChunk(list(seq), 0, list(kv.pages)))
        for _ in range(12):
            logits, _ = eng.executor.forward(ForwardBatch(chunks))
            assert logits.shape[0] == len(prompts)
            chunks = []
            for i, (kv, seq) in enumerate(zip(kvs, seqs)):
                rows[i].append(logits[i])
                seq.append(int(logits[i].argmax()))
                kv.reserve(len(seq))
                chunks.append(SequenceChunk([seq[-1]], len(seq) - 1, list(kv.pages)))
        for kv in kvs:
            kv.release()
        assert eng.allocator.num_free == eng.allocator.capacity_pages
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        ref = hf_logits(llama.hf, seq[:-1])[len(prompt) - 1 :]
        assert_rel(torch.stack(rows[i]), ref, 1e-4, f"sequence {i}")


def test_batched_greedy_matches_each_alone(llama, prompts, alone):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    with LLMEngine(EngineConfig(model=llama.path)) as eng:
        results = eng.generate(prompts, params)
    for i, r in enumerate(results):
        assert r.output_token_ids == alone[i], f"sequence {i} differs when batched"
        assert r.finish_reason == "length"


def test_alone_greedy_matches_hf_logits(llama, prompts, alone):
    """Anchor the 'alone' reference to HF: each greedy token is the argmax of HF's logits."""
    for p, out in zip(prompts, alone):
        ref = hf_logits(llama.hf, p + out)[len(p) - 1 : -1]
        assert out == ref.argmax(-1).tolist()


def test_requests_added_while_others_decode(llama, prompts, alone):
    """Continuous batching: prefill of new prompts shares forwards with running decodes."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    outputs: dict[str, list[int]] = {}
    mixed_steps = 0
    with LLMEngine(EngineConfig(model=llama.path)) as eng:
        rids: list[str] = []
        arrivals = {0: [0], 3: [1, 2], 4: [3], 9: [4, 5]}  # step number -> prompts that arrive
        step = 0
        while step < 200 and (len(rids) < len(prompts) or any(not eng.requests[r].finished for r in rids)):
            new = [eng.add_request(prompts[i], params[i]) for i in arrivals.get(step, [])]
            rids += new
            running_before = {r for r in rids if r not in new and not eng.requests[r].finished}
            produced = {o.rid for o in eng.step()}
            if new and running_before and set(new) <= produced and running_before <= produced:
                mixed_steps += 1
            step += 1
        for rid in rids:
            outputs[rid] = eng.requests.pop(rid).output
    assert mixed_steps >= 3, "no step ran prefill together with decoding"
    assert [outputs[r] for r in rids] == alone


LONG_PROMPTS = [random_prompt(200 + i, n) for i, n in enumerate((3, 23, 41))]
LONG_PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def contiguous(llama):
    """Batched greedy outputs and one sequence's decode logits with the default contiguous pages."""
    with LLMEngine(EngineConfig(model=llama.path)) as eng:
        want = [r.output_token_ids for r in eng.generate(LONG_PROMPTS, LONG_PARAMS)]
        return want, *manual_greedy_logits(eng, LONG_PROMPTS[1], 30)


@pytest.mark.parametrize("engine_kw", [dict(page_size=4, page_shuffle_seed=123), dict(page_size=1),
                                       dict(page_size=7, page_shuffle_seed=5)])
def test_scattered_pages_match_contiguous(llama, contiguous, engine_kw):
    long_prompts, params = LONG_PROMPTS, LONG_PARAMS
    want, want_tokens, want_logits = contiguous
    with LLMEngine(EngineConfig(model=llama.path, **engine_kw)) as paged:
        rids = [paged.add_request(p, params) for p in long_prompts]
        paged.step()
        pages = paged.requests[rids[2]].kv.pages
        assert len(pages) >= 41 // engine_kw["page_size"]
        if engine_kw.get("page_shuffle_seed") is not None:
            assert pages != list(range(pages[0], pages[0] + len(pages))), "pages were not scattered"
        while any(not paged.requests[r].finished for r in rids):
            paged.step()
        got = [paged.requests.pop(r).output for r in rids]
        got_tokens, got_logits = manual_greedy_logits(paged, long_prompts[1], 30)
        assert paged.allocator.num_free == paged.allocator.capacity_pages
    assert got == want
    assert got_tokens == want_tokens
    assert_rel(got_logits, want_logits, 1e-5)
    # Decoding through the cache equals HF's full forward over the whole sequence.
    ref = hf_logits(llama.hf, got_tokens)[len(long_prompts[1]) - 1 :]
    assert_rel(got_logits, ref, 1e-4)


# ----------------------------------------------------------------------------------------- tree masks


def ancestor_mask(parents: list[int]) -> list[list[bool]]:
    """mask[i][j]: node j is node i or one of its ancestors (computed independently of tandem)."""
    n = len(parents)
    mask = []
    for i in range(n):
        row, j = [False] * n, i
        while j != -1:
            row[j] = True
            j = parents[j]
        mask.append(row)
    return mask


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def depths(parents: list[int]) -> list[int]:
    return [len(path_to(parents, i)) - 1 for i in range(len(parents))]


def test_causal_tree_mask_equals_no_mask(llama):
    prompt = random_prompt(300, 30)
    with LLMEngine(EngineConfig(model=llama.path, page_size=4)) as eng:
        kv = SequenceKV(eng.allocator)
        kv.reserve(len(prompt))
        pages = list(kv.pages)
        eng.executor.forward(ForwardBatch([SequenceChunk(prompt[:12], 0, pages, logits="none")]))
        chunk = prompt[12:]
        n = len(chunk)
        plain, _ = eng.executor.forward(ForwardBatch([SequenceChunk(chunk, 12, pages, logits="all")]))
        square = [[j <= i for j in range(n)] for i in range(n)]
        masked, _ = eng.executor.forward(ForwardBatch([SequenceChunk(chunk, 12, pages, tree_mask=square, logits="all")]))
        # W > q_len: a causal mask over the last n + 5 keys (the 5 cached ones fully visible).
        wide = [[True] * 5 + row for row in square]
        wide_masked, _ = eng.executor.forward(ForwardBatch([SequenceChunk(chunk, 12, pages, tree_mask=wide, logits="all")]))
        # Fresh sequence, mask over everything.
        full = [[j <= i for j in range(len(prompt))] for i in range(len(prompt))]
        fresh, _ = eng.executor.forward(ForwardBatch([SequenceChunk(prompt, 0, pages, tree_mask=full, logits="all")]))
        kv.release()
    assert_rel(masked, plain, 1e-6)
    assert_rel(wide_masked, plain, 1e-6)
    ref = hf_logits(llama.hf, prompt)
    assert_rel(plain, ref[12:], 1e-4)
    assert_rel(fresh, ref, 1e-4)


# root r (the last verified token, not yet cached), then a tree whose siblings share positions:
#   r ─ a ─ c ─ f
#   │     └ d
#   └ b ─ e
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TREE_TOKENS = [None, 40, 41, 42, 43, 44, 45]  # None: the root, filled in with the prompt's last token


def check_nodes_against_paths(hf, prefix, tokens, parents, node_logits, nodes):
    """The logits of each node equal HF's logits of the same token in its root-to-node path run as a
    plain sequence (prefix + path)."""
    for row, node in zip(node_logits, nodes):
        path = [tokens[j] for j in path_to(parents, node)]
        ref = hf_logits(hf, prefix + path)[-1]
        assert_rel(row, ref, 1e-4, f"tree node {node} differs from its path run")


@pytest.mark.parametrize("page_size", [16, 3])
def test_tree_mask_matches_each_root_to_leaf_path(llama, page_size):
    prompt = random_prompt(301, 13)
    prefix, root = prompt[:-1], prompt[-1]
    tokens = [root] + TREE_TOKENS[1:]
    with LLMEngine(EngineConfig(model=llama.path, page_size=page_size, page_shuffle_seed=7)) as eng:
        kv = SequenceKV(eng.allocator)
        kv.reserve(len(prefix) + len(tokens))
        pages = list(kv.pages)
        eng.executor.forward(ForwardBatch([SequenceChunk(prefix, 0, pages, logits="none")]))
        positions = [len(prefix) + d for d in depths(TREE_PARENTS)]
        tree = SequenceChunk(tokens, len(prefix), pages, positions=positions,
                             tree_mask=ancestor_mask(TREE_PARENTS), logits="all")
        logits, _ = eng.executor.forward(ForwardBatch([tree]))
        kv.release()
    check_nodes_against_paths(llama.hf, prefix, tokens, TREE_PARENTS, logits, range(len(tokens)))


def test_tree_over_two_forwards_sees_earlier_nodes(llama):
    """Multi-step drafting: the second forward's nodes see the first forward's nodes through a
    [q_len, W > q_len] mask over the last W keys: their own ancestors, never their cousins."""
    prompt = random_prompt(302, 10)
    prefix, root = prompt[:-1], prompt[-1]
    tokens = [root] + TREE_TOKENS[1:]
    parents, P = TREE_PARENTS, len(prefix)
    full = ancestor_mask(parents)
    dep = depths(parents)
    with LLMEngine(EngineConfig(model=llama.path, page_size=4)) as eng:
        kv = SequenceKV(eng.allocator)
        kv.reserve(P + len(tokens))
        pages = list(kv.pages)
        eng.executor.forward(ForwardBatch([SequenceChunk(prefix, 0, pages, logits="none")]))
        first, second = [0, 1, 2], [3, 4, 5, 6]  # r a b | c d e f
        step1 = SequenceChunk([tokens[i] for i in first], P, pages, positions=[P + dep[i] for i in first],
                              tree_mask=[[full[i][j] for j in first] for i in first], logits="all")
        logits1, _ = eng.executor.forward(ForwardBatch([step1]))
        step2 = SequenceChunk([tokens[i] for i in second], P + 3, pages, positions=[P + dep[i] for i in second],
                              tree_mask=[[full[i][j] for j in first + second] for i in second], logits="all")
        logits2, _ = eng.executor.forward(ForwardBatch([step2]))
        kv.release()
    check_nodes_against_paths(llama.hf, prefix, tokens, parents, logits1, first)
    check_nodes_against_paths(llama.hf, prefix, tokens, parents, logits2, second)


def test_tree_in_a_batch_with_prefill_and_decode(llama):
    """Per-sequence masks in one packed forward: a tree, a plain decode and a fresh prompt."""
    tree_prompt, dec_prompt, new_prompt = random_prompt(303, 11), random_prompt(304, 18), random_prompt(305, 6)
    prefix, root = tree_prompt[:-1], tree_prompt[-1]
    tokens = [root] + TREE_TOKENS[1:]
    with LLMEngine(EngineConfig(model=llama.path, page_size=4, page_shuffle_seed=1)) as eng:
        kvs = [SequenceKV(eng.allocator) for _ in range(3)]
        kvs[0].reserve(len(prefix) + len(tokens))
        kvs[1].reserve(len(dec_prompt))
        kvs[2].reserve(len(new_prompt))
        eng.executor.forward(ForwardBatch([SequenceChunk(prefix, 0, list(kvs[0].pages), logits="none"),
                                           SequenceChunk(dec_prompt[:-1], 0, list(kvs[1].pages), logits="none")]))
        positions = [len(prefix) + d for d in depths(TREE_PARENTS)]
        batch = ForwardBatch([
            SequenceChunk(new_prompt, 0, list(kvs[2].pages), logits="all"),
            SequenceChunk(tokens, len(prefix), list(kvs[0].pages), positions=positions,
                          tree_mask=ancestor_mask(TREE_PARENTS), logits="all"),
            SequenceChunk(dec_prompt[-1:], len(dec_prompt) - 1, list(kvs[1].pages), logits="last"),
        ])
        logits, _ = eng.executor.forward(batch)
        for kv in kvs:
            kv.release()
    n_new, n_tree = len(new_prompt), len(tokens)
    assert logits.shape[0] == n_new + n_tree + 1
    assert_rel(logits[:n_new], hf_logits(llama.hf, new_prompt), 1e-4)
    check_nodes_against_paths(llama.hf, prefix, tokens, TREE_PARENTS, logits[n_new : n_new + n_tree], range(n_tree))
    assert_rel(logits[-1], hf_logits(llama.hf, dec_prompt)[-1], 1e-4)


def test_batch_of_equal_size_trees_with_different_shapes(llama):
    """Verification's real shape: every request brings a tree of the same node count, but each has
    its own topology (and prefix); each must be masked by its own tree."""
    shapes = [TREE_PARENTS, [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 0, 0, 0], [-1, 0, 1, 1, 0, 4, 4]]
    prompts = [random_prompt(310 + i, 9) for i in range(3)] + [random_prompt(313, 14)]
    with LLMEngine(EngineConfig(model=llama.path, page_size=4, page_shuffle_seed=2)) as eng:
        kvs, prefill, trees = [], [], []
        for i, (parents, prompt) in enumerate(zip(shapes, prompts)):
            prefix = prompt[:-1]
            tokens = [prompt[-1]] + [50 + 7 * i + j for j in range(len(parents) - 1)]
            kv = SequenceKV(eng.allocator)
            kv.reserve(len(prefix) + len(tokens))
            kvs.append(kv)
            prefill.append(SequenceChunk(prefix, 0, list(kv.pages), logits="none"))
            trees.append((prefix, tokens, parents, SequenceChunk(
                tokens, len(prefix), list(kv.pages), positions=[len(prefix) + d for d in depths(parents)],
                tree_mask=ancestor_mask(parents), logits="all")))
        eng.executor.forward(ForwardBatch(prefill))
        logits, _ = eng.executor.forward(ForwardBatch([t[3] for t in trees]))
        for kv in kvs:
            kv.release()
    for i, (prefix, tokens, parents, _) in enumerate(trees):
        rows = logits[7 * i : 7 * (i + 1)]
        check_nodes_against_paths(llama.hf, prefix, tokens, parents, rows, range(7))
