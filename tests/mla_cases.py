"""Latent-attention cases for the MLA kernel tests (CPU interpreter and GPU): a paged latent pool of
random entries over shuffled pages and the AttentionMetadata of a batch whose sequences each bring
``q_len`` new tokens after ``prefix_len`` cached ones, causal or under a tree mask."""

from __future__ import annotations

import torch

from tandem.attention.metadata import AttentionMetadata


def branching_tree(parents: list[int], older: int = 0) -> torch.Tensor:
    """Bool ``[n, older + n]``: node i sees its ancestors and itself among the new nodes, and every one
    of ``older`` tree nodes before them when ``older`` > 0 (a multi-step draft's earlier nodes)."""
    n = len(parents)
    mask = torch.zeros(n, older + n, dtype=torch.bool)
    for i in range(n):
        mask[i, :older] = True
        j = i
        while j >= 0:
            mask[i, older + j] = True
            j = parents[j]
    return mask


def latent_case(seqs: list[tuple[int, int, torch.Tensor | None]], heads: int, kv_lora: int, rope: int,
                page_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                num_pages: int | None = None) -> dict:
    """``seqs``: (prefix_len, q_len, tree mask or None) per sequence → dict with q [T, H, kv_lora + rope],
    pool [pages, page_size, 1, kv_lora + rope] (``num_pages``: a fixed size, else 3 spare pages), meta, scale."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-(p + q) // page_size) for p, q, _ in seqs]
    num_pages = num_pages or 1 + sum(pages_per_seq) + 3  # page 0 stays the dummy page, as in the engine
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(pages_per_seq), dtype=torch.int32)
    slots, cu = [], [0]
    for i, ((prefix, q_len, _), n) in enumerate(zip(seqs, pages_per_seq)):
        tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        keys = torch.arange(prefix, prefix + q_len)
        slots.append(tables[i, keys // page_size].long() * page_size + keys % page_size)
        cu.append(cu[-1] + q_len)
    width = kv_lora + rope
    pool = torch.randn(num_pages, page_size, 1, width, generator=gen).to(dtype)
    q = (torch.randn(cu[-1], heads, width, generator=gen) * 0.5).to(dtype)
    meta = AttentionMetadata(
        q_lens=[q for _, q, _ in seqs], prefix_lens=[p for p, _, _ in seqs],
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        kv_lens=torch.tensor([p + q for p, q, _ in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.cat(slots).to(device),
        tree_masks=[m for _, _, m in seqs], page_size=page_size)
    scale = (128 + 64) ** -0.5 * 1.8133  # Kimi's: (nope + rope)^-1/2 times YaRN's mscale²
    return {"q": q.to(device), "pool": pool.to(device), "meta": meta, "scale": scale, "kv_lora": kv_lora}


def torch_reference(case: dict) -> torch.Tensor:
    """The torch MLA backend's absorbed attention over the case (the reference the kernel must equal)."""
    from tandem.attention.mla_torch_backend import TorchMLABackend

    backend = TorchMLABackend()
    backend.plan(case["meta"])
    return backend.forward_absorbed(case["q"], case["pool"], case["meta"], case["scale"], case["kv_lora"])
