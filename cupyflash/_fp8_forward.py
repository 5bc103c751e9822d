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

from dataclasses import dataclass
from typing import Any

from . import _attention, _device, _host, _interop, _launch, _plan
from ._fp8 import dtype_name, host_scale, scale_form
from ._specs import FP8_FWD_HEAD_DIMS, HOPPER_ARCH
from ._validate import Options, Problem

DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
OUT_DTYPES = ("bfloat16", "float16")
_E4M3_NAMES = ("float8_e4m3fn",)  # torch's and ml_dtypes' name for the OCP e4m3 format

_plans = _plan.new_pair_cache()


def is_fp8_array(q: Any) -> bool:
    """Whether ``q`` makes ``attention`` an FP8 call: a float8 (or uint8) array. Cheap on the
    16-bit path: two attribute reads and a compare (``attention`` checks the FP8 options, the
    other way in, inline before it); read directly, not by ``getattr`` with a default (~30 ns)."""
    try:
        dtype = q.dtype
        if dtype.itemsize != 1:
            return False
    except AttributeError:  # not an array (refused by name further on), or a dtype of no size
        return False
    name = str(dtype)  # a float8 type, or uint8 bytes (the path says to name their format);
    return "float8" in name or name.endswith("uint8")  # int8 and bool get the usual dtype error


@dataclass(slots=True)
class Fp8Forward:
    """One FP8 ``attention`` call: float8 e4m3 q, k, v (or uint8 bytes with ``fp8_dtype``), its
    checked options and its descales as given (None, a host number, or a float32 array)."""

    q: Any
    k: Any
    v: Any
    options: Options
    layout: str
    descales: tuple[Any, Any, Any]
    out_dtype: Any = None
    fp8_dtype: Any = None

    names = ("q", "k", "v", *DESCALE_NAMES)
    writes = False

    def arrays(self) -> tuple[Any, ...]:
        """q, k, v and the descales that are arrays (a host number as None)."""
        return (self.q, self.k, self.v, *_device_descales(self.descales))

    def prepared(self) -> Fp8Forward:
        return self

    def on(self, arrays: list[Any]) -> Fp8Forward:
        q, k, v, *adopted = arrays
        descales = tuple(x if a is None else a for x, a in zip(self.descales, adopted, strict=True))
        return Fp8Forward(q, k, v, self.options, self.layout, descales, self.out_dtype, self.fp8_dtype)


def _device_descales(descales: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        None if x is None or isinstance(x, (int, float)) or host_scale(name, x) is not None else x
        for name, x in zip(DESCALE_NAMES, descales, strict=True)
    )


def refuse_options(options: Options, algorithm: str, dropout_p: Any, alibi_slopes: Any, attn_mask: Any) -> None:
    """What the FP8 forward does not take (yet), refused before anything runs."""
    refused = {
        "attn_mask": attn_mask is not None,
        "alibi_slopes": alibi_slopes is not None,
        "dropout_p": bool(dropout_p),
        "softcap": bool(options.softcap),
        "window": options.window != (-1, -1),
    }
    named = [name for name, given in refused.items() if given]
    if named:
        raise ValueError(f"the FP8 forward (float8 q, k, v) has no {', '.join(named)} yet")
    if algorithm not in ("auto", "fa3"):
        raise ValueError(
            f"the FP8 forward runs on the Hopper kernel: algorithm must be 'auto' or 'fa3', got {algorithm!r}"
        )


def _checked(call: Fp8Forward) -> tuple[Problem, str]:
    """The call's problem and output dtype, every input checked (once per plan on the GPU)."""
    scale = call.options.scale
    if scale is not None and not scale > 0:
        raise ValueError(f"the FP8 forward takes a positive scale, got {scale!r}")
    out_name = _out_dtype_name(call.out_dtype)
    for name, x in (("q", call.q), ("k", call.k), ("v", call.v)):
        _check_e4m3(name, x, call.fp8_dtype)
    return _attention.problem_of(call.q, call.k, call.v, call.options, call.layout), out_name


def host_forward(call: Fp8Forward) -> tuple[Any, Any]:
    """The FP8 forward on host arrays: dequantised, then the exact reference."""
    problem, out_name = _checked(call)
    for name, x in zip(DESCALE_NAMES, call.descales, strict=True):
        host_scale(name, x)
    return _host_fp8(call.q, call.k, call.v, problem, call.descales, out_name)


def gpu_forward(lib: _interop.ArrayLib, device: int, call: Fp8Forward, want_lse: bool) -> tuple[Any, Any]:
    """V's transpose, then the Hopper kernel on e4m3 inputs: (out, lse), lse None unless wanted.
    A planned call's checks hold for every call with its key: only a host descale's value is
    checked per call."""
    if lib.name not in (_interop.CUPY, _interop.TORCH):
        raise NotImplementedError("the FP8 forward takes PyTorch float8 tensors or CuPy uint8 arrays on the GPU")
    q, k, v = call.q, call.k, call.v
    device_descales = _device_descales(call.descales)
    forms_key = tuple(None if x is None else (tuple(x.shape), x.dtype) for x in device_descales)
    key = (lib.name, device, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, call.options, call.layout,
           call.out_dtype, call.fp8_dtype, forms_key)  # fmt: skip

    def plan() -> tuple[_plan.Launch, _plan.Launch]:
        problem, out_name = _checked(call)
        info = _device.device_info(device)
        if info.arch != HOPPER_ARCH:
            raise ValueError(f"the FP8 forward runs on the Hopper kernel (sm_90a), not on {info.arch}")
        if problem.head_dim not in FP8_FWD_HEAD_DIMS:
            raise ValueError(f"the FP8 forward takes head_dim {FP8_FWD_HEAD_DIMS} on the GPU, got {problem.head_dim}")
        forms = {
            name: "host" if x is None else _descale_form(lib, name, x, problem.batch, problem.heads_kv)
            for name, x in zip(DESCALE_NAMES, device_descales, strict=True)
        }
        return _plan.plan_fp8_forward(problem, out_name, info, tuple(q.shape), forms)

    try:
        planned = _plans.find(key)
    except TypeError:  # a part that cannot be hashed: planned uncached (which refuses it)
        planned = None
    if planned is None:
        planned = _plans.get(key, plan)
    transpose, main = planned
    (vt,) = _launch.run_outputs(transpose, lib, device, {"v": v})
    by_name: dict[str, Any] = {"q": q, "k": k, "v": vt}
    for name, given, array in zip(DESCALE_NAMES, call.descales, device_descales, strict=True):
        if array is not None:
            by_name[name] = array
        elif given is not None:
            by_name[name] = host_scale(name, given)
    return _launch.run(main, lib, device, by_name, want_lse)


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

    from ._fp8 import float8_view, is_torch
    from .reference import to_numpy64

    group = problem.heads_q // problem.heads_kv if problem.heads_kv else 1
    head_axis = 2 if problem.layout == "bshd" else 1
    values = []
    for name, x, descale in (("q", q, descales[0]), ("k", k, descales[1]), ("v", v, descales[2])):
        x32 = np.asarray(to_numpy64(float8_view(x, "e4m3")), dtype=np.float32)
        factor = _host_descale(name, descale, problem.batch, problem.heads_kv)  # (B, Hkv) float64
        if name == "q":
            factor = np.repeat(factor, group, axis=1)
        shape = [1, 1, 1, 1]
        shape[0], shape[head_axis] = factor.shape
        values.append((x32 * factor.reshape(shape)).astype(np.float32))
    out, lse = _host.attention(values[0], values[1], values[2], problem, "auto")
    if is_torch(q):
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
