"""Sparsefinder's predicted attention graph Ĝ (plain torch): the groups of projected queries and keys, the
window and the global tokens, as a dense mask (measuring) or as gathered key positions (the gathered fast path).

Treviso et al., "Predicting Attention Sparsity in Transformers", SPNLP 2022 (arXiv 2109.12188), section 3; the
options are those of ``SparsefinderConfig`` (``sparsefinder.py``), whose docstring describes the groupings.
"""

from __future__ import annotations

import torch


def bucket_ids(qp, kp, key_mask, buckets: int):
    """Per projected dimension, bucket ids of queries (B, H, N, r) and keys (B, H, S, r): the boundaries are
    the (m / buckets)-quantiles of the real keys' values, so every bucket holds about S_real / buckets keys."""
    b, h, s, r = kp.shape
    n_real = torch.full((b,), s, device=kp.device) if key_mask is None else key_mask.sum(-1)  # (B,)
    pad = None if key_mask is None else ~key_mask[:, None, :, None]
    ks = kp if pad is None else kp.masked_fill(pad, float("inf"))
    ks = ks.sort(dim=2).values  # (B, H, S, r), padded keys last
    m = torch.arange(1, buckets, device=kp.device)
    pos = (m[None, :] * n_real[:, None]) // buckets  # (B, buckets - 1)
    pos = pos.clamp(max=s - 1)[:, None, :, None].expand(b, h, buckets - 1, r)
    bounds = ks.gather(2, pos).transpose(-1, -2).contiguous()  # (B, H, r, buckets - 1)
    q_ids = torch.searchsorted(bounds, qp.transpose(-1, -2).contiguous(), right=True).transpose(-1, -2)
    k_ids = torch.searchsorted(bounds, kp.transpose(-1, -2).contiguous(), right=True).transpose(-1, -2)
    return q_ids, k_ids


# rows of queries / keys whose centroid distances are held at a time in cluster_ids (with B ~ sqrt(N) clusters a
# whole (B, H, N, C) distance matrix would grow as N^1.5: 100 MB at N = 16384)
_ID_ROWS = 4096


def cluster_ids(qp, kp, centroids, top_clusters: int):
    """Each key's nearest centroid (B, H, S, 1) and each query's ``top_clusters`` nearest (B, H, N, t)."""
    c = centroids.to(qp.dtype)[None]  # (1, H, C, r)

    def blocks(x: torch.Tensor, pick) -> torch.Tensor:
        cx = c.expand(x.shape[0], -1, -1, -1)
        return torch.cat([pick(torch.cdist(x[:, :, i : i + _ID_ROWS], cx)) for i in range(0, x.shape[2], _ID_ROWS)], 2)

    q_ids = blocks(qp, lambda dist: dist.topk(top_clusters, dim=-1, largest=False).indices)
    return q_ids, blocks(kp, lambda dist: dist.argmin(-1, keepdim=True))


def group_ids(qp, kp, key_mask, config, state):
    """Group ids: queries (B, H, N, G) in G slots, keys (B, H, S, T) in T tables, the table of each slot and
    the number of ids per table. Bucketing: slot m = table m = dimension m; kmeans: every slot reads table 0."""
    if config.grouping == "bucketing":
        q_ids, k_ids = bucket_ids(qp, kp, key_mask, config.buckets)
        return q_ids, k_ids, list(range(q_ids.shape[-1])), config.buckets
    q_ids, k_ids = cluster_ids(qp, kp, state["centroids"], config.top_clusters)
    return q_ids, k_ids, [0] * q_ids.shape[-1], config.clusters


def global_rows(key_mask, n: int, s: int, config, device):
    """Global positions: (B, S) bool, the first ``global_tokens`` and optionally the last real token."""
    pos = torch.arange(s, device=device)
    glob = (pos < config.global_tokens)[None].expand(1 if key_mask is None else key_mask.shape[0], s)
    if config.last_token:
        last = (s - 1) if key_mask is None else key_mask.sum(-1, keepdim=True) - 1  # (B, 1)
        glob = glob | (pos[None] == torch.as_tensor(last, device=device).reshape(-1, 1))
    return glob


def reach(config) -> int:
    """Largest |i - j| joined by the window; -1 when there is no window (``window=0``)."""
    return config.window if config.window > 0 else -1


def predicted_mask(qp, kp, key_mask, rows: slice, config, state, groups=None):
    """The predicted graph for the query rows ``rows`` as a dense (B, H, rows, S) bool mask (measuring only)."""
    b, h, n, _ = qp.shape
    s = kp.shape[2]
    i = torch.arange(n, device=qp.device)[rows]
    j = torch.arange(s, device=qp.device)
    if config.grouping == "distance":
        mask = torch.cdist(qp[:, :, rows], kp) <= config.threshold
    else:
        q_ids, k_ids, tables, _ = groups if groups is not None else group_ids(qp, kp, key_mask, config, state)
        mask = torch.zeros(b, h, len(i), s, dtype=torch.bool, device=qp.device)
        for m, t in enumerate(tables):
            mask |= q_ids[:, :, rows, m, None] == k_ids[:, :, None, :, t]
    mask = mask | ((i[:, None] - j[None, :]).abs() <= reach(config))
    glob = global_rows(key_mask, n, s, config, qp.device)  # (B, S)
    mask = mask | glob[:, None, None, :] | glob[:, None, rows, None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    return mask


def group_entries(q_ids, k_ids, tables, n_ids, key_mask, rows: slice):
    """Gathered key positions (B, H, rows, G * W) of each query's groups, and which entries are real.

    Keys are sorted by (table, id): the keys of id c in table t are a contiguous run of the sorted list.
    A key found again in a later slot (bucketing: a second shared dimension) is counted once."""
    b, h, s, n_tab = k_ids.shape
    dev = k_ids.device
    gid = k_ids + torch.arange(n_tab, device=dev) * n_ids  # (B, H, S, T)
    if key_mask is not None:  # padded keys go to an id no query has
        gid = gid.masked_fill(~key_mask[:, None, :, None], n_tab * n_ids)
    flat = gid.transpose(-1, -2).reshape(b, h, n_tab * s)  # entry e = t * S + position
    order = flat.argsort(dim=-1, stable=True)  # (B, H, T*S)
    counts = torch.zeros(b, h, n_tab * n_ids + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(-1, flat, torch.ones_like(flat))
    starts = counts.cumsum(-1) - counts
    width = int(counts[..., :-1].max()) if n_tab * n_ids else 0
    qg = q_ids[:, :, rows] + torch.tensor(tables, device=dev) * n_ids  # (B, H, r, G)
    start, count = starts.gather(-1, qg.flatten(2)), counts.gather(-1, qg.flatten(2))  # (B, H, r*G)
    ar = torch.arange(width, device=dev)
    slot_pos = start[..., None] + ar  # (B, H, r*G, W)
    valid = ar < count[..., None]
    slot_pos = slot_pos.clamp(max=n_tab * s - 1)
    pos = order.gather(-1, slot_pos.flatten(2)).reshape(slot_pos.shape) % s  # key positions
    nr, g = qg.shape[2], qg.shape[3]
    pos, valid = pos.reshape(b, h, nr, g * width), valid.reshape(b, h, nr, g * width)
    # dedupe across slots: entry of slot m is dropped when an earlier slot m' already holds the key
    for m in range(1, g):
        sl = slice(m * width, (m + 1) * width)
        kt = k_ids.gather(2, pos[..., sl].flatten(2)[..., None].expand(-1, -1, -1, n_tab))
        kt = kt.reshape(b, h, nr, width, n_tab)
        for m2 in range(m):
            valid[..., sl] &= kt[..., tables[m2]] != q_ids[:, :, rows, m2, None]
    return pos, valid


def in_groups(pos, q_ids, k_ids, tables, rows):
    """(B, H, r, E) bool: key ``pos`` shares a group with its query (so it is already an entry)."""
    b, h, nr, e = pos.shape
    kt = k_ids.gather(2, pos.flatten(2)[..., None].expand(-1, -1, -1, k_ids.shape[-1])).reshape(
        b, h, nr, e, k_ids.shape[-1]
    )
    hit = torch.zeros(b, h, nr, e, dtype=torch.bool, device=pos.device)
    for m, t in enumerate(tables):
        hit |= kt[..., t] == q_ids[:, :, rows, m, None]
    return hit


def entries(qp, kp, key_mask, rows: slice, config, state, groups):
    """Key positions (B, H, rows, E) of each query's predicted edges and which are real (each key once)."""
    b, h, n, _ = qp.shape
    s, dev = kp.shape[2], qp.device
    if config.grouping == "distance":  # O(rows * S) by nature: compact the block's mask
        mask = predicted_mask(qp, kp, key_mask, rows, config, state)
        width = max(int(mask.sum(-1).max()), 1)
        pos = (~mask).to(torch.uint8).argsort(dim=-1, stable=True)[..., :width]
        return pos, mask.gather(-1, pos)
    q_ids, k_ids, tables, n_ids = groups
    gpos, gvalid = group_entries(q_ids, k_ids, tables, n_ids, key_mask, rows)
    i = torch.arange(n, device=dev)[rows]
    w = min(reach(config), s - 1)
    offsets = torch.arange(-w, w + 1, device=dev) if w >= 0 else torch.zeros(0, dtype=torch.long, device=dev)
    wpos = (i[:, None] + offsets).expand(b, h, -1, -1)  # (B, H, r, 2w+1)
    wvalid = (wpos >= 0) & (wpos < s)
    wpos = wpos.clamp(0, s - 1)
    wvalid = wvalid & ~in_groups(wpos, q_ids, k_ids, tables, rows)
    glob = global_rows(key_mask, n, s, config, dev)  # (B, S)
    n_glob = int(glob.sum(-1).max())
    gl = glob.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[:, :n_glob]  # (B, n_glob)
    glpos = gl[:, None, None, :].expand(b, h, len(i), n_glob)
    glvalid = glob.gather(-1, gl)[:, None, None, :].expand(b, h, len(i), n_glob).clone()
    glvalid &= ~in_groups(glpos, q_ids, k_ids, tables, rows) & ((glpos - i[:, None]).abs() > w)
    pos = torch.cat([gpos, wpos, glpos], dim=-1)
    valid = torch.cat([gvalid, wvalid, glvalid], dim=-1)
    if key_mask is not None:
        valid &= key_mask.gather(-1, pos.flatten(1)).reshape(pos.shape)
    return pos, valid
