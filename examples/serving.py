"""A small continuous-batching server loop over a paged KV cache, checked against running each
request alone.

A tiny randomly initialised decoder (2 layers, grouped-query attention, any flexspec spec as its
attention) serves requests that arrive and finish at random. Each step is one mixed batch: the
prompts of new requests (prefill, into free slots of a ``flexspec.PagedKVCache``) and the next
token of every running request, padded to the longest prompt, in whatever order the slots
are; ``new_tokens`` tells the cache and the step how many of each row's tokens are real. A
``flexspec.Step`` holds what the layers of one model step share (the slots and the counts): the
first layer's ``attn.paged`` makes the read of the pages, every other layer runs it over its own
cache. Finished requests give their pages back. Greedy decoding. At the end every request's
tokens are compared with the same request run alone over contiguous keys and values.

    python examples/serving.py                       # causal, 12 requests
    python examples/serving.py --spec "causal & (window(24) | sink(4))" --requests 20

Runs on the CPU in seconds (its calls are short, so they run on the dense reference there).
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

import flexspec

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 32, 4, 2, 8, 2


class TinyDecoder(torch.nn.Module):
    """Embeddings, ``LAYERS`` blocks of attention (the spec) and an MLP, an output head."""

    def __init__(self, spec: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = flexspec.compile(spec)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({
            "q": torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM),
            "kv": torch.nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM),
            "out": torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN),
            "mlp": torch.nn.Sequential(torch.nn.Linear(HIDDEN, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, HIDDEN)),
        }) for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, attend):
        """Logits of ``tokens`` (``[B, T]``); ``attend(layer, q, k, v)`` runs layer ``layer``'s
        attention of the new tokens (q ``[B, H, T, D]``, their keys and values
        ``[B, Hkv, T, D]``), keeping the keys and values where it keeps them."""
        x = self.embed(tokens)
        batch, count = tokens.shape
        for index, layer in enumerate(self.layers):
            q = layer["q"](x).view(batch, count, HEADS, HEAD_DIM).transpose(1, 2)
            k, v = layer["kv"](x).view(batch, count, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
            mixed = attend(index, q, k.contiguous(), v.contiguous())
            x = x + layer["out"](mixed.transpose(1, 2).reshape(batch, count, -1))
            x = x + layer["mlp"](x)
        return self.head(x)


def run_alone(model: TinyDecoder, prompt: list, new_tokens: int) -> list:
    """Greedy decoding of one request over contiguous keys and values (the check)."""
    caches = [None] * LAYERS

    def attend(layer, q, k, v):
        past = caches[layer]
        caches[layer] = (k, v) if past is None else tuple(
            torch.cat([old, new], dim=2) for old, new in zip(past, (k, v)))
        keys, values = caches[layer]
        return model.attn(q, keys, values, q_offset=keys.shape[2] - q.shape[2])

    tokens, out = torch.tensor([prompt]), []
    for _ in range(new_tokens):
        token = int(model(tokens, attend)[0, -1].argmax())
        out.append(token)
        tokens = torch.tensor([[token]])
    return out


def serve(model: TinyDecoder, requests: list, slots: int, seed: int) -> dict:
    """Continuous batching over a paged cache; ``requests`` are ``(arrival step, prompt, new
    tokens)``. Returns each request's tokens."""
    caches = [flexspec.PagedKVCache(pages=slots * 8, page_size=8, kv_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, slots=slots, max_pages=8)
              for _ in range(LAYERS)]
    rng = random.Random(seed)
    free = list(range(slots))
    rng.shuffle(free)  # slots in any order
    waiting = sorted(range(len(requests)), key=lambda r: requests[r][0])
    running: dict = {}  # request -> slot
    made = {r: [] for r in range(len(requests))}
    last: dict = {}  # request -> its latest token
    step = 0

    def attend_over(slot_ids, counts):
        # what every layer of this model step shares: its first layer makes the read of the
        # pages, the others run it (each layer's cache has the same appends: the same pages)
        step = flexspec.Step(slots=slot_ids, new_tokens=counts)

        def attend(layer, q, k, v):
            caches[layer].append(slot_ids, k, v, new_tokens=counts)
            return model.attn.paged(q, caches[layer], step=step)
        return attend

    while waiting or running:
        # arrivals: a new request takes a free slot and prefills its prompt in this step
        arriving = []
        while waiting and requests[waiting[0]][0] <= step and free:
            request = waiting.pop(0)
            running[request] = free.pop()
            arriving.append(request)
        # every running request that wants more decodes its latest token
        wanting = [r for r in running if r not in arriving and len(made[r]) < requests[r][2]]
        batch = arriving + wanting
        rng.shuffle(batch)
        if batch:
            rows = [requests[r][1] if r in arriving else [last[r]] for r in batch]
            counts = [len(row) for row in rows]
            tokens = torch.tensor([row + [0] * (max(counts) - len(row)) for row in rows])
            slot_ids = torch.tensor([running[r] for r in batch])
            logits = model(tokens, attend_over(slot_ids, counts))
            for row, request in enumerate(batch):  # each row's last real token
                last[request] = int(logits[row, counts[row] - 1].argmax())
                made[request].append(last[request])
        # departures
        for request in [r for r in running if len(made[r]) >= requests[r][2]]:
            slot = running.pop(request)
            for cache in caches:
                cache.release(torch.tensor([slot]))
            free.append(slot)
        step += 1
    return made


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default="causal")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    requests = [(rng.randrange(0, 10), [rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))],
                 rng.randint(1, 10)) for _ in range(args.requests)]
    model = TinyDecoder(args.spec, seed=args.seed).eval()
    with torch.no_grad():
        served = serve(model, requests, args.slots, args.seed)
        alone = [run_alone(model, prompt, count) for _, prompt, count in requests]
    same = sum(served[r] == alone[r] for r in range(len(requests)))
    for r, (arrival, prompt, count) in enumerate(requests):
        print(f"request {r:2d}: arrives at step {arrival}, prompt of {len(prompt):2d}, "
              f"{count:2d} new tokens: {'same' if served[r] == alone[r] else 'DIFFERENT'} "
              f"{served[r]}")
    print(f"{same} of {len(requests)} requests gave the tokens they give alone "
          f"({args.spec}, {args.slots} slots)")
    return 0 if same == len(requests) else 1


if __name__ == "__main__":
    sys.exit(main())
