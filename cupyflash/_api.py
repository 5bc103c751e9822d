"""The public attention functions: ``attention``, ``attention_varlen``, their backward twins and
``attention_with_kvcache``.

Each states its signature and semantics, checks its options into a typed call
(``_attention.Forward``, ``_kvcache.CacheCall`` ...) and hands it to one route: the forward calls
to the front door (``_front.route``: torch.compile, JAX tracing, autograd, host or GPU), the
backward calls to their executor (``_attention``), which runs them where their arrays live.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, overload

from . import _attention, _block_mask, _fp8, _fp8_forward, _front, _interop, _kvcache, _mods
from ._block_mask import BlockMask
from ._validate import (
    NO_WINDOW,
    check_algorithm,
    check_batch_invariant,
    check_flag,
    check_num_splits,
    check_options,
)

# The forward entry points, as the front door routes them.
_ATTENTION = _front.Operation(
    "attention", _attention.host_forward, _attention.gpu_forward, torch="attention", jax="attention"
)
_VARLEN = _front.Operation(
    "attention_varlen", _attention.host_varlen_forward, _attention.gpu_varlen_forward, torch="attention_varlen"
)
_FP8_ATTENTION = _front.Operation("the FP8 forward", _fp8_forward.host_forward, _fp8_forward.gpu_forward)
_PAGED_VARLEN = _front.Operation(
    "attention_varlen with a block_table", _attention.host_varlen_forward, _attention.gpu_varlen_forward
)
_KVCACHE = _front.Operation(
    "attention_with_kvcache", _kvcache.host_with_kvcache, _kvcache.gpu_with_kvcache, torch="attention_with_kvcache",
    jax="attention_with_kvcache", backward=False,
)  # fmt: skip


@overload
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    layout: str = ...,
    algorithm: str = ...,
    return_lse: Literal[False] = ...,
    deterministic: bool = ...,
    batch_invariant: bool = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    alibi_slopes: Any = ...,
    attn_mask: Any = ...,
    q_descale: Any = ...,
    k_descale: Any = ...,
    v_descale: Any = ...,
    out_dtype: Any = ...,
    fp8_dtype: str | None = ...,
    score_mod: Callable[..., Any] | None = ...,
    mask_mod: Callable[..., Any] | None = ...,
    sinks: Any = ...,
    block_mask: BlockMask | None = ...,
) -> Any: ...
@overload
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    layout: str = ...,
    algorithm: str = ...,
    return_lse: Literal[True],
    deterministic: bool = ...,
    batch_invariant: bool = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    alibi_slopes: Any = ...,
    attn_mask: Any = ...,
    q_descale: Any = ...,
    k_descale: Any = ...,
    v_descale: Any = ...,
    out_dtype: Any = ...,
    fp8_dtype: str | None = ...,
    score_mod: Callable[..., Any] | None = ...,
    mask_mod: Callable[..., Any] | None = ...,
    sinks: Any = ...,
    block_mask: BlockMask | None = ...,
) -> tuple[Any, Any]: ...
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    layout: str = "bshd",
    algorithm: str = "auto",
    return_lse: bool = False,
    deterministic: bool = False,
    batch_invariant: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    attn_mask: Any = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
    out_dtype: Any = None,
    fp8_dtype: str | None = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    sinks: Any = None,
    block_mask: BlockMask | None = None,
) -> Any:
    """Exact attention ``softmax(scale * q @ k^T + mask) @ v``.

    Parameters
    ----------
    q : array, ``(B, Nq, Hq, d)`` for ``layout="bshd"`` or ``(B, Hq, Nq, d)`` for ``"bhsd"``
        CuPy array, PyTorch tensor, any DLPack GPU array (JAX ...) or a host array of any
        array-API namespace (NumPy, array_api_strict, PyTorch CPU). Traced JAX arrays (inside
        ``jax.jit``, ``grad``, ``vmap``) make the call an XLA custom call with a backward.
    k, v : arrays, ``(B, Nk, Hkv, d)`` (or ``(B, Hkv, Nk, d)``), same library, device and dtype
        as ``q``. ``Hq % Hkv == 0``: query head ``h`` reads key/value head ``h // (Hq // Hkv)``
        (GQA; ``Hkv = 1`` is MQA).
    causal : bool
        Bottom-right aligned, as flash-attn >= 2.1: query ``i`` sees key ``j`` iff
        ``j <= i + Nk - Nq``. For Nq = 2, Nk = 5 (1 = visible)::

            1 1 1 1 0
            1 1 1 1 1

        A query row that sees no key outputs 0 and its LSE is ``-inf``.
    scale : float, optional
        Defaults to ``1 / sqrt(d)``. Any finite value.
    window : (left, right)
        Sliding window: query ``i`` sees keys ``i + Nk - Nq - left .. i + Nk - Nq + right``;
        ``-1`` = unbounded. ``causal=True`` sets ``right = 0`` whatever ``window`` says (as flash-attn).
    softcap : float
        If > 0, scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    layout : {"bshd", "bhsd"}
    algorithm : {"auto", "fa2", "fa3", "decode", "fa1", "naive"}
        On the GPU (float16/bfloat16, any head_dim from 1 to 256: the kernel of the next tile
        width, the columns past the caller's zero): ``"fa2"``, the mma.sync kernel; ``"fa3"``, the
        Hopper kernel (wgmma + TMA; sm_90, head_dim a multiple of 8); ``"decode"``, the split-KV
        decode kernel (1 to 16 query tokens, no dropout or ALiBi); ``"auto"`` picks decode for one
        query token where it applies, else fa3 where it applies, else fa2.
        ``"fa1"`` (FlashAttention-1's loop order, head_dim 64, 128, 256, 512) and ``"naive"``
        (S and P materialised in HBM, any head_dim) are the baselines of docs/io_analysis.md.
        On the host every algorithm runs through ``cupyflash.xp_impl``.
    return_lse : bool
        Also return the log-sum-exp of each row, natural log, ``(B, Hq, Nq)``: float32 (float64
        for float64 host inputs). NaN in a row's visible scores gives NaN in its output and LSE.
    deterministic : bool
        For PyTorch tensors that require grad: the backward without atomic adds (bit-identical
        gradients run to run; see :func:`attention_backward`).
    batch_invariant : bool
        Each sequence's output and LSE bit-identical whatever else is in the batch: its size,
        the other sequences, the sequence's place in it (RL post-training and reproducible
        serving need it). Of the GPU kernels only the split-KV decode kernel (one query token
        under ``"auto"``, or ``"decode"``) depends on the batch: it splits the keys over CTAs
        by a count from the occupancy of the whole launch. With the flag its splits are a fixed
        4096 keys merged in split order, so Nk keys take ceil(Nk / 4096) splits in any batch
        (fewer CTAs than the default for a small batch: docs/api.md states the cost). The FA2
        and Hopper kernels, FA1 and the FP8 forward are batch-invariant as they are, and the
        flag changes nothing there: one CTA computes each (query block, batch, head) tile over
        all its keys in one order (the Hopper kernel's persistent schedule only picks which CTA
        computes a tile), and the variant follows the dtype, head dim, flags and Nk. The GPU
        baseline ``"naive"`` (cuBLAS, whose GEMM algorithm follows the batch) refuses it. On
        the host no algorithm splits by the batch (``"decode"`` then splits at the GPU's 4096
        keys). Same GPU, same library versions: across GPUs or releases bits may differ.
    dropout_p : float in [0, 1)
        Dropout on the attention probabilities, as SDPA's and flash-attn's ``dropout_p``: each
        element of ``softmax(...)`` is zeroed with probability ``p' = round(65536 p) / 65536``
        (a 16-bit draw: within 2^-17 of ``dropout_p``, which must be below 1 - 2^-17) and the
        kept ones are scaled by ``1 / (1 - p')``, so the expected output is exact; the LSE is
        that of the undropped softmax. The mask is a function of ``seed`` and the element's
        (batch, query head, row, key), the same on the GPU (the FA2 kernel: ``"auto"`` picks
        it; ``"fa3"`` and ``"decode"`` have no dropout) and on the host. Pass 0 at inference.
    seed : int, optional
        The dropout mask's seed, in [0, 2^64). None: a fresh one per call, from PyTorch's
        default generator for tensors (``torch.manual_seed`` reproduces it), else from Python's
        ``random``. Give the same seed to :func:`attention_backward` to differentiate the call
        (autograd does it for tensors that require grad). A call captured into a CUDA graph
        must give one: the seed is a launch parameter, so every replay of a graph repeats the
        captured call's mask. Inside a JAX transformation a seed is required and may also be a
        JAX integer array (0-d, or ``(2,)`` uint32: low and high words), an operand of the
        compiled program, so that each call can draw a fresh mask.
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi, as flash-attn's: the score of query ``i`` and key ``j`` gains
        ``-slope * |i + Nk - Nq - j|`` (after the scale and softcap, before the mask), the slope
        of the query head (and batch entry). Same library and device as ``q``. On the GPU: the
        Hopper kernel where ``"auto"`` picks it (its backward too, but with softcap: FA2's), else
        the FA2 kernel; ``"decode"`` has no ALiBi.
    attn_mask : array, optional
        SDPA's ``attn_mask``, broadcast to ``(B, Hq, Nq, Nk)`` axis by axis (2 to 4 dims, each
        full or 1, missing leading ones 1): boolean (True: the key takes part) or additive (q's
        dtype on the GPU; added to ``scale * q @ k^T``), together with ``causal``/``window``.
        A key-padding mask is ``(B, 1, 1, Nk)``. A row whose every key is masked outputs 0 with
        LSE ``-inf`` (SDPA's gives NaN). Same library and device as ``q``. On the GPU the FA2
        kernels read it in place (strides 0 on broadcast axes), forward and backward (the mask
        gets no gradient), at any head dim. Not with softcap or ALiBi.
    q_descale, k_descale, v_descale : optional
        The FP8 forward (FlashAttention-3's FP8 call): with q, k and v in float8 e4m3
        (``torch.float8_e4m3fn``, ml_dtypes' ``float8_e4m3fn``, or uint8 bytes with
        ``fp8_dtype="e4m3"``) the call computes ``softmax(scale (q_descale q) (k_descale k)^T)
        (v_descale v)``. Each descale is None (1), a positive number, or a float32 array of
        shape ``()``, ``(Hkv,)`` or ``(B, Hkv)`` (query head ``h`` takes KV head ``h // (Hq //
        Hkv)``'s). On the GPU: Hopper, head_dim 128, causal or not, no window, softcap, dropout,
        ALiBi or mask, and no backward; P is rounded to e4m3 for P V as FlashAttention-3 does
        (docs/fp8_forward.md: its accuracy). :func:`quantize_fp8` makes the inputs.
    out_dtype : {"bfloat16", "float16"}, optional
        The FP8 forward's output dtype (default bfloat16).
    fp8_dtype : {"e4m3"}, optional
        The float8 format of uint8 q, k, v (CuPy has no float8 dtype).
    score_mod : function ``(score, b, h, q_idx, kv_idx) -> score``, optional
        FlexAttention's: a plain Python function of a score (after the scale, softcap and ALiBi),
        its batch entry, query head, query row and key, traced once per call into an expression
        (arithmetic, comparisons, ``&`` ``|`` ``~``, the functions of :mod:`cupyflash.mods`, and
        captured 1-D / 2-D arrays indexed by index expressions). Python control flow on its
        arguments (``if``, ``bool``, ``int``, ``float``) is refused with a TypeError. On the host
        path and the GPU kernels, forward and backward (:func:`attention_backward` with the same
        functions; PyTorch autograd, ``jax.grad``), under ``torch.compile(fullgraph=True)`` and
        ``jax.jit`` (the expression is the compiled op's static argument, the captured arrays its
        inputs: new values need no recompile). Captured arrays get no gradient (one that requires
        grad is refused). Not with ``attn_mask``.
    mask_mod : function ``(b, h, q_idx, kv_idx) -> bool``, optional
        FlexAttention's: the key ``kv_idx`` takes part in row ``q_idx`` iff it returns True
        (together with ``causal`` / ``window``; a row that sees no key outputs 0, LSE ``-inf``).
        Traced and run as ``score_mod``. E.g. document masking over packed sequences, with a
        captured ``doc_id`` array: ``lambda b, h, q, kv: doc_id[q] == doc_id[kv]``.
    block_mask : BlockMask, optional
        A mask_mod with its block summary (:func:`create_block_mask`), in place of ``mask_mod``
        (giving both is allowed only for the same function): the kernels skip the tiles the mask
        hides (no K/V load, no MMA) and evaluate it only on the tiles it cuts through; the result
        is the mask_mod's. Made for this call's ``Q_LEN = Nq``, ``KV_LEN = Nk``, and its batch and
        query heads (or None / 1: broadcast).
    sinks : array ``(Hq,)``, optional
        Learnable attention sinks (gpt-oss's): a logit per query head that joins every row's
        softmax denominator and takes no value, ``out = sum_j exp(s_j - lse) v_j`` with
        ``lse = log(sum_j exp(s_j) + exp(sinks[h]))`` (the returned LSE includes it; a row that
        sees no key outputs 0 with LSE ``sinks[h]``). float32 on the GPU (cast with
        ``sinks.float()``: the gradient flows through the cast), on every kernel but the
        baselines and the FP8 forward; PyTorch autograd, ``jax.grad`` (and
        :func:`attention_backward`) give its gradient.

    Returns
    -------
    out : array like ``q`` (same library, device, dtype and layout; a fresh contiguous array)
    lse : float32 array ``(B, Hq, Nq)`` (float64 for float64 inputs), when ``return_lse``

    Notes
    -----
    GPU inputs need a unit stride on ``d`` and 16-byte aligned strides; other layouts are copied
    to a contiguous array first (in the caller's library, on its stream). GPU work is queued on
    the caller's stream (CuPy's current stream, or PyTorch's current stream for tensors) and
    nothing synchronises the device.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 5, 2, 16), dtype=np.float32)
    >>> k = v = rng.standard_normal((1, 7, 1, 16), dtype=np.float32)
    >>> out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 5, 2, 16), (1, 2, 5))
    """
    options = check_options(causal, scale, window, softcap)
    if batch_invariant is not False:
        batch_invariant = check_batch_invariant(batch_invariant)
    fp8_options = q_descale is not None or k_descale is not None or v_descale is not None or fp8_dtype is not None
    if fp8_options or _fp8_forward.is_fp8_array(q):  # the FP8 forward
        # (the Hopper kernel on e4m3 splits no keys: batch-invariant either way)
        if score_mod is not None or mask_mod is not None or block_mask is not None or sinks is not None:
            raise ValueError("the FP8 forward takes no score_mod / mask_mod or sinks, nor a block_mask")
        _fp8_forward.refuse_options(options, algorithm, dropout_p, alibi_slopes, attn_mask)
        fp8 = _fp8_forward.Fp8Forward(q, k, v, options, layout, (q_descale, k_descale, v_descale), out_dtype, fp8_dtype)
        out, lse = _front.route(_FP8_ATTENTION, fp8, return_lse)
        return (out, lse) if return_lse else out
    if out_dtype is not None:
        raise TypeError("out_dtype is the FP8 forward's (float8 q, k, v); other calls return q's dtype")
    if type(algorithm) is not str or algorithm != "auto":  # the default skips the check
        algorithm = check_algorithm("attention", algorithm)
    mods = (
        None
        if score_mod is None and mask_mod is None and block_mask is None
        else _traced(score_mod, mask_mod, attn_mask, block_mask, compilable=True)
    )
    if attn_mask is not None and algorithm not in ("auto", "fa2"):
        raise ValueError(f"attn_mask runs on the FA2 kernel: algorithm must be 'auto' or 'fa2', got {algorithm!r}")
    if deterministic is not False and deterministic is not True:
        deterministic = check_flag("deterministic", deterministic)
    call = _attention.Forward(
        q, k, v, options, layout, algorithm, deterministic, dropout_p, seed, alibi_slopes, attn_mask, mods,
        batch_invariant, sinks, block_mask, mods is not None and _front.captured_grad(mods),
    )  # fmt: skip
    out, lse = _front.route(_ATTENTION, call, return_lse)
    return (out, lse) if return_lse else out


def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    return_lse: bool = False,
    algorithm: str = "auto",
    deterministic: bool = False,
    batch_invariant: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    seqused_k: Any = None,
    block_table: Any = None,
    sinks: Any = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
) -> Any:
    """Attention over a batch of sequences of different lengths packed end to end, as
    flash-attn's ``flash_attn_varlen_func``.

    Parameters
    ----------
    q : array ``(total_q, Hq, d)``; sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    k, v : arrays ``(total_k, Hkv, d)``, split by ``cu_seqlens_k``; with ``block_table``, pages
        ``(num_pages, page_size, Hkv, d)`` of a paged KV cache (``page_size`` a power of two)
    cu_seqlens_q, cu_seqlens_k : int32 arrays ``(batch + 1,)``, starting at 0, non-decreasing,
        on the same device as ``q``; with ``block_table``, ``cu_seqlens_k`` gives each sequence's
        key count only
    max_seqlen_q, max_seqlen_k : int
        The longest query / key sequence. They size the grid and nothing else: the mask always
        comes from ``causal``/``window``. On the GPU they must not be understated (rows past
        ``max_seqlen_q`` of a longer sequence are not computed); on the host they are checked.
    causal, scale, window, softcap : as in :func:`attention`, per sequence (bottom-right causal
        within each sequence).
    return_lse : bool
        Also return the LSE, shape ``(Hq, total_q)``: float32 (float64 for float64 host inputs).
    algorithm : {"auto", "fa2", "fa3"}
        The GPU kernel. "auto" is the Hopper kernel where it applies (sm_90, a head_dim that is a
        multiple of 8),
        else the mma.sync FA2 kernel; "fa2" and "fa3" force one (as :func:`attention`). On the
        host every choice runs ``cupyflash.xp_impl``'s FA2.
    deterministic : bool
        For PyTorch tensors that require grad: the backward without atomic adds.
    batch_invariant : bool
        Each sequence's output and LSE bit-identical whatever else is packed with it. The FA2
        and Hopper kernels split no sequence's keys (one CTA per query block of a sequence and
        head, over all its keys, in one order), so this holds without the flag but for one
        choice: at head_dim 64 without a causal or window bound the Hopper kernel runs another
        tile when ``max_seqlen_k`` (the batch's longest sequence) is at most 2048 keys. The
        flag keeps that tile choice off the batch (such batches then run up to ~10% slower).
        Paged keys (``block_table``) and the host path are batch-invariant as they are.
    dropout_p, seed : as in :func:`attention`; an element's (batch, row, key) are its sequence's
        index and its positions within the sequence.
    alibi_slopes : as in :func:`attention`, ``(Hq,)`` or ``(batch, Hq)``; the distance within
        each sequence.
    seqused_k : int32 array ``(batch,)``, optional
        flash-attn's: only the first ``seqused_k[b]`` keys of sequence ``b`` take part (its causal
        alignment counts those), e.g. a cache region preallocated per sequence. On the GPU the FA2
        kernel (``"auto"`` picks it); checked on the device like the offsets (Notes).
    block_table : int32 array ``(batch, max_pages)``, optional
        Paged keys (chunked prefill against a paged cache, as serving engines run it): key ``j``
        of sequence ``b`` is slot ``j % page_size`` of page ``block_table[b, j // page_size]``.
        On the GPU the FA2 kernel reads the pages in place; its device values are checked there
        as :func:`attention_with_kvcache`'s: a page id in use outside ``[0, num_pages)``, or a key
        count (from ``cu_seqlens_k`` / ``seqused_k``) that is negative or beyond the sequence's
        table row, makes that sequence's rows NaN and :func:`check_device_errors` raise. No
        dropout, no gradients, not under ``torch.compile`` yet.
    sinks : array ``(Hq,)``, optional
        Learnable attention sinks, as in :func:`attention` (every sequence's rows).
    score_mod, mask_mod : functions, optional
        As :func:`attention`'s, per packed sequence: ``b`` is the sequence's index and ``q_idx``,
        ``kv_idx`` are positions within it (so a document mask is the packing itself, and a
        prefix, a chunk or a relative-position bias counts from each sequence's start; a
        ``mask_mod`` of ``kv_idx <= q_idx`` is causal from the top left, where ``causal=True``
        aligns each sequence's last query with its last key). On the GPU the FA2 or the Hopper
        kernels run them, forward and backward; every read of a captured array is checked there
        (the sequences' lengths stay on the device), and one outside its array makes the score
        NaN. No ``block_table``. Under ``torch.compile`` the call is one op, as attention's.

    Notes
    -----
    On the GPU the offsets are not read back to the host (that would synchronise the device on
    every call, and break CUDA-graph capture): the kernels check each sequence's own pair as
    they read it. A sequence ``b`` whose ``cu_seqlens_k`` pair is bad (negative, decreasing,
    past ``total_k``, or a first offset other than 0) or whose ``seqused_k[b]`` is outside
    ``[0, its key count]`` reads no key and gets NaN output rows (and NaN LSE) over its query
    rows. One whose ``cu_seqlens_q`` pair is bad (the same, against ``total_q``) has no rows of
    its own, since those offsets are what says which rows are its: it writes nothing, and those
    rows keep 0 (LSE ``-inf``) unless a sequence with a valid pair covers them. Either way no
    value is read or written outside the arrays, rows of sequences whose pairs are valid are
    computed as usual, and :func:`check_device_errors` raises :class:`DeviceValueError` naming
    ``cu_seqlens_q``, ``cu_seqlens_k`` or ``seqused_k`` (a bad pair in ``cu_seqlens_q`` can make
    two valid-looking pairs overlap, as in ``[0, 10, 5, 20]``: the flag is the signal, check it).
    Host arrays are checked in full before anything is computed (``ValueError``).

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> q = k = v = np.ones((7, 2, 16), dtype=np.float32)
    >>> cu = np.array([0, 3, 7], dtype=np.int32)
    >>> cupyflash.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).shape
    (7, 2, 16)
    """
    options = check_options(causal, scale, window, softcap)
    if type(algorithm) is not str or algorithm != "auto":  # the defaults skip the checks
        algorithm = check_algorithm("attention_varlen", algorithm)
    if deterministic is not False and deterministic is not True:
        deterministic = check_flag("deterministic", deterministic)
    if batch_invariant is not False:
        batch_invariant = check_batch_invariant(batch_invariant)
    mods = None
    if score_mod is not None or mask_mod is not None:
        mods = _varlen_traced(score_mod, mask_mod, block_table, compilable=True)
    call = _attention.VarlenForward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, algorithm, deterministic, dropout_p,
        seed, alibi_slopes, seqused_k, block_table, batch_invariant, sinks, mods,
        mods is not None and _front.captured_grad(mods),
    )  # fmt: skip
    if block_table is not None:
        if algorithm == "fa3":
            raise ValueError("algorithm='fa3' (the Hopper kernel) does not read paged keys: use 'auto' or 'fa2'")
        out, lse = _front.route(_PAGED_VARLEN, call, return_lse)
        return (out, lse) if return_lse else out
    out, lse = _front.route(_VARLEN, call, return_lse)
    return (out, lse) if return_lse else out


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    dlse: Any = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    layout: str = "bshd",
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    attn_mask: Any = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    sinks: Any = None,
    block_mask: BlockMask | None = None,
    captured_grads: bool = False,
) -> tuple[Any, ...]:
    """The gradients (dq, dk, dv) of :func:`attention` at ``out, lse = attention(q, k, v, ...,
    return_lse=True)`` for the output gradient ``dout``, as FlashAttention-2's backward computes
    them: P recomputed from q, k and ``lse`` block by block (nothing N x N is kept),
    ``D = rowsum(dout * out)``, ``dS = P * (dout v^T - D)`` (times the softcap's derivative),
    ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dout``; with GQA, dk and dv summed
    over the query heads that read each key/value head.

    Parameters
    ----------
    dout, out : arrays shaped like ``q``
    q, k, v, causal, scale, window, softcap, layout : as for :func:`attention`
    lse : ``(B, Hq, Nq)`` float32, as :func:`attention` returns it
    dlse : optional, like ``lse``: the gradient of the returned LSE, where a loss uses it
        (``dS`` gains ``P * dlse``)
    deterministic : bool
        On the GPU, dq bit-identical from run to run. On Hopper (head_dim 64 and 128, padded
        batches without dropout, ALiBi or a mask) the key blocks add into each dq tile in one
        fixed order (0-13% slower than the default on the H200); elsewhere a second kernel over
        query blocks recomputes the scores (two more matrix products). The host path is
        deterministic either way.
    dropout_p, seed : the forward's (its mask is regenerated from the seed, which is required
        when ``dropout_p > 0``): ``dv = (P M r)^T dout``, ``dS = P * (dout v^T M r - D)`` with
        M the keep mask and ``r`` the forward's scale of the kept values.
    alibi_slopes : the forward's (the slopes get no gradient, as in flash-attn).
    attn_mask : the forward's (it gets no gradient; a masked score's dS is 0).
    score_mod, mask_mod, block_mask : the forward's. ``dS`` is multiplied by
        ``d score_mod / d score``, derived from the traced expression. With ``block_mask`` the
        kernels skip the tiles its mask hides, as the forward's.
    captured_grads : bool
        With a ``score_mod``: one more result, the gradients of the arrays it captures (a learned
        bias table's): dS times ``d score_mod / d (each element read)``, summed where the element
        was read. The array-API algorithm computes it where the arrays live (on a GPU too: the
        kernels have no scatter of it yet); PyTorch autograd and ``jax.grad`` ask for it by
        themselves.
    sinks : the forward's ``(Hq,)``: the gradient ``dsinks = -sum over rows of
        exp(sinks[h] - lse) * (rowsum(dout * out) - dlse)`` is returned too (dq, dk and dv need
        nothing more: P recomputed from ``lse``, which holds the sink, leaves its share out).

    Returns
    -------
    (dq, dk, dv) : arrays like ``q``, ``k``, ``v`` (fresh and contiguous on the GPU)
    (dq, dk, dv, dsinks) with ``sinks``: dsinks float32 ``(Hq,)`` (float64 for float64 inputs on
        the host)
    ..., captured with ``captured_grads``: a tuple, per array score_mod captures (in the order it
        first reads them), its gradient in its shape and dtype, or None for an integer or boolean
        array

    Notes
    -----
    GPU arrays (float16/bfloat16, head_dim 1 to 256) run the mma.sync backward of
    ``kernels_cu/fa2_bwd.cu`` on the caller's stream (on Hopper the key-block step of
    ``kernels_cu/fa3_bwd.cu`` where it has the variant); dq is accumulated in float32 with
    atomic adds, so its last bits can differ from run to run (unless ``deterministic``). Host arrays
    run the array-API algorithm (``cupyflash.xp_impl.attention_backward``) in their own
    namespace.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, n, 2, 16)) for n in (5, 7, 7))
    >>> out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = cupyflash.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.shape
    ((1, 5, 2, 16), (1, 7, 2, 16))
    """
    options = check_options(causal, scale, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    captured_grads = check_flag("captured_grads", captured_grads)
    if captured_grads and score_mod is None:
        raise ValueError("captured_grads=True needs a score_mod: its captured arrays are what get gradients")
    dropout_p, seed = _attention.backward_dropout(dropout_p, seed)
    mods = _traced(score_mod, mask_mod, attn_mask, block_mask)
    call = _attention.Backward(
        dout, q, k, v, out, lse, dlse, options, layout, deterministic, dropout_p, seed, alibi_slopes, attn_mask, mods,
        sinks, block_mask, captured_grads,
    )  # fmt: skip
    return _attention.backward(call)


def attention_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    dlse: Any = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int | None = None,
    alibi_slopes: Any = None,
    seqused_k: Any = None,
    sinks: Any = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    captured_grads: bool = False,
) -> tuple[Any, ...]:
    """The gradients (dq, dk, dv) of :func:`attention_varlen` at ``out, lse =
    attention_varlen(..., return_lse=True)``, as :func:`attention_backward` computes them, per
    packed sequence. ``lse`` (and ``dlse``) are ``(Hq, total_q)``. Packed rows that belong to
    no sequence get zero gradients. On the GPU the offsets and ``seqused_k`` are checked on the
    device as the forward's and a bad one is reported (:func:`check_device_errors` raises): a
    sequence whose keys are bad gets NaN dq over its query rows (from the NaN ``lse`` rows the
    forward gave it, which autograd passes); the key-block kernel reads the offsets clamped into
    the tensors, so a bad sequence's dk, dv are undefined and may reach the rows its clamped
    range covers, never outside the tensors. On the host they are checked. ``dropout_p`` and ``seed``:
    the forward's, as for :func:`attention_backward`; ``alibi_slopes`` and ``seqused_k`` too (keys
    past ``seqused_k`` get zero gradients); ``sinks`` too (dsinks then a fourth result);
    ``score_mod`` and ``mask_mod`` too, and ``captured_grads`` as :func:`attention_backward`'s
    (the gradients of score_mod's captured arrays last, summed over the sequences)."""
    options = check_options(causal, scale, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    captured_grads = check_flag("captured_grads", captured_grads)
    dropout_p, seed = _attention.backward_dropout(dropout_p, seed)
    if captured_grads and score_mod is None:
        raise ValueError("captured_grads=True needs a score_mod: its captured arrays are what get gradients")
    mods = None
    if score_mod is not None or mask_mod is not None:
        mods = _varlen_traced(score_mod, mask_mod, None, compilable=False)
    call = _attention.VarlenBackward(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, deterministic,
        dropout_p, seed, alibi_slopes, seqused_k, sinks, mods, captured_grads,
    )  # fmt: skip
    return _attention.varlen_backward(call)


@overload
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = ...,
    k_new: Any = ...,
    v_new: Any = ...,
    cache_batch_idx: Any = ...,
    cache_leftpad: Any = ...,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: Any = ...,
    rotary_cos: Any = ...,
    rotary_sin: Any = ...,
    rotary_interleaved: bool = ...,
    num_splits: int = ...,
    batch_invariant: bool = ...,
    return_lse: Literal[False] = ...,
    k_scale: Any = ...,
    v_scale: Any = ...,
    kv_dtype: str | None = ...,
    sinks: Any = ...,
    tree_mask: Any = ...,
    mask_mod: Callable[..., Any] | None = ...,
) -> Any: ...
@overload
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = ...,
    k_new: Any = ...,
    v_new: Any = ...,
    cache_batch_idx: Any = ...,
    cache_leftpad: Any = ...,
    causal: bool = ...,
    scale: float | None = ...,
    window: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: Any = ...,
    rotary_cos: Any = ...,
    rotary_sin: Any = ...,
    rotary_interleaved: bool = ...,
    num_splits: int = ...,
    batch_invariant: bool = ...,
    return_lse: Literal[True],
    k_scale: Any = ...,
    v_scale: Any = ...,
    kv_dtype: str | None = ...,
    sinks: Any = ...,
    tree_mask: Any = ...,
    mask_mod: Callable[..., Any] | None = ...,
) -> tuple[Any, Any]: ...
def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    cache_seqlens: Any,
    block_table: Any = None,
    k_new: Any = None,
    v_new: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    rotary_interleaved: bool = True,
    num_splits: int = 0,
    batch_invariant: bool = False,
    return_lse: bool = False,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: str | None = None,
    sinks: Any = None,
    tree_mask: Any = None,
    mask_mod: Callable[..., Any] | None = None,
) -> Any:
    """Attention of a few new query tokens over a KV cache, as flash-attn's
    ``flash_attn_with_kvcache`` (FlashDecoding: the keys are split over many CTAs and the
    partial results merged exactly).

    Parameters
    ----------
    q : array ``(B, Nq, Hq, d)``; on the GPU float16 or bfloat16, d from 1 to 256. Up to 16 query
        tokens run on the split-KV decode kernel; more (chunked prefill against a cache) on the
        FA2 kernel, which reads the cache in place as the decode kernel does
    k_cache, v_cache : arrays, contiguous ``(B, L_max, Hkv, d)`` (``(entries, L_max, Hkv, d)``
        with ``cache_batch_idx``), or paged
        ``(num_pages, page_size, Hkv, d)`` with ``block_table``; ``page_size`` any power of two
        (1, 2, ..., 16, ..., 256 ...). Same library, device and dtype as ``q``; ``Hq % Hkv == 0``.
        Modified in place when ``k_new`` / ``v_new`` are given (JAX arrays are not: see Returns).
    cache_seqlens : int or int32 array ``(B,)``
        Tokens already in each sequence's cache.
    block_table : int32 array ``(B, max_pages)``, optional
        Page of each ``page_size`` keys of each sequence: key ``j`` of sequence ``b`` is slot
        ``j % page_size`` of page ``block_table[b, j // page_size]``.
    k_new, v_new : arrays ``(B, Nnew, Hkv, d)``, optional
        Written into the cache at positions ``cache_seqlens[b] ..`` before attending; the
        attention then covers ``Nk_b = cache_seqlens[b] + Nnew`` keys.
    cache_batch_idx : int32 array ``(B,)``, optional (contiguous caches)
        The cache entry of each sequence: sequence ``b`` reads and appends to
        ``k_cache[cache_batch_idx[b]]`` (flash-attn's argument; the cache may then have any number
        of entries). An entry named twice is read by both sequences; with ``k_new`` it is refused
        (flash-attn leaves it undefined: the entry would end up with tokens of either sequence):
        on host arrays before anything runs, on the GPU by the kernels, which append nothing for
        both sequences, give them NaN rows and report it to :func:`check_device_errors`.
    cache_leftpad : int32 array ``(B,)``, optional (contiguous caches)
        The first key of each sequence's entry (a left-padded cache): sequence ``b`` attends to
        keys ``cache_leftpad[b] .. cache_seqlens[b] + Nnew - 1``, and ``Nk_b`` counts from there;
        the append still goes to ``cache_seqlens[b] ..``.
    causal : bool
        Bottom-right aligned within each sequence: query ``i`` sees key ``j`` iff
        ``j <= i + Nk_b - Nq``. For Nq = 2 over Nk_b = 5 keys (1 = visible)::

            1 1 1 1 0
            1 1 1 1 1

        With one query token it changes nothing. With ``tree_mask`` the tree replaces this rule
        among the drafts (True or False alike).
    scale : float, optional
        Defaults to ``1 / sqrt(d)``.
    window : (int, int)
        Sliding window ``(left, right)`` as ``attention``'s, aligned as ``causal`` (a bound of -1
        is none; with ``causal`` the right bound is 0): query ``i`` sees keys
        ``i + Nk_b - Nq - left .. i + Nk_b - Nq + right``. The kernels skip the key blocks
        before the window.
    softcap : float
        Scores pass through ``softcap * tanh(score / softcap)`` (Gemma 2's cap), as ``attention``'s.
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi, as ``attention``'s: the score of query ``i`` and key ``j`` gains
        ``-slope * |i + Nk_b - Nq - j|``. On the GPU it runs on the FA2 kernel (after the softcap, if any).
    sinks : array ``(Hq,)``, optional
        Learnable attention sinks, as in :func:`attention` (gpt-oss decodes with them): the
        decode kernel adds them where a row's splits merge.
    rotary_cos, rotary_sin : arrays ``(seqlen_ro, rotary_dim / 2)``, optional, q's dtype
        Rotary embedding applied before attending, as flash-attn's: ``k_new`` token ``t`` of
        sequence ``b`` is rotated at position ``cache_seqlens[b] + t`` as it is appended, query
        token ``i`` at ``cache_seqlens[b] + i`` when ``causal`` or a ``window`` is set, else all at
        ``cache_seqlens[b]``; the first ``rotary_dim`` columns rotate, the rest pass. Needs
        ``k_new``; a row for every position a key or query can take (the capacity, and
        ``capacity - Nnew + Nq`` when causal queries outnumber the new tokens). On the GPU the append rotates
        k_new and a small kernel rotates q into a temporary (one launch more).
    rotary_interleaved : bool
        flash-attn's: pairs columns ``(2i, 2i + 1)`` (True, its default) or ``(i, i + rotary_dim / 2)``
        (False, GPT-NeoX's and Llama's).
    num_splits : int
        Splits of the KV sequence: 0 chooses from the GPU's SM count, the batch, the heads and
        the cache length; 1 runs the same kernel without splitting (no combine step).
    batch_invariant : bool
        Each sequence's output and LSE bit-identical whatever else is in the batch: the batch
        size, the other sequences and their lengths, the sequence's place in the batch, the
        cache's capacity or page layout around it (RL post-training and reproducible serving).
        The default split count comes from an occupancy model over the whole launch, so a
        sequence's rounding changes with its neighbours. With the flag a split is a fixed 4096
        keys (``cupyflash._dispatch.BATCH_INVARIANT_SPLIT_KEYS``): a sequence of ``Nk_b`` keys
        takes ceil(Nk_b / 4096) splits, merged in split order, and nothing else in the kernel
        depends on the batch (the GQA packing and the tile follow the heads and query tokens).
        Not with ``num_splits`` (a ValueError). Its cost: no more CTAs than the sequences' own
        splits where the default would split further to fill the GPU (a small batch of short
        caches: B = 1 at 32k keys launches half the default's CTAs), and a CTA, which exits at
        once, for each split of the capacity past a sequence's keys (docs/api.md). More than 16
        query tokens, or ALiBi, run the FA2 kernel, which splits no keys: invariant either way.
        The host path computes each sequence alone and splits at the same keys as the GPU.
        Same GPU and library versions; across GPUs or releases the bits may differ.
    return_lse : bool
        Also return the float32 natural-log LSE ``(B, Hq, Nq)``.
    k_scale, v_scale : float or float32 array ``()``, ``(1,)`` or ``(Hkv,)``, optional
        A float8 cache's scales (default 1.0): a cached value of KV head ``h`` reads as
        ``fp8 * scale[h]``. A host number is checked (positive, finite in float32); a device array
        is read as given, at run time (a captured graph sees its later values); a device k_scale
        that is negative, NaN or infinite gives NaN rows (without softcap, where the kernel folds it
        into the softmax's multiplier).
    kv_dtype : "e4m3" or "e5m2", optional
        The float8 format of ``uint8`` caches (CuPy has no float8 dtype: pass the bytes with this);
        ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensors and ml_dtypes' float8 NumPy arrays
        carry their own (``kv_dtype`` must then agree).
    tree_mask : bool array ``(Nq, Nq)`` (one tree for the batch) or ``(B, Nq, Nq)``, optional
        Speculative decoding's token tree (FlashInfer's ``custom_mask`` and vLLM's tree attention,
        unpacked): the ``Nq`` query tokens are the drafts, the last ``Nq`` keys of each sequence
        (after ``k_new`` is appended: query ``i`` is key ``Nk_b - Nq + i``). Every key before them is
        visible to every draft; draft ``i`` sees draft ``j`` iff ``tree_mask[b, i, j]`` (an ancestor
        or itself). A chain (the lower triangle) is ``causal``. For Nq = 3 drafts, a root with two
        children, over Nk_b = 5 keys::

            1 1 1 0 0          tree_mask = [[1, 0, 0],
            1 1 1 1 0                       [1, 1, 0],
            1 1 1 0 1                       [1, 0, 1]]

        A draft that does not see itself is taken as written (its row then has one key fewer; a
        row that sees no key outputs 0, LSE ``-inf``, or ``sinks[h]`` with sinks). Nothing else is
        checked in the values (on the GPU they are read by the kernel, never copied back). Not with
        ``window``, ``alibi_slopes`` or the rotary tables (rotate q and k_new at the drafts' depths
        yourself); ``sinks`` join a tree's rows as any other row's. On the GPU the
        split-KV kernel's tree variants run it: 1 to 64 query tokens (docs/api.md).
    mask_mod : function ``(b, h, q_idx, kv_idx) -> bool``, optional
        The tree as a mask_mod over the drafts (``q_idx``, ``kv_idx`` in ``[0, Nq)``: draft
        ``q_idx`` sees draft ``kv_idx``; every key before the drafts is seen), in place of
        ``tree_mask``: traced as :func:`attention`'s and drawn once per call into the
        ``(B, Nq, Nq)`` tree where q lives (a few small array operations; a read of a captured
        array is checked against its shape, on a GPU a synchronisation). One tree per sequence,
        so it may not read ``h``. Not under ``torch.compile`` or ``jax.jit`` yet (draw the tree
        outside and pass ``tree_mask``).

    Float8 caches: q, ``k_new`` and ``v_new`` stay in q's dtype and the output is q's. ``k_new`` /
    ``v_new`` are stored as ``saturate(round_to_nearest_even(float32(x) / scale))`` -- vLLM's and
    FlashInfer's rule (CUDA's ``__nv_cvt_float_to_fp8`` with ``__NV_SATFINITE``): beyond 448
    (e4m3) or 57344 (e5m2) a value saturates, infinities too; NaN stays NaN (torch's own cast
    overflows e5m2 to inf: clamp before it to get the same bytes). The GPU kernel widens the bytes
    exactly and applies the scales in float32 (the K scale in the softmax multiplier, the V scale
    in the output); it takes 1 to 16 query tokens, no ALiBi, head_dim 64 or 128, and refuses the
    rest by name. The host path dequantises (``float8 * scale`` in float32, float64 for float64 q)
    and runs the same algorithm; it takes NumPy and PyTorch CPU caches. Not under
    ``torch.compile`` with ``k_scale`` / ``v_scale`` / ``kv_dtype`` given.

    Returns
    -------
    out : array like ``q``; lse : ``(B, Hq, Nq)`` when ``return_lse``, float32 (float64 for float64
        host inputs)
    (result, k_cache, v_cache) : with JAX arrays and ``k_new``: ``result`` is ``out`` (or
        ``(out, lse)``) as above, and ``k_cache``, ``v_cache`` are new arrays, the caches with
        ``k_new`` / ``v_new`` appended (JAX arrays are immutable: the caches passed in are
        unchanged). Under ``jax.jit`` with the caches donated (``donate_argnums``) XLA appends in
        place, with no copy of the cache; otherwise the call copies each cache once.

    Notes
    -----
    On the GPU, an int ``cache_seqlens`` is checked against the cache on the host; values of
    device arrays are not read back (that would synchronise the device every step). The
    kernels check them instead: a sequence whose length is outside ``[0, capacity - Nnew]``, whose
    first key (``cache_leftpad``) is outside ``[0, cache_seqlens[b]]``, whose cache entry is outside
    the cache or whose pages in use include an id outside ``[0, num_pages)`` gets NaN output rows (and NaN
    LSE), and its ``k_new``/``v_new`` are not written anywhere, so no other sequence's cache is
    ever touched; :func:`check_device_errors` then raises :class:`DeviceValueError` naming what
    was wrong (it synchronises, so the decode step itself never does). Host
    arrays are checked in full before anything is written. The GPU path makes no
    synchronisation and no allocation outside the caller's library, so a decode step can be
    captured in a CUDA graph (warm it up once first: the first call compiles its kernels).

    JAX: inside ``jax.jit`` or ``vmap`` (and for concrete JAX arrays with ``k_new``) the call is one
    XLA custom call. On a GPU the kernels run on XLA's buffers and stream (device values checked
    by the kernels, as above: :func:`check_device_errors` after the jitted call); on JAX's CPU
    backend the host path runs (values checked there: a bad one fails the run with its message;
    bfloat16 computed as float32). Shapes, options and an int ``cache_seqlens`` are checked at
    trace time, the GPU's dtypes at the first run. There is no derivative (as flash-attn's, it is
    inference only): differentiating through it raises, naming the argument.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> k_cache = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
    >>> v_cache = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
    >>> q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    >>> k_new = v_new = np.ones((2, 1, 1, 8), dtype=np.float32)
    >>> seqlens = np.array([3, 9], dtype=np.int32)
    >>> out = cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new)
    >>> out.shape, float(k_cache[1, 9, 0, 0])
    ((2, 1, 4, 8), 1.0)
    """
    options = check_options(causal, scale, window, softcap)
    if mask_mod is not None:  # the tree it draws over the drafts, as tree_mask
        tree_mask = _draft_tree(mask_mod, q, tree_mask)
    if type(num_splits) is not int:
        num_splits = check_num_splits(num_splits)
    if batch_invariant is not False:
        batch_invariant = check_batch_invariant(batch_invariant, num_splits)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: give both or neither")
    rotary = None if rotary_cos is None else rotary_interleaved
    # Float8 caches' scales: a host number goes to the kernel per call (its value checked there);
    # an array is an operand like the others (on the GPU read as given).
    k_array = v_array = None
    if k_scale is not None or v_scale is not None:
        k_array = None if _fp8.is_host_number(k_scale) else k_scale
        v_array = None if _fp8.is_host_number(v_scale) else v_scale
    named = {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens, "block_table": block_table,
        "k_new": k_new, "v_new": v_new, "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad,
        "alibi_slopes": alibi_slopes, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin, "k_scale": k_scale,
        "v_scale": v_scale, "sinks": sinks, "tree_mask": tree_mask,
    }  # fmt: skip
    operands = (q, k_cache, v_cache, None if type(cache_seqlens) is int else cache_seqlens, block_table, k_new, v_new,
                cache_batch_idx, cache_leftpad, alibi_slopes, rotary_cos, rotary_sin, k_array, v_array,
                sinks, tree_mask)  # fmt: skip
    call = _kvcache.CacheCall(named, operands, options, num_splits, rotary, kv_dtype, batch_invariant)
    results = _front.route(_KVCACHE, call, return_lse)
    if len(results) == 2:
        return results if return_lse else results[0]
    out, lse, k_cache, v_cache = results  # JAX arrays, appended: the new caches (JAX arrays are immutable)
    return ((out, lse) if return_lse else out), k_cache, v_cache


def _draft_tree(mask_mod: Any, q: Any, tree_mask: Any) -> Any:
    """attention_with_kvcache's mask_mod over the drafts as the tree mask it draws
    (``_mods.draft_tree``), in q's namespace, on q's device."""
    if tree_mask is not None:
        raise ValueError("give a tree_mask or a mask_mod over the drafts, not both")
    if _front.compiling() or _interop.traced((q,)):
        raise NotImplementedError(
            "attention_with_kvcache's mask_mod does not run under torch.compile or jax.jit yet: pass the tree as "
            "tree_mask, drawn outside the compiled step"
        )
    if not hasattr(q, "shape") or len(q.shape) != 4:
        raise ValueError("q must be an array (B, Nq, Hq, d) to draw a mask_mod's tree over its Nq drafts")
    from array_api_compat import array_namespace

    xp = array_namespace(q)
    return _mods.draft_tree(xp, _mods.trace_mask_mod(mask_mod), q.shape[0], q.shape[1], q)


def _traced(
    score_mod: Any, mask_mod: Any, attn_mask: Any, block_mask: Any, *, compilable: bool = False
) -> tuple[Any, Any] | None:
    """A call's score_mod and mask_mod traced (``_mods``), each None where not given; the mask a
    ``block_mask`` carries (traced when it was made), which a ``mask_mod`` given beside it must
    be. None without either function. ``compilable``: the entry point runs under torch.compile,
    where the functions go on as given while Dynamo traces it (the PyTorch adapter traces them
    into its custom op's arguments)."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return None
    if attn_mask is not None:
        raise ValueError("score_mod / mask_mod / block_mask do not take attn_mask: write the mask as a mask_mod")
    if compilable and _front.compiling():
        if block_mask is not None:
            raise NotImplementedError(
                "block_mask under torch.compile is not supported yet: pass its mask_mod as mask_mod= (the same result, "
                "every tile computed), or make the call outside the compiled region"
            )
        return score_mod, mask_mod
    mask = None if mask_mod is None else _mods.trace_mask_mod(mask_mod)
    if block_mask is not None:
        carried = _block_mask.traced(block_mask)
        if mask is not None and not _block_mask.same_mask(block_mask, mask):
            raise ValueError(
                "mask_mod is not the block_mask's mask_mod (another expression, or other captured arrays): pass the "
                "block_mask alone (it carries its mask_mod), or make one for this mask_mod"
            )
        mask = carried
    return (None if score_mod is None else _mods.trace_score_mod(score_mod), mask)


def _varlen_traced(score_mod: Any, mask_mod: Any, block_table: Any, *, compilable: bool) -> tuple[Any, Any]:
    """attention_varlen's score_mod and mask_mod traced (``_traced``; ``compilable``: as given while
    Dynamo traces), where the call takes them."""
    if block_table is not None:
        raise ValueError("score_mod / mask_mod take no block_table (paged keys) yet")
    traced = _traced(score_mod, mask_mod, None, None, compilable=compilable)
    assert traced is not None
    return traced


def create_block_mask(
    mask_mod: Callable[..., Any],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    """A ``mask_mod`` with its block summary, for ``attention(..., block_mask=...)``, as
    FlexAttention's ``create_block_mask``: made once, it saves every call the tiles the mask
    hides (no K/V load, no MMA) and the mask's evaluation where it shows a whole tile.

    Parameters
    ----------
    mask_mod : function ``(b, h, q_idx, kv_idx) -> bool``
        As :func:`attention`'s ``mask_mod``: traced once, here.
    B, H : int or None
        The batch size and query heads of the calls it serves; None: the mask is the same for
        every batch entry (head), which a mask that reads ``b`` (``h``) is not (refused). A mask
        that does not read ``b`` is summarised once for all batch entries (so for heads).
    Q_LEN, KV_LEN : int
        The calls' query rows and keys (a call of other lengths is refused).
    device : optional
        Where to make it, for a mask_mod that captures no array: ``"cuda"``, ``"cuda:N"`` or a
        ``torch.device`` (the summary in PyTorch tensors), an int or a ``cupy.cuda.Device``
        (CuPy), ``"cpu"``. None: where the mask's captured arrays are, the host if none (the
        summary is then copied to a GPU at its first call there). On a GPU one kernel evaluates
        the mask at every score of each cell (a CTA per cell); on the host it runs on index
        grids in the arrays' own namespace.
    BLOCK_SIZE : int or (int, int)
        Rows and keys of a cell: powers of two from 16. The kernels read cells of any size: a
        tile that spans several takes their combined state, one inside a cell takes the cell's
        (smaller cells skip more precisely; 64 or 128 matches the kernels' tiles).

    Returns
    -------
    BlockMask
        ``mask_mod``, ``shape`` (B, H, Q_LEN, KV_LEN), ``BLOCK_SIZE`` (rows, keys), ``cells``
        (per cell ``BlockMask.HIDDEN``, ``MIXED`` or ``PLAIN``) and ``sparsity()``.

    Notes
    -----
    The summary is of the captured arrays' values when it is made: make a new one when they
    change. A block_mask gives the result its mask_mod gives alone: cells it hides, the mask
    hides at every score; cells it shows whole, at every score the mask shows (an index outside
    a captured array counts as neither: such a cell is evaluated score by score, as without it).

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> doc = np.repeat(np.arange(4), 64)  # four documents of 64 tokens, packed
    >>> bm = cupyflash.create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q), None, None, 256, 256,
    ...                                  BLOCK_SIZE=64)
    >>> bm.sparsity()  # of 4 x 4 cells, those off the diagonal
    75.0
    >>> q = k = v = np.ones((1, 256, 2, 16), dtype=np.float32)
    >>> cupyflash.attention(q, k, v, block_mask=bm).shape
    (1, 256, 2, 16)
    """
    return _block_mask.create(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE)
