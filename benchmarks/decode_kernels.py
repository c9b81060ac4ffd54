"""Which FlexAttention decoding kernel is fastest for a decode call: the measurements behind
flexspec's decode kernel options (``flexspec.runtime.decoding``).

One new token against a KV cache (Hq=32, Hkv=8, D=128, bf16), for each spec of
``benchmarks/decode.py``, hand-written mods, ``torch.compile(flex_attention)`` run on its decoding
kernel (``TRITON_DECODE``, split-KV) with:

* ``flexspec``: flexspec's warm call (``auto``), and ``flexspec flex`` with ``backend="flex"``;
* ``default``: the block mask of ``create_block_mask`` and torch's default kernel options;
* ``partial``: the same tiles with the full ones listed as partial (the decoding kernel splits
  the keys of a row evenly among its splits only when the block mask has no full blocks; with
  full blocks it splits KV_LEN, so a window at the end of a long cache lands in one split);
* ``partial + C``: that block mask with the kernel options C (``BLOCK_N``, ``num_stages``,
  ``num_warps``, ``SPLIT_KV``).

Each variant's output is checked against the default one (max |difference|). The floor is the
bytes of the keys and values the token may see at the copy bandwidth measured in the same run
(a device-to-device copy of 2 GiB, bytes read plus written). The last lines printed are the
table (markdown): each variant's median time (``triton.testing.do_bench``) and over the floor.

    python benchmarks/decode_kernels.py --caches 32768 --batches 8 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode import (DIM, DOCUMENTS, KV_HEADS, SPECS, decode_inputs, hand_mask,  # noqa: E402
                    hand_score, visible_keys)
import flexspec  # noqa: E402
from flexspec.kernels.block_tables import as_partial  # noqa: E402

# (name, kernel options) tried on the partial block mask for every spec
VARIANTS = [
    ("partial", {}),
    ("stages 2", {"num_stages": 2}),
    ("stages 3", {"num_stages": 3}),
    ("stages 4", {"num_stages": 4}),
    ("stages 3, warps 4", {"num_stages": 3, "num_warps": 4}),
    ("stages 3, split x2", {"num_stages": 3, "SPLIT_KV": "x2"}),
    # int64 block counts: the decoding template's int32 counts clash with its int64 indices
    # where K or V hold 2**31 elements or more (a compile error in torch 2.11)
    ("stages 3, int64 counts", {"num_stages": 3, "COUNTS": "int64"}),
]


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read plus written)."""
    import triton.testing
    source = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=20, rep=100,
                                 return_mode="median")
    return 2 * source.numel() * source.element_size() / (ms * 1e-3)


def default_split(batch: int) -> int:
    """torch's default SPLIT_KV (flex_decoding.get_split_k)."""
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    return max(sms // max(batch * KV_HEADS, 1) * 2, 1)


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def measure(text, q, k, v, ids, length, batch, bandwidth) -> dict:
    position = length - 1
    kc, vc = k[:, :, :length], v[:, :, :length]
    mask = create_block_mask(hand_mask(text, position, ids), batch if "doc" in text else None,
                             None, 1, length, device=q.device, _compile=True)
    partial = as_partial(mask)
    wide = BlockMask(partial.seq_lengths, partial.kv_num_blocks.long(), partial.kv_indices,
                     None, None, None, None, None, None, BLOCK_SIZE=partial.BLOCK_SIZE,
                     mask_mod=partial.mask_mod)
    score_mod = hand_score(text, position, q.device)
    compiled = torch.compile(flex_attention)
    row = {"spec": text, "cache": length, "batch": batch}

    def call(block_mask, options):
        return compiled(q, kc, vc, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                        kernel_options=options or None)

    with torch.no_grad():
        try:
            expected = call(mask, {})
            row["default"] = bench(lambda: call(mask, {}))
        except Exception as err:  # noqa: BLE001 - torch's decoding kernel may not compile
            print(f"{text} default: {err}", file=sys.stderr, flush=True)
            row["default"] = f"fails ({type(err).__name__})"
            expected = compiled(q, kc, vc, score_mod=score_mod, block_mask=mask,
                                enable_gqa=True, kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
        bindings = {"doc_ids": ids[:, :length]} if "doc" in text else {}
        for column, backend in (("flexspec", "auto"), ("flexspec flex", "flex")):
            attn = flexspec.compile(text, backend=backend)
            try:
                got = attn(q, kc, vc, q_offset=position, **bindings)
            except flexspec.SpecError as err:
                print(f"{text} {column}: {err}", file=sys.stderr, flush=True)
                row[column] = f"fails ({type(err).__name__})"
                continue
            difference = (got.float() - expected.float()).abs().max().item()
            row[column] = bench(lambda: attn(q, kc, vc, q_offset=position, **bindings)) \
                if difference < 2e-2 else f"wrong ({difference:.1e})"
            row[column + " backend"] = attn.explain(q, kc, vc, q_offset=position,
                                                    **bindings).choice.backend
        for name, options in VARIANTS:
            options = dict(options)
            if isinstance(options.get("SPLIT_KV"), str):
                options["SPLIT_KV"] = default_split(batch) * int(options["SPLIT_KV"][1:])
            block_mask = wide if options.pop("COUNTS", None) == "int64" else partial
            try:
                got = call(block_mask, options)
                difference = (got.float() - expected.float()).abs().max().item()
                if not difference < 2e-2:
                    row[name] = f"wrong ({difference:.1e})"
                    continue
                row[name] = bench(lambda: call(block_mask, options))
            except Exception as err:  # noqa: BLE001 - a variant that does not compile is a row
                row[name] = f"fails ({type(err).__name__})"
                print(f"{text} {name}: {err}", file=sys.stderr, flush=True)
    keys = visible_keys(text, length, ids[:, :length])
    row["floor"] = 2 * batch * KV_HEADS * keys * DIM * 2 / bandwidth * 1e3
    return row


def cell(value, floor) -> str:
    if isinstance(value, str):
        return value
    return f"{value:.3f} ({value / floor:.2f}x)"


def table(rows) -> str:
    names = ["flexspec", "flexspec flex", "default"] + [name for name, _ in VARIANTS]
    lines = ["| cache | B | spec | floor ms | " + " | ".join(names) + " |",
             "|" + "---|" * (4 + len(names))]
    for r in rows:
        lines.append(f"| {r['cache'] // 1024}K | {r['batch']} | `{r['spec']}` | "
                     f"{r['floor']:.3f} | " + " | ".join(cell(r[n], r['floor']) for n in names)
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--caches", type=int, nargs="+", default=[32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated specs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.cache_size_limit = 1024
    bandwidth = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for length in args.caches:
        for batch in args.batches:
            q, k, v = decode_inputs(batch, length)
            ids = (torch.arange(length, device="cuda") * DOCUMENTS // length)
            ids = ids.expand(batch, length).contiguous()
            for text in args.specs.split(";"):
                # a fresh dynamo cache for each: the batch stays static, as it must for torch
                # to run its decoding kernel (a second batch size makes it dynamic)
                torch._dynamo.reset()
                rows.append(measure(text.strip(), q, k, v, ids, length, batch, bandwidth))
                print(rows[-1], flush=True)
            del k, v
    out = os.environ.get("OUT")
    if out:
        Path(out, "decode_kernels.json").write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
