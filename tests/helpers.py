"""Reference computations shared by the tests: Hugging Face forwards on the same weights, single
sequences run alone, and small utilities (relative error, seeded prompts)."""

from __future__ import annotations

import random

import torch

from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.kv_cache import SequenceKV
from tandem.speculative.draft_static import StaticAttention, StaticMeta


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (shapes must agree)."""
    assert tuple(ours.shape) == tuple(ref.shape), (tuple(ours.shape), tuple(ref.shape))
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max())


def norm_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| (the kernels' tests: a whole tensor's error against its size)."""
    ours, ref = ours.detach().double(), ref.detach().double()
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]  # avoid the special ids 0..2


@torch.no_grad()
def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of the transformers model over one sequence."""
    return hf(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_hidden_states(hf, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """HF ``hidden_states``: index i is the input of layer i (index N is after the final norm)."""
    out = hf(torch.tensor([token_ids]), output_hidden_states=True)
    return tuple(h[0].float() for h in out.hidden_states)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF greedy continuation of exactly ``n`` tokens: no EOS can end it early, and no logits are
    altered (min_new_tokens would mask the EOS logit and change the greedy choice)."""
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                      eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n, f"HF stopped after {len(new)} of {n} tokens"
    return new


def generate_with_arrivals(engine, prompts: list[list[int]], params) -> tuple[list[str], list[list[int]]]:
    """The first two of six ``prompts`` at once, two more after 3 steps and the last two after 6 (prompts that
    arrive while others decode); → the request ids and each one's output tokens, in prompt order."""
    rids = [engine.add_request(p, params) for p in prompts[:2]]
    done, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.rid, []).extend(out.new_token_ids)
        steps += 1
        if steps in (3, 6):
            rids += [engine.add_request(p, params) for p in prompts[2 + 2 * (steps == 6): 4 + 2 * (steps == 6)]]
    return rids, [done[r] for r in rids]


def forward_fresh(engine, prompts: list[list[int]], capture_features: bool = False):
    """One executor forward of fresh sequences packed together (prefix_len 0, logits at every row);
    their pages are reserved for the forward and released after it. → (logits, features)."""
    kvs = []
    seqs = []
    for tokens in prompts:
        kv = SequenceKV(engine.allocator)
        kv.reserve(len(tokens))
        kvs.append(kv)
        seqs.append(SequenceChunk(list(tokens), 0, list(kv.pages), logits="all"))
    try:
        return engine.executor.forward(ForwardBatch(seqs, capture_features=capture_features))
    finally:
        for kv in kvs:
            kv.release()


@torch.no_grad()
def manual_greedy_logits(engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Prefill ``prompt`` then decode ``n`` greedy tokens one forward at a time through the executor,
    through the paged KV cache. Returns (prompt + n tokens, [n + 1, V] logits: the prompt's last row,
    then each decode step's row)."""
    kv = SequenceKV(engine.allocator)
    tokens = list(prompt)
    try:
        kv.reserve(len(tokens))
        logits, _ = engine.executor.forward(ForwardBatch([SequenceChunk(list(tokens), 0, list(kv.pages))]))
        rows = [logits[0]]
        for _ in range(n):
            tokens.append(int(rows[-1].argmax()))
            kv.reserve(len(tokens))
            step = SequenceChunk([tokens[-1]], len(tokens) - 1, list(kv.pages))
            logits, _ = engine.executor.forward(ForwardBatch([step]))
            rows.append(logits[0])
    finally:
        kv.release()
    return tokens, torch.stack(rows)


def torch_prompts(seed: int, lengths, vocab: int = 256) -> list[list[int]]:
    """Prompts of the given lengths drawn from one seeded torch generator (ids 3..vocab-1)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def target_only_greedy(model_dir, prompts: list[list[int]], n: int, ignore_eos: bool = True,
                       **engine_kw) -> list[list[int]]:
    """Target-only greedy continuations of ``prompts`` (``n`` new tokens each; fewer where an EOS ends one
    and ``ignore_eos`` is off), generated together by a fresh in-process engine without speculation:
    the speculative and service tests' reference (the engine is checked against transformers itself)."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    with LLMEngine(EngineConfig(model=str(model_dir), **engine_kw)) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos))
    return [o.output_token_ids for o in outs]


def greedy_alone(model_dir: str, prompt: list[int], n: int, **engine_kw) -> list[int]:
    """The engine's greedy output for one prompt run by itself (a fresh engine, nothing else queued)."""
    return target_only_greedy(model_dir, [prompt], n, **engine_kw)[0]


def assert_rel(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Assert rel_err(ours, ref) <= tol with a short message (not the tensors' reprs)."""
    err = rel_err(ours, ref)
    if not err <= tol:
        where = ""
        if ours.dim() >= 1 and ours.shape == ref.shape:
            diff = (ours.double() - ref.double()).abs()
            where = f"; worst at index {tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))}"
        raise AssertionError(f"{what + ': ' if what else ''}relative error {err:.3g} > {tol:g}{where}")


def static_target_graphs(runner, widths: tuple[int, ...], max_bs: int, run_steps: int = 1):
    """A TargetGraphRunner without graphs: every "replay" runs the captured code eagerly on the static
    buffers (CPU: no capture), so the replay-driving code around it — staging, advancing inputs on the
    device — can be tested without a GPU. Needs a graph backend on ``runner`` (TritonGraphBackend under
    TRITON_INTERPRET)."""
    from tandem.engine.cuda_graph import TargetGraphRunner

    graphs = TargetGraphRunner(runner, widths=widths, max_bs=max_bs, use_graphs=False, run_steps=run_steps)
    graphs.run_statically()
    return graphs


class TorchGraphBackend(StaticAttention):
    """The graph backend's contract — static slots, block tables, lengths, a tree mask over the last
    keys (GraphMeta) — in static-shape torch (tandem.speculative.draft_static.torch_paged_attention, the
    Triton kernel's reference, with rotary and the K/V store as torch ops). For CPU tests whose subject
    is the code around the target's replays, not its attention: interpreted Triton rotary and attention
    would take most of their time. The Triton kernels keep their own tests (test_kernels.py,
    test_graph_static_path.py)."""

    name = "torch-graph"

    def __init__(self):
        super().__init__("torch")

    def forward(self, q, k, v, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
        static = StaticMeta(meta.block_tables, meta.kv_lens, meta.slot_mapping, meta.tree_mask)
        return super().forward(q, k, v, k_pool, v_pool, static, scale)


def run_tp_jobs(jobs: list[dict], work, timeout_s: float, what: str) -> list:
    """Run ``jobs`` through tests/tp_runner.py in a process group of its own (the runner and the TP ranks
    it spawns are killed together on a hang); → the runner's results, one per job."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    (work / "spec.json").write_text(json.dumps(jobs))
    runner = Path(__file__).resolve().parent / "tp_runner.py"
    proc = subprocess.Popen([sys.executable, str(runner), str(work / "spec.json"), str(work / "out.pt")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s} s (hang?); its output:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{what} failed (rc {proc.returncode}):\n{log[-4000:]}"
    return torch.load(work / "out.pt")


def capture_graph(fn):
    """Warm ``fn`` up on a side stream (compiles its kernels), then capture one call in a CUDA graph →
    (the graph, what the captured call returned: its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def moe_triton_route(monkeypatch, on: bool) -> None:
    """The MoE layer's and its router's GPU route forced on or off (each module reads ``use_triton``)."""
    from tandem.layers import moe, moe_router

    for module in (moe, moe_router):
        monkeypatch.setattr(module, "use_triton", lambda t: on)
