"""Values for the tensors a spec reads when no model supplies them: deterministic, readable demo
values (the same for pictures, ``flexspec explain`` and the demo) and values given as text with
``--bind NAME=VALUES`` on the command line."""

from __future__ import annotations

import math

import torch

from flexspec import ir
from flexspec.errors import SpecError, did_you_mean
from flexspec.ir.specialize import broadcast_dims, declared_shape
from flexspec.kernels.tensors import NORMAL_INIT_STD, torch_dtype
from flexspec.limits import (check_bind_count, check_float_constant, check_int_constant,
                             check_table)

# H when the spec reads heads (alibi's slopes depend on it) and nothing else fixes it.
DEFAULT_HEADS = 8


def attention_of(attn_or_spec):
    """The compiled :class:`~flexspec.runtime.attention.Attention` of a spec, text or Attention."""
    from flexspec.runtime.attention import Attention

    if isinstance(attn_or_spec, Attention):
        return attn_or_spec
    from flexspec import compile as compile_spec

    return compile_spec(attn_or_spec)


def _positional(expr: ir.Expr) -> bool:
    return bool({"Q_LEN", "KV_LEN"} & ir.free_vars(expr))


def demo_bindings(attn_or_spec, q_len: int, kv_len: int, *, batch: int = 0,
                  heads: int = DEFAULT_HEADS, given: dict | None = None) -> tuple[dict, list[str]]:
    """Example values for the tensors a spec reads that ``given`` lacks, and one line per value
    saying what it is. Along a position dimension (``[KV_LEN]``) an int tensor holds 3 equal
    documents (``0 0 0 0 1 1 1 1 2 2 2 2``) and a bool tensor marks the first position only;
    everything else is zeros (False). Dimensions ``B`` and ``H`` get size 1 (broadcast).
    A learnable table (a dimension other than ``B``, ``H``) holds its own index along its last
    dimension, so the heat shows which entry each pair reads (the bucket of ``t5_bias``); other
    learnable tensors get their initial value (a seeded one for random inits)."""
    attn = attention_of(attn_or_spec)
    given = given or {}
    sizes = {"B": batch + 1, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
    values, notes = {}, []
    for tensor in attn.ir.tensors():
        if tensor.origin == "builtin" or tensor.name in given:
            continue
        may_broadcast = broadcast_dims(tensor)
        shape = [1 if one else n for one, n in zip(may_broadcast, declared_shape(tensor, sizes))]
        check_table(tensor.name, tuple(shape))
        dtype = torch_dtype(tensor)
        if tensor.origin == "learnable":
            table = [i for i, one in enumerate(may_broadcast) if not one]
            if table:
                # entry i holds i: the heat then shows which entry each (q, kv) pair reads
                dim = table[-1]
                line = [1] * len(shape)
                line[dim] = shape[dim]
                values[tensor.name] = torch.arange(shape[dim], dtype=torch.float32) \
                    .reshape(line).expand(shape).clone()
                notes.append(f"{tensor.name}: learnable (initial value {tensor.init or 'zeros'}); "
                             "drawn with entry i = i, so the heat shows which entry each pair "
                             "reads")
            elif tensor.init == "normal":
                generator = torch.Generator().manual_seed(0)
                values[tensor.name] = torch.randn(shape, generator=generator) * NORMAL_INIT_STD
                notes.append(f"{tensor.name}: learnable, drawn at a seeded initial value "
                             f"(normal, std {NORMAL_INIT_STD})")
            else:
                values[tensor.name] = torch.zeros(shape)
                notes.append(f"{tensor.name}: learnable, drawn at its initial value (zeros)")
            continue
        positions = [i for i, d in enumerate(tensor.shape) if _positional(d)]
        value = torch.zeros(shape, dtype=dtype)
        if positions and tensor.dtype in ("int", "bool"):
            dim = positions[-1]
            n = shape[dim]
            line = [1] * len(shape)
            line[dim] = n
            ids = torch.arange(n) * 3 // n
            if tensor.dtype == "int":
                value = ids.reshape(line).expand(shape).clone()
                what = "3 equal documents"
            else:
                value = (torch.arange(n) == 0).reshape(line).expand(shape).clone()
                what = "only the first position set"
            if n <= 24:
                shown = " ".join(str(int(v)) for v in value.reshape(line).reshape(-1).tolist())
            elif tensor.dtype == "int":
                shown = ", ".join(f"{d} at {int(ids.eq(d).nonzero().min())}.."
                                  f"{int(ids.eq(d).nonzero().max())}" for d in range(3))
            else:
                shown = f"True at 0, False at 1..{n - 1}"
        else:
            what = "all False" if tensor.dtype == "bool" else "zeros"
            shown = None
        values[tensor.name] = value
        note = f"{tensor.name}: demo value, {what}"
        notes.append(note + (f" ({shown})" if shown is not None else ""))
    return values, notes


# ---------------------------------------------------------------------------------------------
# Values given as text on the command line (--bind NAME=VALUES)


_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _bind_scalar(text: str, dtype: str, name: str):
    word = text.strip()
    if dtype == "bool":
        if word.lower() in _TRUE + _FALSE:
            return word.lower() in _TRUE
        raise _invalid_value(word, dtype, name)
    try:
        value = int(word) if dtype == "int" else float(word)
    except ValueError:
        raise _invalid_value(word, dtype, name) from None
    # the range checks raise SpecErrors, which are ValueErrors too: outside the try above, so
    # that their message (the number is out of range) is not replaced by "not a valid value"
    if dtype == "int":
        check_int_constant(value, f"--bind {name}: ")
    else:
        check_float_constant(value, f"--bind {name}: ", finite=True)
    return value


def _invalid_value(word: str, dtype: str, name: str) -> SpecError:
    kind = {"bool": "booleans (true, false)", "int": "ints", "float": "numbers"}[dtype]
    return SpecError(f"--bind {name}: '{word}' is not a valid value; '{name}' holds {kind}")


def _bind_values(text: str, dtype: str, name: str) -> list:
    values, total = [], 0
    for item in text.split(","):
        value, star, count = item.partition("*")
        repeat = 1
        if star:
            try:
                repeat = int(count)
            except ValueError:
                repeat = 0
            if repeat < 1:
                raise SpecError(f"--bind {name}: '{item.strip()}' repeats a value a positive "
                                "number of times, like 0*4")
        if not value.strip():
            raise SpecError(f"--bind {name}: an empty value in '{text}'")
        total += repeat
        check_bind_count(total, name)
        values += [_bind_scalar(value, dtype, name)] * repeat
    return values


def parse_binds(attn, binds: list[str]) -> dict:
    """``--bind NAME=VALUES`` options as flat tensors of each tensor's declared dtype."""
    tensors = {t.name: t for t in attn.ir.tensors() if t.origin != "builtin"}
    result = {}
    for bind in binds:
        name, equals, text = bind.partition("=")
        name = name.strip()
        if not equals or not name:
            raise SpecError(f"--bind expects NAME=VALUES, got '{bind}'")
        if name not in tensors:
            if not tensors:
                raise SpecError(f"--bind {name}: this spec reads no runtime tensors")
            raise SpecError(f"--bind {name}: the spec reads no tensor '{name}'."
                            f"{did_you_mean(name, tensors)} It reads: {', '.join(tensors)}")
        if name in result:
            raise SpecError(f"--bind {name} is given twice")
        tensor = tensors[name]
        result[name] = torch.tensor(_bind_values(text, tensor.dtype, name),
                                    dtype=torch_dtype(tensor))
    return result


def _shape_binds(attn, flat: dict, sizes: dict) -> dict:
    """Each flat ``--bind`` value shaped for its tensor: one value per position of the last
    dimension (leading dimensions broadcast), every value in order, or one value filling it."""
    tensors = {t.name: t for t in attn.ir.tensors()}
    shaped = {}
    for name, value in flat.items():
        tensor = tensors[name]
        declared = declared_shape(tensor, sizes)
        # B never has to be spelled out: a batch dimension of 1 broadcasts
        full = [1 if isinstance(d, ir.Var) and d.name == "B" else n
                for d, n in zip(tensor.shape, declared)]
        n = value.numel()
        if not declared:
            if n != 1:
                raise SpecError(f"--bind {name}: one value expected, got {n}")
            shaped[name] = value.reshape(())
        elif n == 1:
            shaped[name] = value.reshape([1] * len(full)).expand(full).clone()
        elif n == math.prod(full):
            shaped[name] = value.reshape(full)
        elif n == declared[-1]:
            shaped[name] = value
        else:
            dims = ", ".join(str(d) for d in tensor.shape)
            counts = sorted({declared[-1], math.prod(full)})
            need = " or ".join(str(c) for c in counts)
            raise SpecError(f"--bind {name}: {n} values given, but {tensor.dtype}[{dims}] = "
                            f"[{', '.join(str(d) for d in declared)}] needs {need} (or 1 to "
                            "fill it)")
    return shaped


def bindings_from_text(attn, flat: dict, sizes: dict) -> tuple[dict, list[str]]:
    """The runtime tensors of ``flexspec render`` and ``explain``: the values of
    :func:`parse_binds` shaped for their tensors, demo values for the rest, and one note per demo
    value."""
    given = _shape_binds(attn, flat, sizes)
    demo, notes = demo_bindings(attn, sizes["Q_LEN"], sizes["KV_LEN"], batch=sizes["B"] - 1,
                                heads=sizes["H"], given=given)
    return {**demo, **given}, notes
