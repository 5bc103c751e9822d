"""transformers: cupyflash as an attention implementation of any model that dispatches through
``AttentionInterface`` (Llama, Mistral, Qwen2, Gemma2 ...)::

    from cupyflash.integrations import transformers as cft
    name = cft.register()                       # "cupyfa"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` installs the attention function and, under the same name, transformers' own 2-D
padding mask function (flash-attn's), so that a padded batch reaches the attention function as
a ``(batch, keys)`` boolean mask instead of no mask at all. The name avoids "flash", which
transformers reserves for its hub kernels.

The attention function maps each call onto :func:`cupyflash.attention` (no padding),
:func:`cupyflash.attention_with_kvcache` (a few query tokens over a left-padded batch, as in
generation: the decode kernel reads each sequence's keys from its first valid one, in place, no
copy) or :func:`cupyflash.attention_varlen` (other padding: the valid tokens packed, as
flash-attn's integration unpads them): causal (bottom-right, so a cache's queries are its last positions), the module's
``scaling``, ``sliding_window`` (a token sees itself and the ``sliding_window - 1`` before it),
``softcap``, GQA, the module's attention ``dropout`` (transformers passes 0 in eval mode) and
gpt-oss's learnable sinks (``s_aux``, cast to float32: their gradient flows through the cast).
PyTorch tensors that require grad get their gradients (the training path).
What packing cannot express -- several query tokens whose last positions are not all valid, a
sliding window over a mask with gaps inside a sequence -- runs :func:`cupyflash.attention` with
the padding as an ``attn_mask`` (positions kept). What it cannot express at all raises: a
non-causal sliding window, those two cases with softcap, a mask other than transformers' 2-D
boolean padding mask.
"""

from __future__ import annotations

from typing import Any

from .._api import attention, attention_varlen, attention_with_kvcache
from .._specs import DECODE_MAX_QUERIES

NAME = "cupyfa"


def register(name: str = NAME) -> str:
    """Register cupyflash with transformers under ``name``; returns the name to pass as
    ``attn_implementation``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    if "flash" in name:
        raise ValueError(f"transformers takes attention names containing 'flash' for its hub kernels: {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-function signature: query ``(B, Hq, Nq, d)``, key and value
    ``(B, Hkv, Nk, d)``; returns ``(B, Nq, Hq, d)`` and no attention weights."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (-1, -1)
    if sliding_window is not None:
        if not causal:
            raise NotImplementedError("a non-causal sliding window is not supported by cupyflash's integration")
        window = (int(sliding_window) - 1, -1)
    cap = float(softcap or 0.0)
    sinks = kwargs.get("s_aux")  # gpt-oss: a logit per query head in every row's denominator
    options: dict[str, Any] = {"causal": causal, "scale": scaling, "window": window, "softcap": cap,
                               "dropout_p": float(dropout),
                               "sinks": None if sinks is None else sinks.float()}  # fmt: skip
    if attention_mask is None:
        out = attention(query, key, value, layout="bhsd", **options)
        return out.transpose(1, 2), None
    return _padded(query, key, value, attention_mask, options), None


def _padded(query: Any, key: Any, value: Any, mask: Any, options: dict[str, Any]) -> Any:
    """A padded batch: a few queries over left padding on the decode kernel (from each row's
    first valid key, in place); else each sequence's valid keys (mask True) and queries packed
    end to end, attention_varlen, the rows scattered back (padded query rows are 0)."""
    import torch

    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(
            f"expected transformers' 2-D boolean padding mask (register() installs its mask function), got a "
            f"{tuple(mask.shape)} {mask.dtype} mask"
        )
    b, hq, nq, d = query.shape
    if mask.shape[1] < key.shape[2]:  # a static cache: its slots past the mask hold no token yet
        key, value = key[:, :, : mask.shape[1]], value[:, :, : mask.shape[1]]
    nk = key.shape[2]
    mask = mask[:, -nk:]
    first_keys = _left_padding(mask, nq, options, (query, key, value))
    if first_keys is not None:  # generation over a left-padded batch: the decode kernel, in place
        out = attention_with_kvcache(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), cache_seqlens=nk,
            cache_leftpad=first_keys, causal=options["causal"], scale=options["scale"], sinks=options["sinks"],
        )  # fmt: skip
        return out
    q_mask = mask[:, -nq:]
    if nq == 1:  # decoding: each sequence's one new token is valid
        q_mask = torch.ones_like(q_mask)
    elif nq != nk and not bool(q_mask.all()):
        # Padding among a cache's newest positions: packed, the queries would lose their positions.
        return _key_padding(query, key, value, mask, options, "the queries of a cache must be its newest tokens")
    if options["window"][0] >= 0:
        # Packed, a window counts valid tokens; transformers counts positions. They agree when each
        # row's valid tokens are one run (left or right padding), not around a hole.
        runs = mask[:, 0].int() + (mask[:, 1:] & ~mask[:, :-1]).sum(1)
        if bool((runs > 1).any()):
            return _key_padding(query, key, value, mask, options, "a sliding window over gaps inside a sequence")
    q_rows, k_rows = q_mask.reshape(-1), mask.reshape(-1)
    packed_q = query.transpose(1, 2).reshape(b * nq, hq, d)[q_rows]
    packed_k, packed_v = (x.transpose(1, 2).reshape(b * nk, x.shape[1], d)[k_rows] for x in (key, value))
    zero = torch.zeros(1, dtype=torch.int32, device=query.device)
    cu_q = torch.cat([zero, q_mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    packed_out = attention_varlen(packed_q, packed_k, packed_v, cu_q, cu_k, nq, nk, **options)  # maxima: upper bounds
    out = packed_out.new_zeros(b * nq, hq, d).index_put((q_rows,), packed_out)  # padded rows stay 0
    return out.view(b, nq, hq, d)


def _key_padding(query: Any, key: Any, value: Any, mask: Any, options: dict[str, Any], case: str) -> Any:
    """The padding as an attn_mask ``(B, 1, 1, Nk)`` over the unpacked batch, for what packing
    cannot express (``case``): causal and window count positions, as transformers does. Padded
    query rows come back as the kernel computes them (transformers ignores them)."""
    if options["softcap"]:
        raise ValueError(f"{case}, with softcap: an attn_mask does not combine with softcap yet")
    out = attention(query, key, value, layout="bhsd", attn_mask=mask[:, None, None, :], **options)
    return out.transpose(1, 2)


def _left_padding(mask: Any, nq: int, options: dict[str, Any], tensors: tuple[Any, ...]) -> Any:
    """Each row's first valid key (int32) when the call is a few queries over a left-padded batch
    that the decode kernel takes (no window, softcap or dropout; nothing to differentiate):
    every row's valid keys are its last ones, the queries among them. Else None. (One device
    synchronisation: whether the mask is left padding is read back.)"""
    import torch

    plain = options["window"] == (-1, -1) and not options["softcap"] and not options["dropout_p"]
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    if nq > DECODE_MAX_QUERIES or not plain or grads:
        return None
    nk = mask.shape[1]
    count = mask.sum(1, dtype=torch.int32)
    first = nk - count
    left_padded = torch.arange(nk, device=mask.device)[None, :] >= first[:, None]
    if bool(((mask != left_padded).any(1) | (count < nq)).any()):
        return None
    return first
