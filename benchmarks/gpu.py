"""The GPU benchmark suite: flexspec's ``auto`` backend against the hand-written options.

For each spec and shape it builds what a user would write by hand (a ``mask_mod`` and
``score_mod`` with ``create_block_mask``, compiled ``flex_attention`` with the Triton template and,
where FlashAttention-4 is installed, with ``kernel_options={"BACKEND": "FLASH"}``; cuDNN SDPA and
SDPA's FlashAttention-2 where the spec is plain full or causal attention), checks every output
against flexspec's float64 reference on a sample of query rows, then times forward and
forward+backward with ``triton.testing.do_bench`` (median). Effective TFLOP/s count only the
visible (query, key) pairs (``Attention.explain``); the backward counts 2.5 forwards.

    python benchmarks/gpu.py                          # the whole suite (both shapes)
    python benchmarks/gpu.py --shapes 4x16x8192x128   # one shape
    python benchmarks/gpu.py --overhead               # per-call overhead table only
    python benchmarks/gpu.py --layout bshd            # q, k, v as views of (B, S, H, D) tensors
    python benchmarks/gpu.py --training-step          # fresh doc_ids every step (training_step.py)

Where FlashAttention-4 is installed, its own interface is a hand-written column too
(``FA4 native``: ``flash_attn_func``, or ``flash_attn_varlen_func`` with cumulative lengths
computed once outside the timed region) for the specs it implements.

Block masks, compilation and the reference check are outside the timed region. The last lines
printed are the table (markdown), also written to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402
from flexspec.runtime.fa4 import installed as flash_installed  # noqa: E402

SPECS = ["full", "causal", "sliding_window(1024)", "causal & doc", "prefix_lm(2048)",
         "chunked(2048)", "causal + alibi", "causal + softcap(30)",
         "causal & window(256) + rel_bias"]
SHAPES = ["4x16x8192x128", "1x16x32768x128"]
DOCUMENTS = 8
CHECK_ROWS = 48
TOLERANCE = 2e-2  # relative error (norm) of a bf16 output against the float64 reference


# ---- what a user writes by hand ----------------------------------------------------------------


def hand_written(text: str, batch: int, heads: int, length: int, device):
    """``(mask_mod, score_mod, flexspec bindings, sdpa form)`` for one spec, written directly
    from its definition in the pattern catalogue (not from flexspec's lowering)."""
    def causal(b, h, q, kv):
        return q >= kv

    if text == "full":
        return None, None, {}, "full"
    if text == "causal":
        return causal, None, {}, "causal"
    if text == "sliding_window(1024)":
        return (lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024)), None, {}, None
    if text == "causal & doc":
        generator = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(batch):  # DOCUMENTS documents of random lengths per row
            cuts = torch.randperm(length - 1, generator=generator)[:DOCUMENTS - 1] + 1
            ids = torch.zeros(length, dtype=torch.int64)
            ids[cuts] = 1
            rows.append(ids.cumsum(0))
        doc_ids = torch.stack(rows).to(device)

        def document(b, h, q, kv):
            return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])
        return document, None, {"doc_ids": doc_ids}, None
    if text == "prefix_lm(2048)":
        return (lambda b, h, q, kv: (q >= kv) | (kv < 2048)), None, {}, None
    if text == "chunked(2048)":
        return (lambda b, h, q, kv: q // 2048 == kv // 2048), None, {}, None
    if text == "causal + alibi":
        slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device)

        def alibi(score, b, h, q, kv):
            return score - slopes[h] * (q - kv).abs()
        return causal, alibi, {}, None
    if text == "causal + softcap(30)":
        return causal, (lambda score, b, h, q, kv: 30 * torch.tanh(score / 30)), {}, None
    if text == "causal & window(256) + rel_bias":
        generator = torch.Generator().manual_seed(1)
        table = (torch.randn(heads, 257, generator=generator) * 0.5).to(device)

        def rel_bias(score, b, h, q, kv):
            return score + table[h, torch.clamp(kv - q, -128, 128) + 128]
        return ((lambda b, h, q, kv: (q >= kv) & ((q - kv).abs() <= 256)), rel_bias,
                {"rel_bias_table": table}, None)
    raise SystemExit(f"no hand-written version of '{text}'")


# ---- measuring ----------------------------------------------------------------------------------


def bench(fn, backward: bool, inputs, device) -> float:
    """Median milliseconds of ``fn()`` (and its backward) on the device."""
    if device.type != "cuda":
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            step(fn, backward, inputs)
            best = min(best, time.perf_counter() - start)
        return best * 1e3
    from triton.testing import do_bench
    return do_bench(lambda: step(fn, backward, inputs), warmup=25, rep=150,
                    return_mode="median")


def step(fn, backward: bool, inputs):
    out = fn()
    if backward:
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    return out


def relative_error(out, reference) -> float:
    out, reference = out.double(), reference.double()
    return ((out - reference).norm() / reference.norm().clamp_min(1e-12)).item()


NATIVE = {"full": {}, "causal": {"causal": True},
          "sliding_window(1024)": {"window_size": (1024, 0)},
          "causal + softcap(30)": {"causal": True, "softcap": 30.0},
          "causal & doc": {"causal": True}}


def document_boundaries(doc_ids, length):
    """Where each document starts in the rows laid end to end, then the total (int32, on the
    ids' device), and the longest document: what a data loader hands a model as ``cu_seqlens``."""
    ids = doc_ids.reshape(-1).cpu()
    starts = [i for i in range(ids.numel()) if i % length == 0 or ids[i] != ids[i - 1]]
    cumulative = torch.tensor(starts + [ids.numel()], dtype=torch.int32, device=doc_ids.device)
    return cumulative, int((cumulative[1:] - cumulative[:-1]).max())


def native_hand(text, bindings, batch, length):
    """FA4's own interface called by hand for ``text`` (``None`` where it has no such kernel):
    q, k, v transposed to (B, S, H, D), flattened for documents (a copy unless they are views of
    such tensors)."""
    if text not in NATIVE:
        return None
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    arguments = NATIVE[text]
    if "doc_ids" not in bindings:
        return lambda q, k, v: flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                               **arguments)[0].transpose(1, 2)
    cumulative, longest = document_boundaries(bindings["doc_ids"], length)

    def varlen(q, k, v):
        flat = [t.transpose(1, 2).reshape(batch * length, *t.shape[1::2]) for t in (q, k, v)]
        out = flash_attn_varlen_func(*flat, cu_seqlens_q=cumulative, cu_seqlens_k=cumulative,
                                     max_seqlen_q=longest, max_seqlen_k=longest, **arguments)[0]
        return out.reshape(batch, length, *out.shape[1:]).transpose(1, 2)
    return varlen


def options(text, mask_mod, score_mod, sdpa, bindings, batch, heads, length, device, flash):
    """Hand-written options as ``name -> function(q, k, v)``."""
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, batch if "doc" in text else None, None, length, length, device=device)
    found = {}
    if device.type == "cuda" or mask_mod is not None:
        triton = torch.compile(flex_attention)
        found["flex triton"] = lambda q, k, v: triton(q, k, v, score_mod=score_mod,
                                                      block_mask=block_mask)
    if flash:
        flash_entry = torch.compile(flex_attention)
        found["flex FLASH"] = lambda q, k, v: flash_entry(
            q, k, v, score_mod=score_mod, block_mask=block_mask,
            kernel_options={"BACKEND": "FLASH"})
        native = native_hand(text, bindings, batch, length)
        if native is not None:
            found["FA4 native"] = native
    if sdpa is not None:
        causal = sdpa == "causal"
        if device.type == "cuda":
            for name, backend in (("sdpa cuDNN", SDPBackend.CUDNN_ATTENTION),
                                  ("sdpa FA2", SDPBackend.FLASH_ATTENTION)):
                def run(q, k, v, backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                found[name] = run
        else:
            found["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                           is_causal=causal)
    return found


def suite(args, device) -> list[dict]:
    flash = device.type == "cuda" and flash_installed()
    rows = []
    for shape in args.shapes:
        batch, heads, length, dim = (int(n) for n in shape.split("x"))
        for text in args.specs:
            torch._dynamo.reset()  # each spec starts with a fresh recompile budget
            mask_mod, score_mod, bindings, sdpa = hand_written(text, batch, heads, length,
                                                               device)
            generator = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=args.dtype,
                                   generator=generator) for _ in range(3))
            if args.layout == "bshd":  # the same values, as views of (B, S, H, D) tensors
                q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            attn = flexspec.compile(text)
            explanation = attn.explain(q, k, v, **bindings)
            sample = torch.Generator().manual_seed(2)
            check = torch.cat([torch.arange(CHECK_ROWS // 2),
                               torch.randint(0, length, (CHECK_ROWS // 2,), generator=sample)])
            check = check.to(device)
            reference = attn.reference(q[:1], k[:1], v[:1], rows=check,
                                       **_first(bindings))
            candidates = {"flexspec": lambda q, k, v: attn(q, k, v, **bindings)}
            if "doc_ids" in bindings:
                # the documents as boundaries, as a data loader gives them: a step of a
                # one-layer model (a new Step per call)
                bounds, longest = document_boundaries(bindings["doc_ids"], length)
                candidates[STEP] = lambda q, k, v: attn(
                    q, k, v, step=flexspec.Step(cu_seqlens=bounds, max_seqlen=longest))
            candidates.update(options(text, mask_mod, score_mod, sdpa, bindings, batch, heads,
                                      length, device, flash))
            for mode in args.modes:
                backward = mode == "fwd+bwd"
                inputs = [t.detach().requires_grad_(backward) for t in (q, k, v)]
                chosen = attn.explain(*inputs, **bindings).choice.backend
                row = {"spec": text, "shape": shape, "mode": mode, "auto": chosen}
                for name, fn in candidates.items():
                    try:
                        with torch.no_grad():
                            out = fn(*inputs)[:1, :, check]
                        error = relative_error(out, reference)
                        if not error <= TOLERANCE:
                            row[name] = f"wrong ({error:.2g})"
                            continue
                        row[name] = bench(lambda: fn(*inputs), backward, inputs, device)
                    except Exception as err:  # noqa: BLE001 - a failed option is a table cell
                        row[name] = f"fails: {type(err).__name__}"
                        print(f"  {text} {mode} {name}: {str(err).splitlines()[0][:160]}",
                              flush=True)
                row["flops"] = explanation.flops * (3.5 if backward else 1.0)
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _first(bindings: dict) -> dict:
    """Bindings for the reference's slice (batch 0, all heads: H-dependent specs such as alibi
    need the true H)."""
    return {name: value[:1] if name == "doc_ids" else value for name, value in bindings.items()}


HAND = ["flex triton", "flex FLASH", "FA4 native", "sdpa cuDNN", "sdpa FA2", "sdpa"]
STEP = "flexspec cu_seqlens"  # the documents given to a flexspec.Step as boundaries


def _line(row: dict) -> str:
    cells = []
    for name in ["flexspec", STEP] + HAND:
        if name in row:
            value = row[name]
            cells.append(f"{name} {value:.3f}" if isinstance(value, float) else f"{name} {value}")
    return f"{row['spec']:34s} {row['shape']:15s} {row['mode']:8s} auto={row['auto']:6s} " + \
        "  ".join(cells)


def table(rows: list[dict]) -> str:
    present = [name for name in HAND if any(name in row for row in rows)]
    stepped = any(STEP in row for row in rows)
    header = ["spec", "shape", "mode", "auto", "flexspec ms"] + [f"{STEP} ms"] * stepped + \
        [f"{n} ms" for n in present] + ["flexspec TFLOP/s", "flexspec / best"] + \
        [f"{STEP} / best"] * stepped + ["flexspec / triton"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ours = row["flexspec"]
        times = [row[n] for n in present if isinstance(row.get(n), float)]
        best = min(times) if times else math.nan
        triton = row.get("flex triton")
        cells = [row["spec"], row["shape"], row["mode"], row["auto"], _cell(ours)]
        cells += [_cell(row.get(STEP, "-"))] * stepped
        cells += [_cell(row.get(n, "-")) for n in present]
        cells += [f"{row['flops'] / ours / 1e9:.1f}" if isinstance(ours, float) else "-",
                  _ratio(ours, best)]
        cells += [_ratio(row.get(STEP), best)] * stepped
        cells += [_ratio(ours, triton)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(value, baseline) -> str:
    ok = isinstance(value, float) and isinstance(baseline, float) and baseline == baseline
    return f"{value / baseline:.3f}" if ok else "-"


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# ---- per-call overhead --------------------------------------------------------------------------


OVERHEAD_SPECS = ("sliding_window(1024)", "causal + alibi", "causal & doc")
OVERHEAD_LENGTH = 256


@dataclass
class OverheadCase:
    """One spec at B1 H2 S256 D64 (bf16 on CUDA), where the host path, not the kernel, sets the
    pace: the inputs, the hand-written pieces (mods, prebuilt block mask, compiled flex_attention) and
    flexspec's Attention (backend 'flex')."""

    qkv: tuple
    bindings: dict
    score_mod: object
    block_mask: object
    compiled: object
    attn: object

    @classmethod
    def build(cls, text: str, device) -> "OverheadCase":
        torch._dynamo.reset()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        length = OVERHEAD_LENGTH
        mask_mod, score_mod, bindings, _ = hand_written(text, 1, 2, length, device)
        qkv = tuple(torch.randn(1, 2, length, 64, device=device, dtype=dtype) for _ in range(3))
        block_mask = create_block_mask(mask_mod, 1 if bindings else None, None, length, length,
                                       device=device)
        return cls(qkv, bindings, score_mod, block_mask, torch.compile(flex_attention),
                   flexspec.compile(text, backend="flex"))

    def hand(self):
        return self.compiled(*self.qkv, score_mod=self.score_mod, block_mask=self.block_mask)

    def ours(self):
        return self.attn(*self.qkv, **self.bindings)


def overhead(device, calls: int = 1000, rounds: int = 21) -> str:
    """Microseconds per call of flexspec (backend 'flex') against a hand-written call of the
    compiled flex_attention with a prebuilt block mask (:class:`OverheadCase`).

    The two are timed in alternating rounds of ``calls`` calls, and the overhead is the median of
    the per-round differences, so that drift in the machine's speed cancels. A second
    hand-written closure timed the same way against the first gives the noise floor."""
    lines = ["| spec | hand-written us/call | flexspec us/call | overhead us | "
             "hand vs hand us |", "|---|---|---|---|---|"]
    for text in OVERHEAD_SPECS:
        case = OverheadCase.build(text, device)
        # "hand again" times the hand-written call a second time: the method's noise floor
        times = alternate({"hand": case.hand, "ours": case.ours, "hand again": case.hand},
                          device, calls, rounds)
        lines.append(f"| {text} | {statistics.median(times['hand']):.1f} | "
                     f"{statistics.median(times['ours']):.1f} | "
                     f"{median_difference(times['ours'], times['hand']):+.1f} | "
                     f"{median_difference(times['hand again'], times['hand']):+.1f} |")
    return "\n".join(lines)


def alternate(functions: dict, device, calls: int, rounds: int, warmup: int = 50) -> dict:
    """Microseconds per call of each of ``functions`` (name -> callable), one list entry per
    round; each round runs ``calls`` calls of every function in turn."""
    for fn in functions.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def median_difference(times: list, baseline: list) -> float:
    """The median over rounds of ``times - baseline``: drift shared by a round cancels."""
    return statistics.median(a - b for a, b in zip(times, baseline))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="comma-separated BxHxSxD shapes (default: the two of the suite)")
    parser.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated specs")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                        help="memory layout of q, k, v (always passed as (B, H, S, D))")
    parser.add_argument("--overhead", action="store_true", help="only the per-call overhead")
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    parser.add_argument("--training-step", action="store_true",
                        help="the training-step table instead: benchmarks/training_step.py on "
                             "--shapes (packed documents, fresh ids every step)")
    args = parser.parse_args(argv)
    if args.training_step:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import training_step
        return training_step.main([*args.shapes.split(","), "--device", args.device,
                                   "--layout", args.layout])
    args.shapes = args.shapes.split(",")
    args.specs = [s.strip() for s in args.specs.split(";") if s.strip()]
    args.modes = args.modes.split(",")
    args.dtype = getattr(torch, args.dtype)
    torch._dynamo.config.recompile_limit = 32
    device = torch.device(args.device)
    header = [f"torch {torch.__version__}", f"layout {args.layout}",
              f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"]
    if flash_installed():
        header.append(f"flash-attn-4 {importlib.metadata.version('flash-attn-4')}")
    print(", ".join(header), flush=True)
    text = ""
    if args.overhead:
        text = "per-call overhead\n\n" + overhead(device)
    else:
        text = table(suite(args, device))
    print()
    print(text)
    if args.out:
        Path(args.out).write_text(", ".join(header) + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
