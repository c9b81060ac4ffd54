"""Paged decode on a GPU: one new query token per sequence over a paged KV cache, read in place
(``attn.paged(..., read="in_place")``: FlexAttention over the whole pool through a block mask
mapped to the pages), against flexspec's contiguous decode of the same sequences and against
``attn.paged(..., read="gather")`` (the pages copied into contiguous keys first). Issue 27's
target: paged decode within 1.1x contiguous.

For each spec, batch, cache length and page size (Hq=32, Hkv=8, D=128, bf16), the sequences sit
in slots of a shuffled order, their pages interleaved in the pool, each full to the cache
length:

* ``contiguous``: ``attn(q, keys, values, q_offset=..., kv_lengths=...)`` on the sequences laid
  out contiguously (built once, outside the timed region): the denominator;
* ``in place, layer``: ``read(q)`` of a read made once outside the timed region
  (``attn.paged_read``), as each layer of a model step runs it;
* ``making the read``: ``attn.paged_read(...)`` (the logical block mask, its mapping to the
  pages, the mods), once per model step;
* ``in place, call``: ``attn.paged(..., read="in_place")``, which makes its read and runs it;
* ``gather``: ``attn.paged(..., read="gather")`` (a copy of every sequence per call).

With ``--mixed CHUNK``, one row per spec and batch instead: a mixed batch (issue 27, item 2) of
one request's prefill chunk of CHUNK new tokens and the other ``B - 1`` requests' decoded
tokens, read in place as one call (``attn.paged_read(..., new_tokens=...)``: ``q`` padded to
CHUNK rows), against the sum of its parts read alone (the chunk as a batch of one, the decoded
tokens as a batch of ``B - 1``); the target is at most 1.1x. On CUDA the ``graph`` columns
time the same reads captured in CUDA graphs and replayed (as a captured model step runs them:
the split's host work is recorded away), the parts each in a graph of its own.

A decoding read whose slots' keys and values take at most 256 MiB, under a mask that lets a
decoded row see every key its slot holds (``causal``, not a narrower window or documents),
lists every page its slots hold instead of building the exact logical mask when it is made
(``flexpages.lists_every_page``; the first read of a spec builds it): ``--exact-masks`` makes
every read build it, for the same table without that rule. ``--read-options '{"BLOCK_N": 32}'``
gives the paged reads a key tile narrower than the page (``flexspec.compile(...,
kernel_options=...)``); the contiguous call keeps flexspec's own options.

Outputs are checked against the contiguous call (the mixed batch: against its parts). Times
are medians of ``triton.testing.do_bench`` (on the CPU: of ``--repeats`` calls). The last lines
printed are the table (markdown).

    python benchmarks/paged.py                              # B 8 and 64, 4K-32K, pages 16-128
    python benchmarks/paged.py --caches 4096 --batches 8 --pages 64
    python benchmarks/paged.py --mixed 512 --caches 4096 --batches 8 --pages 64
    python benchmarks/paged.py --caches 4096 --batches 8 --pages 64 --exact-masks
    python benchmarks/paged.py --device cpu --caches 512 --batches 2 --pages 32 --heads 4 \\
        --kv-heads 2 --dim 16 --dtype float32                # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexspec  # noqa: E402

SPECS = ["causal", "sliding_window(4096)", "causal & doc", "causal + alibi",
         "causal + softcap(30)"]
DOCUMENTS = 8


def timed(call, device, repeats: int) -> float:
    """Milliseconds per call: the median of do_bench on CUDA, of ``repeats`` calls elsewhere."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(call)
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def replayed(call, device) -> object:
    """Milliseconds per replay of ``call`` captured in a CUDA graph (its host work, such as a
    mixed read's split, recorded away), the median of do_bench; ``"-"`` off CUDA."""
    if device.type != "cuda":
        return "-"
    import triton.testing
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return triton.testing.do_bench(graph.replay)


def filled_cache(batch: int, length: int, page: int, args, device, generator):
    """A cache whose slots (a shuffled order, one spare) hold ``batch`` sequences of ``length``
    positions with interleaved pages, random keys and values: ``(cache, slots, keys, values)``
    with the contiguous keys and values ``[batch, Hkv, length, D]``."""
    dtype = getattr(torch, args.dtype)
    max_pages = -(-length // page)
    cache = flexspec.PagedKVCache(pages=batch * max_pages, page_size=page,
                                  kv_heads=args.kv_heads, head_dim=args.dim, slots=batch + 1,
                                  max_pages=max_pages, dtype=dtype, device=device)
    slots = torch.randperm(batch + 1, generator=generator)[:batch].to(device)
    for held in range(1, max_pages + 1):  # a page per slot at a time: pages interleave
        grown = torch.full((batch,), min(held * page, length), device=device)
        cache.reserve(slots, grown, check=False)
        cache.lengths[slots] = grown  # what append does after reserving
    cache.check()
    cache.keys.normal_(generator=None)
    cache.values.normal_(generator=None)
    keys, values = cache.gathered(slots)
    return cache, slots, keys[:, :, :length].contiguous(), values[:, :, :length].contiguous()


def row(text: str, batch: int, length: int, page: int, args, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    cache, slots, keys, values = filled_cache(batch, length, page, args, device, generator)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(batch, args.heads, 1, args.dim, generator=generator).to(device, dtype)
    lengths = torch.full((batch,), length, device=device)
    offset = lengths - 1
    bindings, logical_bindings = {}, {}
    if "doc" in text:
        ids = (torch.arange(length) * DOCUMENTS // length).to(device)
        bindings["doc_ids"] = ids.expand(batch, -1).contiguous()
        padded = torch.full((cache.capacity,), DOCUMENTS, device=device)
        padded[:length] = ids
        logical_bindings["doc_ids"] = padded.expand(batch, -1).contiguous()
    attn = flexspec.compile(text)
    contiguous = attn
    if args.read_options:  # the paged reads only: the contiguous call keeps flexspec's own
        attn = flexspec.compile(text, kernel_options=json.loads(args.read_options))
    result = {"spec": text, "B": batch, "cache": length, "page": page}
    with torch.no_grad():
        want = contiguous(q, keys, values, q_offset=offset, kv_lengths=lengths, **bindings)
        result["contiguous"] = timed(
            lambda: contiguous(q, keys, values, q_offset=offset, kv_lengths=lengths,
                               **bindings), device, args.repeats)
        got = attn.paged(q, cache, slots, read="in_place", **logical_bindings)
        close = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        # a layer of a step: the read made once, outside the timed region
        read = attn.paged_read(q, cache, slots, **logical_bindings)
        read(q)
        result["in place, layer"] = timed(lambda: read(q), device, args.repeats) \
            if close else "wrong"
        result["making the read"] = timed(
            lambda: attn.paged_read(q, cache, slots, **logical_bindings), device, args.repeats)
        result["in place, call"] = timed(
            lambda: attn.paged(q, cache, slots, read="in_place", **logical_bindings), device,
            args.repeats) if close else "wrong"
        result["gather"] = timed(
            lambda: attn.paged(q, cache, slots, read="gather", **logical_bindings), device,
            args.repeats)
    for name in ("in place, layer", "in place, call"):
        if isinstance(result[name], float):
            result[f"{name} / contiguous"] = result[name] / result["contiguous"]
    return result


def mixed_row(text: str, batch: int, length: int, page: int, chunk: int, args,
              device) -> dict:
    """A mixed batch (slot 0's request: ``chunk`` new tokens; the others: one each) in one
    in-place read (``new_tokens``: the decoded tokens run apart from the chunk), against its
    two parts run alone."""
    generator = torch.Generator().manual_seed(0)
    cache, slots, _, _ = filled_cache(batch, length, page, args, device, generator)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(batch, args.heads, chunk, args.dim, generator=generator).to(device, dtype)
    counts = [chunk] + [1] * (batch - 1)
    bindings = {}
    if "doc" in text:
        ids = (torch.arange(cache.capacity) * DOCUMENTS // length).clamp(max=DOCUMENTS)
        bindings["doc_ids"] = ids.to(device).expand(batch, -1).contiguous()
    attn = flexspec.compile(text, kernel_options=json.loads(args.read_options or "null"))
    result = {"spec": text, "B": batch, "cache": length, "page": page, "chunk": chunk}
    offset = cache.lengths[slots] - torch.tensor(counts, device=device)

    def alone(rows, queries):
        picked = {name: value[rows] for name, value in bindings.items()}
        return attn.paged_read(queries, cache, slots[rows], q_offset=offset[rows], **picked)
    with torch.no_grad():
        # each read made once, as a model step makes it for all its layers
        mixed = attn.paged_read(q, cache, slots, new_tokens=counts, **bindings)
        chunk_q, decoded_q = q[:1], q[1:, :, :1]
        chunk_read, decoded_read = alone(slice(0, 1), chunk_q), alone(slice(1, None), decoded_q)
        together = mixed(q)
        close = (torch.allclose(together[:1].float(), chunk_read(chunk_q).float(), atol=2e-2,
                                rtol=2e-2)
                 and torch.allclose(together[1:, :, :1].float(),
                                    decoded_read(decoded_q).float(), atol=2e-2, rtol=2e-2))
        result["mixed"] = timed(lambda: mixed(q), device, args.repeats) if close else "wrong"
        result["chunk alone"] = timed(lambda: chunk_read(chunk_q), device, args.repeats)
        result["decoded alone"] = timed(lambda: decoded_read(decoded_q), device, args.repeats)
        if close:
            result["mixed, graph"] = replayed(lambda: mixed(q), device)
            result["parts, graph"] = replayed(lambda: chunk_read(chunk_q), device)
            if isinstance(result["parts, graph"], float):
                result["parts, graph"] += replayed(lambda: decoded_read(decoded_q), device)
    if close:
        result["mixed / parts"] = result["mixed"] / (result["chunk alone"]
                                                     + result["decoded alone"])
        if isinstance(result["mixed, graph"], float):
            result["mixed / parts, graph"] = result["mixed, graph"] / result["parts, graph"]
    return result


MIXED_COLUMNS = ["spec", "B", "cache", "page", "chunk", "mixed", "chunk alone",
                 "decoded alone", "mixed / parts", "mixed, graph", "parts, graph",
                 "mixed / parts, graph"]
COLUMNS = ["spec", "B", "cache", "page", "contiguous", "in place, layer", "making the read",
           "in place, call", "gather", "in place, layer / contiguous",
           "in place, call / contiguous"]


def table(rows: list, columns=COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for found in rows:
        cells = []
        for name in columns:
            value = found.get(name, "-")
            cells.append(f"{value:.3f}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--specs", default=";".join(SPECS), help="';'-separated specs")
    parser.add_argument("--caches", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--pages", nargs="+", type=int, default=[16, 64, 128])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls off CUDA")
    parser.add_argument("--mixed", type=int, default=0, metavar="CHUNK",
                        help="time a mixed batch with a prefill chunk of CHUNK tokens instead")
    parser.add_argument("--read-options", default="", metavar="JSON",
                        help="kernel options (a JSON object) given to flexspec.compile for the "
                             "paged reads; the contiguous call keeps flexspec's own")
    parser.add_argument("--exact-masks", action="store_true",
                        help="every read builds its exact logical block mask (no read lists "
                             "every page)")
    args = parser.parse_args(argv)
    if args.exact_masks:
        from flexspec.runtime import flexpages
        flexpages.lists_every_page = lambda *_: False
    device = torch.device(args.device)
    rows = []
    for text in args.specs.split(";"):
        for batch in args.batches:
            # the rows of a spec and batch compile at several page sizes and lengths: a fresh
            # dynamo keeps them within one entry's recompile budget
            torch._dynamo.reset()
            for length in args.caches:
                for page in args.pages:
                    try:
                        found = (mixed_row(text, batch, length, page, args.mixed, args,
                                           device)
                                 if args.mixed else row(text, batch, length, page, args,
                                                        device))
                    except Exception as err:  # noqa: BLE001 - a failed row is a table cell
                        found = {"spec": text, "B": batch, "cache": length, "page": page,
                                 "contiguous": f"fails: {type(err).__name__}: "
                                               f"{str(err).splitlines()[0][:100]}"}
                    print(found, flush=True)
                    rows.append(found)
    print()
    print(table(rows, MIXED_COLUMNS if args.mixed else COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
