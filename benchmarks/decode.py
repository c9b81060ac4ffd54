"""Decode speed on a GPU: one new query token against a KV cache, flexspec against SDPA and
hand-written FlexAttention, with the memory-bandwidth floor.

For each cache length, batch and spec (Hq=32, Hkv=8, D=128, bf16):

* ``flexspec step``: a decode loop as a model runs it, 100 steps with the cache growing by one
  key each step and ``q_offset`` the new token's position; the median time per step (every step
  is a new length, so this includes flexspec's planning and block mask per step);
* ``flexspec static``: 100 steps over a preallocated cache of fixed shape whose valid lengths
  (``kv_lengths``) grow in place: the plan is reused, the block mask is rebuilt each step;
* ``flexspec warm``: the same call repeated at one length and offset (the kernel and per-call
  overhead alone);
* ``hand flex``: ``torch.compile(flex_attention)`` with a block mask from compiled
  ``create_block_mask``, built once outside the timed region;
* ``SDPA``: ``scaled_dot_product_attention`` with a boolean mask where the spec needs one (none
  for causal: the newest token sees the whole cache);
* ``FA4``: FlashAttention-4's own ``flash_attn_func`` where it has the spec natively (causal,
  the sliding window, softcap; its causal is bottom-right aligned, so the newest token sees the
  whole cache), where ``flash_attn.cute`` is installed;
* ``floor``: the bytes of the keys and values the spec lets the token see, at 4.3 TB/s.

Outputs are checked against flexspec's float64 reference on the first batch row. Times are
medians of ``triton.testing.do_bench``. The last lines printed are the table (markdown).

    python benchmarks/decode.py                      # 4K, 32K and 128K caches, B 8 and 64
    python benchmarks/decode.py --caches 32768 --batches 8
    python benchmarks/decode.py --caches 32768 --batches 64 --specs "causal;causal & doc"
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402

SPECS = ["causal", "sliding_window(4096)", "causal & (window(4096) | sink(4))", "causal & doc",
         "causal + alibi", "causal + softcap(30)"]
HEADS, KV_HEADS, DIM = 32, 8, 128
BANDWIDTH = 4.3e12  # bytes per second, the H200's HBM3e
DOCUMENTS = 8
STEPS = 100


def hand_mask(text: str, position: int, ids):
    """The mask a user writes by hand for the newest token at ``position`` (not flexspec's)."""
    if text == "causal" or text.startswith("causal +"):
        return lambda b, h, q, kv: q + position >= kv
    if text == "sliding_window(4096)":
        return lambda b, h, q, kv: (q + position >= kv) & (q + position - kv <= 4096)
    if text.startswith("causal & (window"):
        return lambda b, h, q, kv: (q + position >= kv) & ((q + position - kv <= 4096) | (kv < 4))
    return lambda b, h, q, kv: (q + position >= kv) & (ids[b, q + position] == ids[b, kv])


def alibi_slopes(device) -> torch.Tensor:
    """ALiBi's slopes for HEADS heads, written out (``2 ** (-8 (h + 1) / H)``)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)], device=device)


def hand_score(text: str, position: int, device):
    """The score_mod a user writes by hand (``None`` for a plain score)."""
    if text.endswith("alibi"):
        slopes = alibi_slopes(device)
        return lambda score, b, h, q, kv: score - slopes[h] * (q + position - kv).abs()
    if text.endswith("softcap(30)"):
        return lambda score, b, h, q, kv: 30.0 * torch.tanh(score / 30.0)
    return None


def sdpa_bias(text: str, position: int, length: int, device):
    """SDPA's additive float mask for a score SDPA can take (alibi), else ``None``."""
    if not text.endswith("alibi"):
        return None
    slopes = alibi_slopes(device)
    distance = (position - torch.arange(length, device=device)).abs()
    return (-slopes.view(1, -1, 1, 1) * distance.view(1, 1, 1, -1)).to(torch.bfloat16)


# FA4's own interface's arguments for the specs it has natively (for a token at the end)
FA4_NATIVE = {"causal": {"causal": True},
              "sliding_window(4096)": {"causal": True, "window_size": (4096, 0)},
              "causal + softcap(30)": {"causal": True, "softcap": 30.0}}


def fa4_hand(text: str):
    """FA4's own kernel called by hand for ``text``, or ``None`` (no native form, or FA4 is not
    installed): q, k, v transposed to (B, S, H, D)."""
    if text not in FA4_NATIVE:
        return None
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    arguments = FA4_NATIVE[text]
    return lambda q, k, v: flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                           **arguments)[0].transpose(1, 2)


def visible_keys(text: str, length: int, ids) -> float:
    """Keys the newest token sees, averaged over the batch (for the bandwidth floor)."""
    if text == "causal" or text.startswith("causal +"):
        return float(length)
    if "sink" in text:
        return float(min(length, 4097 + 4))
    if text.startswith("sliding"):
        return float(min(length, 4097))
    last = ids[:, length - 1:length]
    return float((ids == last).sum(-1).float().mean())


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def decode_inputs(batch: int, length: int, device="cuda") -> tuple:
    """``(q, k, v)``, bf16, seeded: one new token's queries (HEADS heads) and a cache of
    ``length`` positions (KV_HEADS heads)."""
    generator = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch, KV_HEADS, length, DIM, device=device, dtype=torch.bfloat16,
                    generator=generator)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, 1, DIM, device=device, dtype=torch.bfloat16,
                    generator=generator)
    return q, k, v


def run(caches, batches, device="cuda", specs=SPECS) -> list:
    rows = []
    for length in caches:
        for batch in batches:
            total = length + STEPS + 1
            q, k, v = decode_inputs(batch, total, device)
            ids = (torch.arange(total, device=device) * DOCUMENTS // total).expand(batch, total)
            ids = ids.contiguous()
            for text in specs:
                # a fresh dynamo cache for each: a second batch size would make the batch
                # dynamic, and torch's decoding kernel runs only for a static one
                torch._dynamo.reset()
                rows.append(measure(text, q, k, v, ids, length, batch))
                print(rows[-1], flush=True)
    return rows


def measure(text, q, k, v, ids, length, batch) -> dict:
    attn = flexspec.compile(text)
    bindings = {"doc_ids": ids} if "doc" in text else {}
    kc, vc = k[:, :, :length], v[:, :, :length]
    sliced = {"doc_ids": ids[:, :length]} if bindings else {}
    position = length - 1
    with torch.no_grad():
        out = attn(q, kc, vc, q_offset=position, **sliced)
        ref = attn.reference(q[:1], kc[:1], vc[:1], q_offset=position,
                             **{n: t[:1] for n, t in sliced.items()})
        error = ((out[:1].double() - ref.double()).norm() / ref.double().norm()).item()
        backend = attn.explain(q, kc, vc, q_offset=position, **sliced).choice.backend
        warm = bench(lambda: attn(q, kc, vc, q_offset=position, **sliced))
        # the loop a model runs: a new length and position each step
        times = []
        for step in range(STEPS):
            n = length + step
            step_bindings = {"doc_ids": ids[:, :n]} if bindings else {}
            torch.cuda.synchronize()
            started = time.perf_counter()
            attn(q, k[:, :, :n], v[:, :, :n], q_offset=n - 1, **step_bindings)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1e3)
        step_ms = statistics.median(times[2:])
        # a preallocated cache: fixed shapes, the valid length of every row grows in place
        lengths = torch.full((batch,), length, device=q.device)
        static_times = []
        for step in range(STEPS):
            torch.cuda.synchronize()
            started = time.perf_counter()
            attn(q, k, v, q_offset=lengths - 1, kv_lengths=lengths, **bindings)
            torch.cuda.synchronize()
            static_times.append((time.perf_counter() - started) * 1e3)
            lengths += 1
        static_ms = statistics.median(static_times[2:])
        # hand-written
        mask = create_block_mask(hand_mask(text, position, ids), batch if bindings else None,
                                 None, 1, length, device=q.device, _compile=True)
        compiled = torch.compile(flex_attention)
        score_mod = hand_score(text, position, q.device)
        try:
            hand = bench(lambda: compiled(q, kc, vc, score_mod=score_mod, block_mask=mask,
                                          enable_gqa=True))
        except Exception as err:  # noqa: BLE001 - torch's decoding kernel may not compile
            print(f"{text}: hand flex failed: {type(err).__name__}", file=sys.stderr)
            hand = math.nan
        sdpa_mask = sdpa_bias(text, position, length, q.device)
        if text.endswith("softcap(30)"):
            sdpa_mask = "none"  # SDPA has no softcap
        elif sdpa_mask is None and text != "causal":  # the hand mask, densely for the one row
            kv = torch.arange(length, device=q.device).view(1, -1)
            rows = torch.arange(batch, device=q.device).view(-1, 1)
            zero = torch.zeros(1, 1, dtype=torch.long, device=q.device)
            sdpa_mask = hand_mask(text, position, ids)(rows, 0, zero, kv).expand(batch, length)
            sdpa_mask = sdpa_mask.reshape(batch, 1, 1, length)
        sdpa = math.nan if isinstance(sdpa_mask, str) else bench(
            lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=sdpa_mask,
                                                   enable_gqa=True))
        fa4, native = math.nan, fa4_hand(text)
        if native is not None:
            try:
                got = native(q, kc, vc)
                if ((got[:1].double() - ref.double()).norm() / ref.double().norm()) < 2e-2:
                    fa4 = bench(lambda: native(q, kc, vc))
            except Exception as err:  # noqa: BLE001 - a kernel that fails is an empty cell
                print(f"{text}: FA4 failed: {type(err).__name__}: {err}", file=sys.stderr)
    keys = visible_keys(text, length, ids[:, :length])
    floor = 2 * batch * KV_HEADS * keys * DIM * 2 / BANDWIDTH * 1e3
    return {"spec": text, "cache": length, "batch": batch, "backend": backend,
            "error": error, "flexspec step": step_ms, "flexspec static": static_ms,
            "flexspec warm": warm, "hand flex": hand,
            "sdpa": sdpa, "fa4": fa4, "floor": floor}


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f} ms"


def table(rows) -> str:
    head = ("| cache | B | spec | flexspec backend | flexspec step | flexspec static | "
            "flexspec warm | hand flex | SDPA | FA4 | floor | warm / floor | rel. error |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['cache'] // 1024}K | {r['batch']} | `{r['spec']}` | {r['backend']} | "
                     f"{r['flexspec step']:.3f} ms | {r['flexspec static']:.3f} ms | "
                     f"{r['flexspec warm']:.3f} ms | "
                     f"{_ms(r['hand flex'])} | {_ms(r['sdpa'])} | {_ms(r['fa4'])} | "
                     f"{r['floor']:.3f} ms | "
                     f"{r['flexspec warm'] / r['floor']:.2f}x | {r['error']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--caches", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--specs", default=";".join(SPECS), help="';'-separated specs")
    args = parser.parse_args(argv)
    specs = args.specs.split(";")
    unknown = [text for text in specs if text not in SPECS]
    if unknown:  # the hand-written column has a mask for these only
        parser.error(f"--specs: {', '.join(unknown)} not among {'; '.join(SPECS)}")
    if not torch.cuda.is_available():
        print("benchmarks/decode.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    # the hand-written column compiles flex_attention once per configuration, as a user with one
    # model would; torch's default limit of 8 would silently turn later ones eager
    torch._dynamo.config.recompile_limit = 256
    rows = run(args.caches, args.batches, specs=specs)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
