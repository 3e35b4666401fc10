"""Runs tensor-parallel engines in a child process for test_tp.py (so a hang can be killed from
outside, and the TP process group and thread settings never touch the pytest process).

Usage: python tests/tp_runner.py SPEC.json OUT.pt — SPEC is a list of jobs
{"model": dir, "tp_size": n, "prompts": [[...]], "max_new_tokens": m, "tree": {...} or null,
"chunked_prefill_size": k (optional: greedy again with prompts prefilled in chunks of k, then second
turns — each prompt, its answer and three more tokens — that start on the prefix cache's pages),
"decode_steps": k (optional: greedy and sampled again with runs of k decode steps queued on the graphs'
static buffers, every rank following rank 0's runs), "draft": dir, "spec": [steps, topk, tokens],
"spec_rounds": k (optional: greedy again with that EAGLE-3 head, in runs of k chain rounds, the same way)}.
OUT holds, per job: prompt logits, greedy and seeded-sampled outputs, EAGLE-3 features, tree-node
logits, the rank-0 shard sizes, and whether all worker processes were gone after shutdown.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers import forward_fresh  # noqa: E402
from triton_interpreter import skip_nested_repatching  # noqa: E402
from tandem.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.kv_cache import SequenceKV  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

skip_nested_repatching()  # at import: the TP ranks, spawned, import this file too (as __mp_main__)

# A pool of this many pages holds every job's sequences; the default (sized from memory: 16k pages) made each
# interpreted Triton launch copy the whole pool back (the interpreter copies its arguments' storages)
KV_PAGES = 512


def run_job(job: dict) -> dict:
    out: dict = {}
    with LLMEngine(EngineConfig(model=job["model"], tp_size=job["tp_size"], page_size=4, kv_pages=KV_PAGES)) as eng:
        attn = eng.executor.runner.model.model.layers[0].self_attn
        proj = getattr(attn, "qkv_proj", None)  # MLA (DeepSeek-V3) has heads but no KV heads to split
        out["local_heads"] = proj.local_heads if proj is not None else attn.local_heads
        out["local_kv_heads"] = proj.local_kv_heads if proj is not None else None
        out["local_vocab"] = eng.executor.runner.model.lm_head.weight.shape[0]
        fused = getattr(attn, "fused_qkv_a_proj_with_mqa", None)  # MLA's q + kv_a input projection, if fused
        out["qkv_a_rows"] = fused.weight.shape[0] if fused is not None else None
        out["prompt_logits"] = [eng.prompt_logits(p) for p in job["prompts"]]
        n = job["max_new_tokens"]
        greedy = eng.generate(job["prompts"], [SamplingParams(max_new_tokens=n - 3 * i, ignore_eos=True)
                                               for i in range(len(job["prompts"]))])
        out["greedy"] = [r.output_token_ids for r in greedy]
        sampled = eng.generate(job["prompts"][:1], SamplingParams(temperature=1.0, seed=5, max_new_tokens=n,
                                                                  ignore_eos=True))
        out["sampled"] = sampled[0].output_token_ids
        logits, features = forward_fresh(eng, job["prompts"], capture_features=True)
        out["features"], out["packed_logits"] = features, logits
        tree = job.get("tree")
        if tree:
            kv = SequenceKV(eng.allocator)
            kv.reserve(len(tree["prefix"]) + len(tree["tokens"]))
            pages = list(kv.pages)
            eng.executor.forward(ForwardBatch([SequenceChunk(tree["prefix"], 0, pages, logits="none")]))
            chunk = SequenceChunk(tree["tokens"], len(tree["prefix"]), pages, positions=tree["positions"],
                                  tree_mask=tree["mask"], logits="all")
            out["tree_logits"], _ = eng.executor.forward(ForwardBatch([chunk]))
            kv.release()
        out["pages_back"] = eng.allocator.num_free == eng.allocator.capacity_pages
    if job.get("chunked_prefill_size"):  # the same greedy run with prompts prefilled in chunks
        cfg = EngineConfig(model=job["model"], tp_size=job["tp_size"], page_size=4, kv_pages=KV_PAGES,
                           chunked_prefill_size=job["chunked_prefill_size"])
        with LLMEngine(cfg) as eng:
            out["chunked_greedy"] = [r.output_token_ids for r in eng.generate(job["prompts"], [
                SamplingParams(max_new_tokens=n - 3 * i, ignore_eos=True) for i in range(len(job["prompts"]))])]
            out["turns"] = [p + o + [7, 8, 9] for p, o in zip(job["prompts"], out["chunked_greedy"])]
            out["turns_greedy"] = [r.output_token_ids for r in eng.generate(
                out["turns"], SamplingParams(max_new_tokens=8, ignore_eos=True))]
            out["turns_cache_hits"] = eng.prefix_cache.stats.hits
    if job.get("decode_steps"):  # greedy and sampled again, with runs of decode steps on the graphs' static path
        # Prefill families 16 and 32 only (the prompts' batch is the 32's): on the static path their attention is
        # interpreted Triton, so the chain rounds' engine below prefills eagerly (the prefill graphs are this one's).
        cfg = EngineConfig(model=job["model"], tp_size=job["tp_size"], page_size=4, kv_pages=KV_PAGES, static_graph_path=True,
                           decode_steps=job["decode_steps"], cuda_graph_max_bs=4, prefill_graph_tokens=32)
        q = job.get("queued_new_tokens", n)  # (fewer: a prefix of the runs above, for a slow static path)
        with LLMEngine(cfg) as eng:
            runs = []
            for prompts, params in ((job["prompts"], [SamplingParams(max_new_tokens=min(q, n - 3 * i), ignore_eos=True)
                                                      for i in range(len(job["prompts"]))]),
                                    (job["prompts"][:1], [SamplingParams(temperature=1.0, seed=5, max_new_tokens=q,
                                                                         ignore_eos=True)])):
                rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
                while eng.has_unfinished():
                    eng.step()
                    runs.append(eng.last_step.steps if eng.last_step is not None else 1)
                runs_out = [eng.requests.pop(r).output for r in rids]
                out.setdefault("queued", []).append(runs_out)
            out["queued_most_steps"] = max(runs)
            out["run_graph_members"] = len(eng.executor.runner.graphs.run_graphs.families)
            out["queued_pages_back"] = eng.allocator.num_free == eng.allocator.capacity_pages
    if job.get("draft"):  # greedy again, speculating in runs of chain rounds on the graphs' static path
        from proposers import always_speculate
        from tandem.speculative.spec_config import SpecConfig
        from tandem.engine.speculative_setup import speculative_engine

        cfg = EngineConfig(model=job["model"], tp_size=job["tp_size"], page_size=4, kv_pages=KV_PAGES, static_graph_path=True,
                           spec_rounds=job["spec_rounds"], cuda_graph_max_bs=4, prefill_graph_tokens=0)  # (above)
        with speculative_engine(cfg, job["draft"], SpecConfig(*job["spec"]), policy=always_speculate()) as eng:
            rids = [eng.add_request(p, SamplingParams(max_new_tokens=n - 3 * i, ignore_eos=True))
                    for i, p in enumerate(job["prompts"])]
            runs = []
            while eng.has_unfinished():
                eng.step()
                runs.append(eng.last_step.steps if eng.last_step is not None and eng.last_step.speculative else 0)
            reqs = [eng.requests.pop(r) for r in rids]
            out["spec_greedy"] = [r.output for r in reqs]
            out["spec_rounds"] = sum(r.spec_stats.rounds for r in reqs)
            out["spec_most_rounds_a_step"] = max(runs)
            out["spec_pages_back"] = eng.allocator.num_free == eng.allocator.capacity_pages
            if "turns" in out:  # second turns on both ranks' cached pages and the head's, speculating
                hits = eng.prefix_cache.stats.hits, eng.proposer.prefix_cache.stats.hits
                out["spec_turns_greedy"] = [r.output_token_ids for r in eng.generate(
                    out["turns"], SamplingParams(max_new_tokens=8, ignore_eos=True))]
                out["spec_turns_cache_hits"] = (eng.prefix_cache.stats.hits - hits[0],
                                                eng.proposer.prefix_cache.stats.hits - hits[1])
            out["spec_after_failure"], out["failures_injected"] = _greedy_with_a_failing_round(eng, job)
    out["children_left"] = [p.name for p in multiprocessing.active_children()]
    return out


def _greedy_with_a_failing_round(eng, job: dict) -> tuple[list, int]:
    """Greedy again, the head failing once in the middle of a run (after its first round reached the other
    ranks), turned into ProposerUnavailable as the verifier's in-process head does: the run is abandoned,
    the requests go on without speculation → (outputs, failures injected)."""
    from tandem.speculative import chain_rounds
    from tandem.speculative.proposer import ProposerUnavailable

    failed, draft, begin = [], chain_rounds.LocalDraftSide.draft, chain_rounds.LocalDraftSide.begin

    def counted_begin(side, *args):
        rows = begin(side, *args)  # (its first draft: before the other ranks are told of the run)
        side.rounds_drafted = 1
        return rows

    def failing_draft(side):  # the second round's draft: the first round's inputs went to rank 1
        if getattr(side, "rounds_drafted", 0) == 1 and side.rounds > 1 and not failed:
            failed.append(True)
            raise RuntimeError("injected: the head failed mid-run")
        return draft(side)

    def guarded(call, *args):
        try:
            return call(*args)
        except RuntimeError as e:
            raise ProposerUnavailable(str(e)) from e

    chain_rounds.LocalDraftSide.draft, chain_rounds.LocalDraftSide.begin = failing_draft, counted_begin
    eng.proposer.guarded = guarded
    try:
        n = job["max_new_tokens"]
        results = eng.generate(job["prompts"], [SamplingParams(max_new_tokens=n - 3 * i, ignore_eos=True)
                                                for i in range(len(job["prompts"]))])
    finally:
        chain_rounds.LocalDraftSide.draft, chain_rounds.LocalDraftSide.begin = draft, begin
    return [r.output_token_ids for r in results], len(failed)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.save([run_job(job) for job in spec], sys.argv[2])


if __name__ == "__main__":
    main()
