"""The functions a ``score_mod`` / ``mask_mod`` may call (FlexAttention's meaning).

``cupyflash.attention(q, k, v, score_mod=..., mask_mod=...)`` traces the two plain Python
functions once into expressions; inside them, use these in place of NumPy's or torch's (they
record on traced values and run the array namespace's own function on arrays)::

    from cupyflash import mods

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * mods.tanh(score / 30.0)

    def document(b, h, q_idx, kv_idx):  # doc_id: a captured (N,) integer array
        return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)

A function may call others (``and_masks`` / ``or_masks`` combine masks, as FlexAttention's do):
the arrays they capture are traced through it.
"""

from ._mods import (
    abs,
    and_masks,
    exp,
    log,
    maximum,
    minimum,
    or_masks,
    tanh,
    trace_mask_mod,
    trace_score_mod,
    where,
)

__all__ = [
    "abs",
    "and_masks",
    "exp",
    "log",
    "maximum",
    "minimum",
    "or_masks",
    "tanh",
    "trace_mask_mod",
    "trace_score_mod",
    "where",
]
