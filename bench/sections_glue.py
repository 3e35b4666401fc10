"""Benchmark section ``round_glue``: a queued chain round's device glue (the work between its graph
replays: staging the verify, accepting, feeding the extend and the next draft) as three Triton kernels
(tandem/kernels/round_glue.py) against the ~40 torch ops it replaces, chain of 3 at accept length 4,
batch 1 and 8, the two alternated three times (best of each).

The switch is the benchmark's own: it swaps chain_rounds' fused round for its torch round for the
torch runs (the engine picks the fused one whenever the tensors are on the GPU)."""

from __future__ import annotations

from measure import free_gpu, rate_for
from sections_overlap import _steered_batch, chain_setup


def round_glue(ctx: dict) -> dict:
    from tandem.speculative import chain_rounds

    engine, drafter, spec, prompts, params = chain_setup(ctx)
    fused_round = chain_rounds._fused_round
    rows = []
    try:
        for bs in (1, 8):
            batch = prompts[:bs]
            target_only = [r.output_token_ids for r in engine.generate(batch, params, spec=None)]
            reference, _, _ = _steered_batch(engine, drafter, spec, batch, params, 1.0, target_only)
            best, same = {"fused": 0.0, "torch": 0.0}, {"fused": True, "torch": True}
            for _ in range(3):
                for glue in ("fused", "torch"):
                    chain_rounds._fused_round = fused_round if glue == "fused" else chain_rounds._torch_round
                    outputs, tok_s, _ = _steered_batch(engine, drafter, spec, batch, params,
                                                       rate_for(4.0, spec.num_steps), reference)
                    best[glue] = max(best[glue], tok_s)
                    same[glue] &= outputs == reference
            row = {"batch": bs, "spec_rounds": engine.spec_rounds, "fused_tok_s": best["fused"],
                   "torch_tok_s": best["torch"], "gain": best["fused"] / best["torch"] - 1,
                   "identical_to_reference": same}
            rows.append(row)
            print(f"round glue batch {bs}: fused {best['fused']:8.1f} tok/s, torch ops {best['torch']:8.1f} tok/s "
                  f"({100 * row['gain']:+.1f} %); same tokens as the reference: {same}", flush=True)
    finally:
        chain_rounds._fused_round = fused_round
    engine.proposer = None
    engine.shutdown()
    del engine, drafter
    free_gpu()
    return {"rows": rows}
