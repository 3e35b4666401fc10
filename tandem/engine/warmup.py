"""Warm-up: before a service says SERVING, run what requests will run, and time it.

A first request must not pay for kernel compilation or a graph's first launch, and the speculation
policy must know from the first request what a plain step and a speculative round cost at each batch
size (tandem.speculative.policy). So the engine generates a few tokens from random prompts at batch
sizes 1, 2, 4, ... up to its largest graph bucket — each batch's prompts together as long as a step
admits (``--chunked-prefill-size``: the largest prefill and drafter extend a request mix can make, whose
kernels compile by size) — once with every step plain and once with every step
speculative for each chain the policy may draft (the configured one, and each shorter one where it shortens
chains at batch: tandem.speculative.chain_depth; the drafter's real graphs and kernels; random prompts accept
little, which does not matter for timing), greedy — the runs of queued steps and rounds — and a lone short prompt
of each graphed prefill width, then once sampled, and once with prompts
arriving while others speculate (a prefill and verified trees in one forward: masked attention kernels
that compile on first use). Plain steps are also timed without the drafter: what attached ones cost over them (a
drafter service's ship every token's features; an in-process head's hold them, which on a small target at batch was a
fifth of a step: bench/detached_plain.py) widens the margin within which the policy probes detached plain steps
(tandem.speculative.goodput, ``take_probe``; an in-process head's only where that tax is measured). The policy keeps
the step times and forgets the rounds' acceptance. A chain that ran no queued run of rounds at a batch size (its first
would be met while serving) is named in a warning.
"""

from __future__ import annotations

import logging
import time

import torch

from tandem.prefill_shapes import prefill_widths
from tandem.sampling import SamplingParams

log = logging.getLogger("tandem.engine")
WARMUP_MIN_PROMPT_TOKENS = 32
WARMUP_NEW_TOKENS = 48  # a dozen timed runs of queued steps or rounds at each batch size


class _Forced:
    """A stand-in for the engine's policy that decides every step one way; the step times go to the real
    policy (``record``), the rounds nowhere."""

    plain_reason = "warm-up"  # (the engine's stats tally plain steps by the policy's reason)

    def __init__(self, policy, speculate: bool, record: bool, chain=None, detached: bool = False):
        """``chain``: the SpecConfig speculative steps draft (None: the configured one); ``detached``: the steps run
        without the drafter (their times kept apart)."""
        self.policy, self.speculate, self.record, self.chain = policy, speculate, record, chain
        self.detached = detached
        self.queued_runs: set[tuple[int, int]] = set()  # (batch size, verify width) of the runs of rounds seen

    def decide(self, batch_size, drafting, runs=None) -> bool:
        return self.speculate and bool(drafting)

    def chain_spec(self, batch_size, spec):
        return self.chain or spec

    def observe_step(self, batch_size, speculative, steps=1, *args, **kwargs) -> None:
        if speculative and steps > 1:
            self.queued_runs.add((batch_size, kwargs.get("width")))
        if self.record:
            self.policy.observe_step(batch_size, speculative, steps, *args, detached=self.detached, seeded=True,
                                     **kwargs)

    def observe_steps(self, batch_size, speculative, runs, *args, **kwargs) -> None:
        for steps, seconds in runs:
            self.observe_step(batch_size, speculative, steps, seconds, *args, **kwargs)

    def observe_round(self, state, tokens, depth=None) -> None:
        pass

    def observe_arrivals(self, prompt_tokens: int, seconds: float) -> None:
        if self.record:  # the drafter's extension speed is the hardware's; the warm-up's prompts are not traffic
            self.policy.observe_arrivals(prompt_tokens, seconds)

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        pass

    def observe_goodput(self, batch_size, speculative, tokens, seconds, detached=False) -> None:
        pass  # the warm-up's forced modes and random prompts say nothing of the traffic's goodput

    def observe_goodput_steps(self, batch_size, speculative, steps, detached=False) -> None:
        pass

    def plain_measured_faster(self, batch_size) -> bool:
        return False  # (nothing detaches during the warm-up)

    def learning_rounds_left(self) -> int:
        return 0  # (the warm-up times runs of rounds)

    def probe_detached(self, batch_size, ships_features=True) -> bool:
        return False

    def measured_lead(self, batch_size) -> None:
        return None

    def speculation_favoured(self, batch_size) -> bool:
        return False


def warmup_batch_sizes(max_bs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_bs:
        sizes.append(b)
        b *= 2
    return sizes + [max_bs]


def _arrive_while_speculating(engine, batch_size: int, g: torch.Generator, sampled: SamplingParams) -> None:
    """Half the batch (greedy) prefills and speculates; then the other half (sampled) arrives."""
    vocab, n = engine.model_config.vocab_size, _prompt_tokens(engine, batch_size)
    first = batch_size // 2
    greedy = SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS, ignore_eos=True)
    rids = [engine.add_request(torch.randint(0, vocab, (n,), generator=g).tolist(), greedy) for _ in range(first)]
    for _ in range(2):
        engine.step()
    rids += [engine.add_request(torch.randint(0, vocab, (n,), generator=g).tolist(), sampled)
             for _ in range(batch_size - first)]
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.requests.pop(rid)


def _prompt_tokens(engine, batch_size: int) -> int:
    """Prompt length at ``batch_size``: the batch's prompts fill one step's prefill budget, within the
    context (room left for the new tokens and a round's tree) and the KV cache."""
    cfg, context = engine.cfg, engine.context_len
    room = min(context - WARMUP_NEW_TOKENS - 16,
               engine.allocator.capacity_pages * cfg.page_size // batch_size - WARMUP_NEW_TOKENS - 16)
    return max(1, min(max(WARMUP_MIN_PROMPT_TOKENS, engine.scheduler.prefill_budget // batch_size), room))


def _short_prompt_lengths(engine) -> list[int]:
    """A prompt length that pads to each graphed prefill width (tandem.prefill_shapes): the batch sizes' prompts
    above fill a step's prefill budget, longer than any graphed width at batch 1, so a first short prompt (a
    chat turn) would otherwise be the first to run the host work around those graphs at their shapes."""
    widths = prefill_widths(engine.cfg.prefill_graph_tokens)
    return [max(1, w - 3) for w in widths if w - 3 + WARMUP_NEW_TOKENS < engine.context_len]


@torch.inference_mode()
def warm_up(engine, batch_sizes: list[int] | None = None) -> dict[str, float]:
    """Run the warm-up (see the module's docstring) on ``engine``, which must be idle; → seconds per part."""
    graphs = engine.executor.runner.graphs
    sizes = batch_sizes or warmup_batch_sizes(graphs.max_bs if graphs is not None else 1)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    policy, took = engine.policy, {}
    # each chain the policy may shorten to (shortest first), the configured one last
    chains = policy.ladder(engine.default_spec) if engine.default_spec is not None else ()
    modes = [("plain", False, True, None)] + [
        ("speculative" if chain is chains[-1] else f"speculative (chain of {chain.num_steps})", True, True, chain)
        for chain in chains]
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, ignore_eos=True)
    unqueued = []  # (speculative chains whose rounds the warm-up never ran queued at a batch size)
    engine.attachment.pause()  # both kinds of step are forced here: nothing to detach from
    try:
        for name, speculate, greedy, chain in modes + [("sampled", engine.default_spec is not None, False, None)]:
            started = time.perf_counter()
            engine.policy = _Forced(policy, speculate, record=greedy, chain=chain)
            params = SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS, ignore_eos=True) if greedy else sampled
            for bs in (sizes if greedy else sizes[:1] + sizes[-1:]):
                n = _prompt_tokens(engine, bs)
                engine.generate([torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(bs)], params)
                if speculate and greedy and graphs is not None and engine.spec_rounds > 1:
                    width = (chain or engine.default_spec).num_draft_tokens
                    if (bs, width) not in engine.policy.queued_runs:  # (its first run would meet it while serving)
                        unqueued.append(f"{width} wide at batch {bs}")
            if greedy:  # a lone short prompt of each graphed prefill width (and the drafter's extend of it)
                for n in _short_prompt_lengths(engine):
                    engine.generate([torch.randint(0, vocab, (n,), generator=g).tolist()],
                                    SamplingParams(max_new_tokens=4, ignore_eos=True))
            took[name] = time.perf_counter() - started
        if engine.default_spec is not None and engine.proposer is not None:
            started = time.perf_counter()  # plain steps without the drafter: what a probe compares (see the module)
            engine.policy = _Forced(policy, False, record=True, detached=True)
            engine.attachment.hold_detached()
            for bs in sizes:
                engine.generate([torch.randint(0, vocab, (_prompt_tokens(engine, bs),), generator=g).tolist()
                                 for _ in range(bs)], SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS, ignore_eos=True))
            engine.attachment.reset()
            took["plain (drafter detached)"] = time.perf_counter() - started
        if engine.default_spec is not None:  # a prompt arriving while others speculate: one eager forward of
            started = time.perf_counter()    # a prefill beside verified trees (masked attention kernels)
            engine.policy = _Forced(policy, True, record=False)
            for bs in {max(2, sizes[0]), max(2, sizes[-1])}:
                _arrive_while_speculating(engine, bs, g, sampled)
            took["arrivals"] = time.perf_counter() - started
    finally:
        engine.policy = policy
        engine.attachment.resume()
    policy.forget_traffic()
    engine.attachment.reset()
    log.info("warm-up done in %.1f s (%s) at batch sizes %s", sum(took.values()),
             ", ".join(f"{k} {v:.1f} s" for k, v in took.items()), sizes)
    if unqueued:
        log.warning("warm-up ran no queued run of rounds %s: the first such run will be its first use",
                    ", ".join(unqueued))
    if engine.default_spec is not None:  # what the policy starts from: ms per plain step / per round
        widths = [chain.num_draft_tokens for chain in chains]
        log.info("step costs seeded (ms, plain / round %s wide): %s", " / ".join(map(str, widths)), ", ".join(
            f"batch {bs} {_ms(policy.step_time(bs, False))} / "
            + " / ".join(_ms(policy.step_time(bs, True, width=w)) for w in widths) for bs in sizes))
    return took


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"
