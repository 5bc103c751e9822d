"""The FP8 forward: ``attention`` over float8 e4m3 q, k, v with descale factors, FlashAttention-3's
FP8 call (``q_descale``, ``k_descale``, ``v_descale``; a 16-bit output).

    O = softmax(scale (q_descale Q8) (k_descale K8)^T) (v_descale V8)

On the GPU (Hopper, head_dim 128) two kernels run: fp8_vt.cu writes V transposed (the e4m3 P V
wgmma reads B K-major only), then fa3_fwd.cu with e4m3 inputs (P cast to e4m3 in registers, the
descales in the softmax's factor and in 1 / l). On the host the inputs are dequantised to
float32 and run through the exact reference (it does not round P to e4m3 as the kernel does:
scripts/fp8_accuracy.py is the kernel's bit-level twin, docs/fp8_forward.md its accuracy).

A descale is None (1.0), a positive host number, or a float32 array of shape () / (1,) (one
value), (Hkv,) or (B, Hkv) (FlashAttention-3's): the value for query head h of batch entry b is
``descale[b, h // (Hq / Hkv)]``. Device arrays are not read on the host: the kernel makes the rows
of a (batch, KV head) whose descale is not positive and finite NaN (0 would give a uniform
softmax, a plausible answer; a negative one breaks the online softmax's maximum).
"""

from __future__ import annotations

from typing import Any

from . import _host, _interop, _launch, _plan
from ._fp8 import dtype_name, host_scale, scale_form
from ._specs import FP8_FWD_HEAD_DIMS, HOPPER_ARCH
from ._validate import check_options

DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
OUT_DTYPES = ("bfloat16", "float16")
_E4M3_NAMES = ("float8_e4m3fn",)  # torch's and ml_dtypes' name for the OCP e4m3 format

_plans = _plan.new_pair_cache()


def is_fp8_call(q: Any, descales: tuple[Any, Any, Any], fp8_dtype: Any) -> bool:
    """Whether ``attention`` takes the FP8 path: a float8 (or uint8) q, or an FP8 option given.
    Cheap on the 16-bit path: two attribute reads and a compare."""
    q_descale, k_descale, v_descale = descales
    if fp8_dtype is not None or q_descale is not None or k_descale is not None or v_descale is not None:
        return True
    dtype = getattr(q, "dtype", None)
    if getattr(dtype, "itemsize", 0) != 1:
        return False
    name = str(dtype)  # a float8 type, or uint8 bytes (the path says to name their format);
    return "float8" in name or name.endswith("uint8")  # int8 and bool get the usual dtype error


def attention_fp8(
    q: Any, k: Any, v: Any, *, causal: bool, scale: float | None, window: tuple[int, int], softcap: float,
    layout: str, algorithm: str, return_lse: bool, dropout_p: float, alibi_slopes: Any, attn_mask: Any,
    descales: tuple[Any, Any, Any], out_dtype: Any, fp8_dtype: Any,
) -> Any:  # fmt: skip
    """``attention`` on float8 inputs (its arguments, checked here)."""
    if attn_mask is not None or alibi_slopes is not None or dropout_p or softcap or algorithm != "auto":
        _refuse_options(attn_mask, alibi_slopes, dropout_p, softcap, window, algorithm)
    if _interop.compiling():
        raise NotImplementedError("the FP8 forward is not a torch.compile op yet: call it outside the compiled region")
    # The straight path (CuPy arrays or CUDA tensors, a call planned before): the plan's checks
    # hold for every call with its key; only a host descale's value is checked per call.
    arrays = (q, k, v)
    descale_arrays = tuple(None if x is None or isinstance(x, (int, float)) else x for x in descales)
    found = _interop.lean_arrays(q, k, v, descale_arrays)
    if found is not None and not found[0].check_inputs(arrays):
        lib, device = found
        key = _key(lib, device, q, k, v, causal, scale, window, layout, out_dtype, fp8_dtype, descale_arrays)
        planned = _plans.lookup(key)
        if planned is not None:
            return _run(planned, lib, device, q, k, v, descales, descale_arrays, return_lse)
    _refuse_options(attn_mask, alibi_slopes, dropout_p, softcap, window, algorithm)
    if scale is not None and not scale > 0:
        raise ValueError(f"the FP8 forward takes a positive scale, got {scale!r}")
    options = check_options(causal, scale, window, softcap)
    out_name = _out_dtype_name(out_dtype)
    if _interop.traced(arrays):
        raise NotImplementedError("the FP8 forward does not run under a JAX transformation yet")
    if _interop.needs_autograd(arrays):
        _interop.refuse_autograd("the FP8 forward")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_e4m3(name, x, fp8_dtype)
    problem = _problem(q, k, v, options, layout)
    hosts = [host_scale(name, x) for name, x in zip(DESCALE_NAMES, descales, strict=True)]
    device_descales = tuple(None if h is not None or x is None else x for h, x in zip(hosts, descales, strict=True))
    found_all = _interop.gpu_arrays(("q", "k", "v", *DESCALE_NAMES), (q, k, v, *device_descales))
    if found_all is None:
        out, lse = _host_fp8(q, k, v, problem, descales, out_name)
        return (out, lse) if return_lse else out
    lib, device, _ = found_all
    if lib.name not in (_interop.CUPY, _interop.TORCH):
        raise NotImplementedError("the FP8 forward takes PyTorch float8 tensors or CuPy uint8 arrays on the GPU")
    forms = {
        name: "host" if x is None else _descale_form(lib, name, x, problem.batch, problem.heads_kv)
        for name, x in zip(DESCALE_NAMES, device_descales, strict=True)
    }

    def plan() -> tuple[_plan.Launch, _plan.Launch]:
        info = _plan.device_info(device)
        if info.arch != HOPPER_ARCH:
            raise ValueError(f"the FP8 forward runs on the Hopper kernel (sm_90a), not on {info.arch}")
        if problem.head_dim not in FP8_FWD_HEAD_DIMS:
            raise ValueError(f"the FP8 forward takes head_dim {FP8_FWD_HEAD_DIMS} on the GPU, got {problem.head_dim}")
        return _plan.plan_fp8_forward(problem, out_name, info, tuple(q.shape), forms)

    key = _key(lib, device, q, k, v, causal, scale, window, layout, out_dtype, fp8_dtype, device_descales)
    return _run(_plans.get(key, plan), lib, device, q, k, v, descales, device_descales, return_lse)


def _key(
    lib: _interop.ArrayLib, device: int, q: Any, k: Any, v: Any, causal: Any, scale: Any, window: Any, layout: Any,
    out_dtype: Any, fp8_dtype: Any, descale_arrays: tuple[Any, ...],
) -> tuple[Any, ...]:  # fmt: skip
    """A call's plan key: its arguments as given (an unhashable one, a list window, plans uncached)."""
    arrays = tuple(None if x is None else (tuple(x.shape), x.dtype) for x in descale_arrays)
    return (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal, scale, window, layout,
            out_dtype, fp8_dtype, arrays)  # fmt: skip


def _run(
    planned: tuple[_plan.Launch, _plan.Launch], lib: _interop.ArrayLib, device: int, q: Any, k: Any, v: Any,
    descales: tuple[Any, ...], descale_arrays: tuple[Any, ...], return_lse: bool,
) -> Any:  # fmt: skip
    """V's transpose, then the attention kernel; a host descale's value into its field."""
    transpose, main = planned
    (vt,) = _launch.run_outputs(transpose, lib, device, {"v": v})
    by_name: dict[str, Any] = {"q": q, "k": k, "v": vt}
    for name, given, array in zip(DESCALE_NAMES, descales, descale_arrays, strict=True):
        if array is not None:
            by_name[name] = array
        elif given is not None:
            by_name[name] = host_scale(name, given)
    out, lse = _launch.run(main, lib, device, by_name, return_lse)
    return (out, lse) if return_lse else out


def _refuse_options(
    attn_mask: Any, alibi_slopes: Any, dropout_p: Any, softcap: Any, window: Any, algorithm: str
) -> None:  # fmt: skip
    refused = {
        "attn_mask": attn_mask is not None,
        "alibi_slopes": alibi_slopes is not None,
        "dropout_p": bool(dropout_p),
        "softcap": bool(softcap),
        "window": tuple(window) != (-1, -1),
    }
    named = [name for name, given in refused.items() if given]
    if named:
        raise ValueError(f"the FP8 forward (float8 q, k, v) has no {', '.join(named)} yet")
    if algorithm not in ("auto", "fa3"):
        raise ValueError(
            f"the FP8 forward runs on the Hopper kernel: algorithm must be 'auto' or 'fa3', got {algorithm!r}"
        )


def _out_dtype_name(out_dtype: Any) -> str:
    name = "bfloat16" if out_dtype is None else str(out_dtype).removeprefix("torch.")
    if name not in OUT_DTYPES:
        raise TypeError(f"out_dtype of the FP8 forward must be one of {OUT_DTYPES}, got {out_dtype!r}")
    return name


def _check_e4m3(name: str, x: Any, fp8_dtype: Any) -> None:
    """An e4m3 input: a float8_e4m3fn array, or uint8 bytes named by fp8_dtype='e4m3'."""
    if fp8_dtype is not None and fp8_dtype != "e4m3":
        raise ValueError(f"fp8_dtype must be 'e4m3' (the FP8 forward's format) or None, got {fp8_dtype!r}")
    dtype = dtype_name(x)
    if dtype in _E4M3_NAMES:
        return
    if dtype == "uint8":
        if fp8_dtype is None:
            raise TypeError(f"{name} is uint8: name its float8 format with fp8_dtype='e4m3' (CuPy has no float8 dtype)")
        return
    raise TypeError(
        f"the FP8 forward takes q, k and v in float8_e4m3fn (or uint8 bytes with fp8_dtype='e4m3'); {name} is {dtype}"
        + (" (descales and fp8_dtype are for float8 inputs)" if "float8" not in dtype else "")
    )


def _problem(q: Any, k: Any, v: Any, options: tuple[Any, ...], layout: str) -> Any:
    from ._api import _problem as attention_problem

    return attention_problem(q, k, v, options, layout)


def _descale_form(lib: _interop.ArrayLib, name: str, x: Any, batch: int, heads_kv: int) -> str:
    """A device descale's form (``_plan.plan_fp8_forward``)."""
    return _form(name, tuple(x.shape), lib.dtype_name(x), batch, heads_kv)


def _form(name: str, shape: tuple[int, ...], dtype: str, batch: int, heads_kv: int) -> str:
    """ "tensor" (() or (1,)), "head" ((Hkv,)) or "batch_head" ((B, Hkv)) for a float32 descale."""
    if shape == (batch, heads_kv) and dtype == "float32":
        return "batch_head"
    try:
        return scale_form(name, shape, dtype, heads_kv)
    except ValueError:
        raise ValueError(
            f"{name} must have shape () or (1,), (heads_kv,) = ({heads_kv},) or (batch, heads_kv) = "
            f"({batch}, {heads_kv}), got {shape}"
        ) from None


def _host_fp8(q: Any, k: Any, v: Any, problem: Any, descales: tuple[Any, Any, Any], out_name: str) -> tuple[Any, Any]:
    """The host path: q, k, v dequantised to float32 (times their descales), exact attention,
    the output rounded to ``out_name``; LSE float32."""
    import numpy as np

    from ._fp8 import _float8_view, _is_torch
    from .reference import to_numpy64

    group = problem.heads_q // problem.heads_kv if problem.heads_kv else 1
    head_axis = 2 if problem.layout == "bshd" else 1
    values = []
    for name, x, descale in (("q", q, descales[0]), ("k", k, descales[1]), ("v", v, descales[2])):
        x32 = np.asarray(to_numpy64(_float8_view(x, "e4m3")), dtype=np.float32)
        factor = _host_descale(name, descale, problem.batch, problem.heads_kv)  # (B, Hkv) float64
        if name == "q":
            factor = np.repeat(factor, group, axis=1)
        shape = [1, 1, 1, 1]
        shape[0], shape[head_axis] = factor.shape
        values.append((x32 * factor.reshape(shape)).astype(np.float32))
    out, lse = _host.attention(values[0], values[1], values[2], problem, "auto")
    if _is_torch(q):
        import torch

        return torch.from_numpy(np.asarray(out)).to(getattr(torch, out_name)), torch.from_numpy(np.asarray(lse))
    import ml_dtypes

    out_type = ml_dtypes.bfloat16 if out_name == "bfloat16" else np.float16
    return np.asarray(out).astype(out_type), np.asarray(lse)


def _host_descale(name: str, descale: Any, batch: int, heads_kv: int) -> Any:
    """A descale as a (B, Hkv) float64 array, its values checked positive and finite."""
    import numpy as np

    from .reference import to_numpy64

    value = host_scale(name, descale)
    if descale is None or value is not None:
        return np.full((batch, heads_kv), 1.0 if value is None else value)
    form = _form(name, tuple(descale.shape), dtype_name(descale), batch, heads_kv)
    grid = {"tensor": (1, 1), "head": (1, heads_kv), "batch_head": (batch, heads_kv)}[form]
    values = np.broadcast_to(to_numpy64(descale).reshape(grid), (batch, heads_kv)).copy()
    bad = values[~(np.isfinite(values) & (values > 0))]
    if bad.size:
        raise ValueError(f"{name} must be positive and finite, got {bad.tolist()}")
    return values
