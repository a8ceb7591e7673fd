"""The tests' oracle: attention written with torch's own operations in float64, from the
definitions of docs/design.md section 1 (nothing from attncore), differentiable by torch autograd."""

import torch


def attention(q, k, v, *, scale=None, causal=None, window=(-1, -1), softcap=0.0, alibi=None,
              mask=None, keep=None, dropout_p=0.0):
    """(out [..., Hq, Lq, Dv], lse [..., Hq, Lq]) of q [..., Hq, Lq, D], k [..., Hkv, Lk, D],
    v [..., Hkv, Lk, Dv] in float64. alibi: [Hq] or [..., Hq]; mask broadcastable to
    [..., Hq, Lq, Lk] (bool: True takes part; else added); keep: the dropout keep mask
    [..., Hq, Lq, Lk] (bool). Rows that see no key give out 0 and lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    heads_q, seqlen_q, dim = q.shape[-3:]
    heads_kv, seqlen_k = k.shape[-3], k.shape[-2]
    k = k.repeat_interleave(heads_q // heads_kv, dim=-3)
    v = v.repeat_interleave(heads_q // v.shape[-3], dim=-3)  # (torch: Hv may differ from Hk)
    s = (q @ k.transpose(-1, -2)) * (dim ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(seqlen_q, dtype=torch.float64)[:, None]
    j = torch.arange(seqlen_k, dtype=torch.float64)[None, :]
    diag = i + seqlen_k - seqlen_q  # the lower-right diagonal
    if alibi is not None:
        s = s - alibi.double()[..., None, None] * (diag - j).abs()
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal == "upper-left":
        allowed &= j <= i
    if causal == "lower-right":
        allowed &= j <= diag
    if window[0] >= 0:
        allowed &= j >= diag - window[0]
    if window[1] >= 0:
        allowed &= j <= diag + window[1]
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        s = s + mask.double()
    s = torch.where(allowed, s, torch.tensor(-torch.inf, dtype=torch.float64))
    seen = (s > -torch.inf).any(-1, keepdim=True)
    s = torch.where(seen, s, torch.zeros((), dtype=torch.float64))  # no NaN from empty rows
    p = torch.softmax(s, -1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(s, -1),
                      torch.tensor(-torch.inf, dtype=torch.float64))
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ v, lse
