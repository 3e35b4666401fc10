"""The drafter's prompt-extend graphs: a prompt (or a chunk of one) extended into the EAGLE-3 head — a new
request's, or one going on from where its last extend left it — replays one graph instead of launching every
kernel of an eager extend from the host (tandem.speculative.draft_graph, "draft_prompt" family).

One member per width of the target's prefill graphs (tandem.prefill_shapes: 16, 32, ... ``prefill_graph_tokens``),
captured at buckets 1, 2, ... ``prefill_graph_max_bs``, on the runner's static buffers (sized for its widest
family). A graph runs ``static_extend`` at its width: each request's tokens first, then padding (unlike the
target's left-padded prefill chunks), so causal attention keeps the padding invisible to the real rows; the
state and top-k come from each request's last real row, and a committed length of 0 (a new request) is
just a prefix of 0.

Pages are reserved for the real tokens only, as the eager extend reserves them: the block-table columns past
a request's pages hold the dummy page, so the padded tail writes its KV into the request's own page past its
committed length (scratch, as after a draft) or into the dummy page, never into another request's page.

A batch comes here when the draft-extend graph (already-extended requests, ``num_steps + 1`` tokens at most)
does not take it: the narrowest width holding its longest item, the bucket holding its requests, and the
padding within the target's prefill graphs' bound (``padding_fits``); anything else extends eagerly.
"""

from __future__ import annotations

import torch

from tandem.prefill_shapes import padding_fits, prefill_buckets

PROMPT = "prompt"  # a member is (PROMPT, width)


def is_prompt_member(member) -> bool:
    return isinstance(member, tuple) and member[0] == PROMPT


class PromptFamilies:
    """The prompt-extend widths and buckets of one DraftGraphRunner (none when ``widths`` is empty)."""

    def __init__(self, widths: tuple[int, ...], max_bs: int):
        self.widths = tuple(sorted(set(widths)))
        self.buckets = prefill_buckets(max_bs) if self.widths else []
        self.members = [(PROMPT, w) for w in self.widths]

    @property
    def max_bs(self) -> int:
        return self.buckets[-1] if self.buckets else 0

    @property
    def max_width(self) -> int:
        return self.widths[-1] if self.widths else 0

    def choose(self, counts: list[int]) -> tuple[int, int] | None:
        """(width, bucket) for items of ``counts`` tokens, or None when no family takes them."""
        bs = next((b for b in self.buckets if b >= len(counts)), None)
        width = next((w for w in self.widths if w >= max(counts)), None)
        if bs is None or width is None or not padding_fits(bs, width, sum(counts)):
            return None
        return width, bs


def extend_prompts(runner, reqs: list, prefixes: list[int], items: list) -> bool:
    """Extend ``items`` (the drafter's ``(rid, tokens, features)``) of ``reqs`` at their committed ``prefixes``
    (0: a new request) on a prompt-extend graph of ``runner``; False when none takes the batch (the caller
    extends eagerly). On True each request holds what the eager extend leaves: committed length, root, state
    and top-k (registering a new request is the caller's)."""
    counts = [len(tokens) for _, tokens, _ in items]
    chosen = runner.prompts.choose(counts) if items else None
    if chosen is None:
        return False
    width, bs = chosen
    ps, limit = runner.page_size, runner.max_pages * runner.page_size
    if any(p + c > runner.head.max_positions or p + width > limit for p, c in zip(prefixes, counts)):
        return False
    span = -(-max(p + width for p in prefixes) // ps)  # block-table columns the padded rows reach: dummy past the pages
    for r, p, c in zip(reqs, prefixes, counts):
        r.kv.reserve(p + c)  # as the eager extend (the caller checked the free pages)
    try:
        states, top_logp, top_ids = replay_extend_items(runner, (PROMPT, width), width, bs, reqs, prefixes, items, span)
    except BaseException:
        for r, p in zip(reqs, prefixes):
            r.kv.truncate(p)
        raise
    for b, (r, p, c, (_, tokens, _)) in enumerate(zip(reqs, prefixes, counts, items)):
        r.kv.commit(p + c)
        r.root, r.state, r.top_logp, r.top_ids = tokens[-1], states[b], top_logp[b], top_ids[b]
    runner.replays["draft_prompt"] += 1
    return True


def replay_extend_items(runner, member, w: int, bs: int, reqs: list, prefixes: list[int], items: list,
                        cols: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage ``items`` at ``w`` tokens a request (its own first, then padding with zero features: finite K/V in
    the scratch) in ``runner``'s static buffers and replay its extend ``member`` (the draft-extend's or a
    prompt width's) at bucket ``bs`` → fresh copies (the next replay overwrites the static outputs) of each
    request's state, top-k log-probs and ids. ``cols``: block-table columns to stage at least."""
    n, counts = len(items), [len(tokens) for _, tokens, _ in items]
    heads = [[p, c, *tokens, *[0] * (w - c)] for p, c, (_, tokens, _) in zip(prefixes, counts, items)]
    dest = [b * w + i for b, c in enumerate(counts) for i in range(c)]  # feature rows of real tokens
    tokens, dest_dev = runner._stage(bs, heads, [r.kv.page_table(copy=False) for r in reqs], 1, dest, cols)
    runner.token_ids[: bs * w].copy_(tokens)
    runner.features[: bs * w].zero_()
    runner.features.index_copy_(0, dest_dev, torch.cat([f.to(runner.device, runner.dtype, non_blocking=True)
                                                        for _, _, f in items]))
    family = "draft_prompt" if is_prompt_member(member) else "draft_extend"
    with runner.guard(f"Replay {family} cuda graph w={w} bs={bs}"):
        runner._launch(member, bs)
    return runner.out_state[:n].clone(), runner.out_logp[:n].clone(), runner.out_ids[:n].clone()
