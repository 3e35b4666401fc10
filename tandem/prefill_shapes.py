"""The shapes of graphed prompt chunks, shared by the target's prefill graphs (tandem.engine.prefill_graphs)
and the drafter's prompt-extend graphs (tandem.speculative.draft_prompt_graphs): the widths a chunk pads
to, the batch buckets, the bound on padding, and the defaults of the two flags that size them
(``--prefill-graph-tokens``, ``--prefill-graph-max-bs``: EngineConfig and DrafterConfig both read them here).

Torch-free: the flags' definitions (tandem.args) import EngineConfig, which reads the defaults.
"""

from __future__ import annotations

PREFILL_GRAPH_TOKENS = 128  # --prefill-graph-tokens: the widest graphed chunk; 0 = none
PREFILL_GRAPH_MAX_BS = 8  # --prefill-graph-max-bs: most chunks in one graphed batch

NARROWEST = 16  # a shorter chunk pads to 16 rows: nothing on a GPU, and fewer families to capture
# A batch whose padded rows pass both MAX_PADDING times its real ones and FREE_ROWS runs eagerly: on a large
# model padded rows are compute (8 x 128 rows cost an 8B target ~25 ms, more than the launches a graph saves),
# while a few hundred rows cost little beside reading the weights once.
MAX_PADDING = 2
FREE_ROWS = 256


def prefill_widths(max_tokens: int) -> tuple[int, ...]:
    """The chunk widths captured: 16, 32, ... below ``max_tokens``, then ``max_tokens``; () when 0 (off)."""
    if max_tokens <= 0:
        return ()
    widths, w = [], min(NARROWEST, max_tokens)
    while w < max_tokens:
        widths.append(w)
        w *= 2
    return tuple(widths + [max_tokens])


def prefill_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, ... then ``max_bs``: few graphs per width (capture time), at most twice the sequences."""
    sizes = [1]
    while sizes[-1] * 2 < max_bs:
        sizes.append(sizes[-1] * 2)
    return sorted(set(sizes + [max(1, max_bs)]))


def padding_fits(bucket: int, width: int, real_tokens: int) -> bool:
    """Whether ``bucket`` chunks padded to ``width`` rows stay within the padding bound (MAX_PADDING, FREE_ROWS)
    for ``real_tokens`` real rows."""
    return bucket * width <= max(MAX_PADDING * real_tokens, FREE_ROWS)
