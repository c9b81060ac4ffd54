"""What :meth:`Attention.tune` gains over flexspec's own kernel options, and what it costs.

For each spec and mode, ``backend="flex"`` (the backend that takes tuned options), bf16:

* ``forward`` and ``forward+backward``: the GPU suite's shape (B=4, H=16, 8192 positions,
  D=128), ``causal & doc`` with 8 documents of equal length;
* ``decode``: one new token at the end of a 32K cache (B=8, Hq=32, Hkv=8, D=128).

``tune`` runs with its default candidates (:func:`flexspec.runtime.tuning.default_candidates`:
12 forward tilings, 9 backward ones, 11 decoding ones); ``tuning s`` is its wall time, compiles
included. Then the call is timed with ``triton.testing.do_bench`` (median) twice in the same
run: compiled without the tuned table (``default``) and with it (``tuned``), and the two
outputs are compared (max |difference|). ``gain`` is default over tuned. The last lines printed
are the table (markdown).

    python benchmarks/tuning.py
    python benchmarks/tuning.py --modes decode --specs "causal & doc"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402

SPECS = ["causal & doc", "sliding_window(1024)", "causal + softcap(30)"]
DECODE_SPECS = ["sliding_window(4096)", "causal & doc", "causal + alibi"]
MODES = ["forward", "forward+backward", "decode"]
TRAINING = dict(batch=4, heads=16, kv_heads=16, q_len=8192, kv_len=8192)
DECODING = dict(batch=8, heads=32, kv_heads=8, q_len=1, kv_len=32768)
DIM, DOCUMENTS = 128, 8


def inputs(shape: dict, device) -> tuple:
    generator = torch.Generator(device=device).manual_seed(0)

    def tensor(heads, length):
        return torch.randn(shape["batch"], heads, length, DIM, device=device,
                           dtype=torch.bfloat16, generator=generator)
    q = tensor(shape["heads"], shape["q_len"])
    k, v = tensor(shape["kv_heads"], shape["kv_len"]), tensor(shape["kv_heads"], shape["kv_len"])
    length = shape["kv_len"]
    ids = (torch.arange(length, device=device) * DOCUMENTS // length)
    return q, k, v, ids.expand(shape["batch"], length).contiguous()


def timed(attn, q, k, v, backward: bool, call: dict) -> tuple:
    """(median ms, output) of one call, with its backward where asked."""
    import triton.testing
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]

    def once():
        out = attn(*leaves, **call)
        if backward:
            torch.autograd.grad(out, leaves, torch.ones_like(out))
        return out
    with torch.set_grad_enabled(backward):
        out = once().detach()
        ms = triton.testing.do_bench(once, warmup=10, rep=50, return_mode="median")
    return ms, out


def measure(text: str, mode: str, device) -> dict:
    shape = DECODING if mode == "decode" else TRAINING
    q, k, v, ids = inputs(shape, device)
    call = {"doc_ids": ids} if "doc" in text else {}
    if mode == "decode":
        call["q_offset"] = shape["kv_len"] - 1
    backward = mode == "forward+backward"
    row = {"spec": text, "mode": mode}
    torch._dynamo.reset()  # each row compiles on its own (a static batch for decoding)
    attn = flexspec.compile(text, backend="flex")
    started = time.perf_counter()
    result = attn.tune(q, k, v, backward=backward, repeats=20, **call)
    row["tuning s"] = time.perf_counter() - started
    row["best"] = result.best
    row["failed"] = len(result.failed)
    print(result, flush=True)
    default = flexspec.compile(text, backend="flex")
    row["default"], expected = timed(default, q, k, v, backward, call)
    row["tuned"], out = timed(attn, q, k, v, backward, call)
    row["difference"] = float((out.float() - expected.float()).abs().max())
    return row


def table(rows) -> str:
    lines = ["| spec | mode | default ms | tuned ms | gain | tuning s | best options | "
             "candidates left out | max diff |", "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['spec']}` | {r['mode']} | {r['error']} |" + " - |" * 6)
            continue
        lines.append(f"| `{r['spec']}` | {r['mode']} | {r['default']:.3f} | {r['tuned']:.3f} | "
                     f"{r['default'] / r['tuned']:.2f}x | {r['tuning s']:.0f} | "
                     f"{r['best'] or 'default'} | {r['failed']} | {r['difference']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--specs", nargs="+", default=None,
                        help="specs (default: three per mode, see SPECS and DECODE_SPECS)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tuning.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    device = torch.device("cuda")
    rows = []
    for mode in args.modes:
        for text in args.specs or (DECODE_SPECS if mode == "decode" else SPECS):
            try:
                rows.append(measure(text, mode, device))
            except Exception as error:  # noqa: BLE001 - a failed row is a table cell
                rows.append({"spec": text, "mode": mode,
                             "error": f"fails: {type(error).__name__}"})
            print({key: value for key, value in rows[-1].items()}, flush=True)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
