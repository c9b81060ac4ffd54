"""A seeded fuzzer of serving: random sequences of paged-cache operations and reads, for random
specs with example bindings, where only flexspec's own errors may escape and every read equals
the float64 reference of each request alone.

A sequence (reproducible from ``--seed``) makes a small pool (pages of 4 or 16 positions, 2 to
4 slots, 1 or 2 KV heads) twice, one per layer of a two-layer model, and a spec (a registry
pattern composed with others, or a pattern's example), then runs random operations on both
layers' caches alike: appends (plain, or a mixed batch's counts; checked or not; now and then
naming a slot twice, none, or more than the capacity or the free pages hold), reservations,
releases, checks, and reads of some slots, decoded tokens or a mixed batch, one call per layer
or a :class:`flexspec.Step` whose first layer makes the read. A token's keys sometimes hold a
NaN. A model of the pool (each slot's tokens, the pages each slot holds, whether an unchecked
operation was refused) says what each operation must do; each read's rows are compared with the
reference of their request alone over the model's keys and values (a NaN reaching exactly the
rows that read it, and no other request's).

A sequence fails when something other than a flexspec error escapes, when an operation does
other than the model says (refused or not, raised or flagged), or when a read differs from the
reference. The summary counts sequences, operations and reads; failures are printed with their
seed and traceback, and the exit code is 1 when any sequence failed.

    python -m flexspec.testing.serving --n 10000 --seed 0
"""

from __future__ import annotations

import argparse
import random
import traceback
from dataclasses import dataclass, field

import flexspec
from flexspec.errors import SpecError

OPERATIONS = ("append", "append", "append", "read", "read", "release", "reserve", "check")


@dataclass
class Report:
    """What a run did: sequences, operations, reads compared, refusals, and the failures (seed
    of the sequence, traceback)."""

    sequences: int = 0
    operations: int = 0
    reads: int = 0
    refused: int = 0
    specs_refused: int = 0   # sequences whose spec the pool's reads cannot take (a flexspec error)
    failures: list = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.sequences} sequences: {self.operations} operations, {self.reads} reads "
                f"compared with the reference, {self.refused} refused as the model said, "
                f"{self.specs_refused} specs refused, {len(self.failures)} failures")


class Pool:
    """The two layers' caches of one sequence and the model of them (see the module
    docstring)."""

    def __init__(self, rng: random.Random):
        import torch
        self.rng = rng
        self.page = rng.choice((4, 16))
        self.slots, self.max_pages = rng.randint(2, 4), rng.randint(1, 3)
        self.pages = rng.randint(1, self.slots * self.max_pages)
        self.kv_heads, self.dim = rng.choice((1, 2)), rng.choice((4, 8))
        self.caches = [flexspec.PagedKVCache(pages=self.pages, page_size=self.page,
                                             kv_heads=self.kv_heads, head_dim=self.dim,
                                             slots=self.slots, max_pages=self.max_pages)
                       for _ in range(2)]
        # slot -> the keys and values of its tokens, per layer: [layer][slot] -> list of
        # (key [Hkv, D], value [Hkv, D])
        self.tokens = [{slot: [] for slot in range(self.slots)} for _ in range(2)]
        self.held = {slot: 0 for slot in range(self.slots)}
        self.pending = False
        self.generator = torch.Generator().manual_seed(rng.randrange(2**31))

    @property
    def capacity(self) -> int:
        return self.page * self.max_pages

    def lengths(self) -> dict:
        return {slot: len(tokens) for slot, tokens in self.tokens[0].items()}

    def _needs(self, slot: int, length: int) -> int:
        return max(-(-length // self.page), self.held[slot]) - self.held[slot]

    def serves(self, wanted: dict) -> bool:
        """Whether the pool serves ``slot -> length`` in all (pages and capacity)."""
        free = self.pages - sum(self.held.values())
        return all(length <= self.capacity for length in wanted.values()) and \
            sum(self._needs(slot, length) for slot, length in wanted.items()) <= free

    def slot_list(self, most: int) -> list:
        """Some slots, now and then one named twice or none."""
        roll = self.rng.random()
        if roll < 0.05:
            return []
        chosen = self.rng.sample(range(self.slots), self.rng.randint(1, min(most, self.slots)))
        if roll < 0.12:
            chosen.append(chosen[0])
        return chosen

    def expect(self, refused: bool, check: bool, call) -> bool:
        """Run ``call`` as the model says it must go: refused and checked raises, refused and
        unchecked flags; returns whether the operation changes the pool."""
        if refused and check:
            try:
                call()
            except SpecError as error:
                if "refused and changed nothing" not in str(error):
                    raise
                return False
            raise AssertionError("a refused operation did not raise")
        call()
        self.pending |= refused
        return not refused


def _tokens(pool: Pool, count: int, poison: bool) -> list:
    """``count`` tokens (key, value) for each layer, the first key holding a NaN if ``poison``."""
    import torch
    made = []
    for _ in range(2):
        tokens = []
        for index in range(count):
            key = torch.randn(pool.kv_heads, pool.dim, generator=pool.generator)
            value = torch.randn(pool.kv_heads, pool.dim, generator=pool.generator)
            if poison and index == 0:
                key[0, 0] = float("nan")
            tokens.append((key, value))
        made.append(tokens)
    return made


def _append(pool: Pool, report: Report) -> None:
    import torch
    rng = pool.rng
    slots = pool.slot_list(3)
    mixed = rng.random() < 0.4 and slots
    counts = [rng.randint(1, 6) for _ in slots] if mixed else [rng.randint(1, 6)] * len(slots)
    width = max(counts, default=1)
    check = rng.random() < 0.6
    made = [_tokens(pool, count, rng.random() < 0.1) for count in counts]  # [row][layer]

    def call():
        for layer, cache in enumerate(pool.caches):
            keys = torch.zeros(len(slots), pool.kv_heads, width, pool.dim)
            values = torch.zeros_like(keys)
            for row, tokens in enumerate(made):
                for position, (key, value) in enumerate(tokens[layer]):
                    keys[row, :, position], values[row, :, position] = key, value
            cache.append(torch.tensor(slots, dtype=torch.long), keys, values, check=check,
                         new_tokens=counts if mixed else None)
    if len(set(slots)) < len(slots):  # the host sees it: refused whatever check says
        try:
            call()
        except SpecError as error:
            if "named twice" not in str(error):
                raise
            report.refused += 1
            return
        raise AssertionError("slots named twice were not refused")
    lengths = pool.lengths()
    wanted = {slot: lengths[slot] + count for slot, count in zip(slots, counts)}
    if pool.expect(not pool.serves(wanted), check, call):
        for slot, tokens in zip(slots, made):
            pool.held[slot] += pool._needs(slot, wanted[slot])
            for layer in range(2):
                pool.tokens[layer][slot].extend(tokens[layer])
    else:
        report.refused += 1


def _reserve(pool: Pool, report: Report) -> None:
    import torch
    rng = pool.rng
    slots = rng.sample(range(pool.slots), rng.randint(1, pool.slots))
    lengths = [rng.randint(0, pool.capacity) for _ in slots]
    check = rng.random() < 0.6
    wanted = dict(zip(slots, lengths))

    def call():
        for cache in pool.caches:
            cache.reserve(torch.tensor(slots), torch.tensor(lengths), check=check)
    if pool.expect(not pool.serves(wanted), check, call):
        for slot, length in wanted.items():
            pool.held[slot] += pool._needs(slot, length)
    else:
        report.refused += 1


def _release(pool: Pool, report: Report) -> None:
    import torch
    slots = pool.rng.sample(range(pool.slots), pool.rng.randint(0, 2))
    for cache in pool.caches:
        cache.release(torch.tensor(slots, dtype=torch.long))
    for slot in slots:
        pool.held[slot] = 0
        for layer in range(2):
            pool.tokens[layer][slot] = []


def _check(pool: Pool, report: Report) -> None:
    for cache in pool.caches:
        try:
            cache.check()
        except SpecError:
            if not pool.pending:
                raise
        else:
            if pool.pending:
                raise AssertionError("check() said nothing of a refused operation")
    pool.pending = False


def _read(pool: Pool, attn, report: Report) -> None:
    import torch

    from flexspec.tools.values import demo_bindings
    rng = pool.rng
    lengths = pool.lengths()
    ready = [slot for slot, length in lengths.items() if length >= 1]
    if not ready:
        return
    slots = rng.sample(ready, rng.randint(1, len(ready)))
    counts = [rng.randint(1, min(3, lengths[slot])) for slot in slots]
    mixed = rng.random() < 0.3
    if not mixed:
        counts = [min(counts)] * len(slots)
    q_len, heads = max(counts), pool.kv_heads * rng.choice((1, 2))
    bindings, _ = demo_bindings(attn, q_len, pool.capacity, batch=len(slots) - 1, heads=heads)
    qs = [torch.randn(len(slots), heads, q_len, pool.dim, generator=pool.generator)
          for _ in range(2)]
    index = torch.tensor(slots)
    new_tokens = counts if mixed else None
    if rng.random() < 0.5:
        step = flexspec.Step(slots=index, new_tokens=new_tokens, **bindings)
        outs = [attn.paged(q, cache, step=step) for q, cache in zip(qs, pool.caches)]
    else:
        outs = [attn.paged(q, cache, index, new_tokens=new_tokens, **bindings)
                for q, cache in zip(qs, pool.caches)]
    for layer, out in enumerate(outs):
        for row, (slot, count) in enumerate(zip(slots, counts)):
            tokens = pool.tokens[layer][slot]
            keys = torch.stack([key for key, _ in tokens], dim=1)[None].double()
            values = torch.stack([value for _, value in tokens], dim=1)[None].double()
            width = pool.capacity - len(tokens)  # the request alone, at the cache's capacity
            keys = torch.cat([keys, keys.new_zeros(1, pool.kv_heads, width, pool.dim)], dim=2)
            values = torch.cat([values, values.new_zeros(1, pool.kv_heads, width, pool.dim)],
                               dim=2)
            alone = {name: value[row:row + 1] if _per_row(attn, name, value, len(slots))
                     else value for name, value in bindings.items()}
            want = attn.reference(qs[layer][row:row + 1, :, :count].double(), keys, values,
                                  q_offset=len(tokens) - count,
                                  kv_lengths=torch.tensor([len(tokens)]), **alone)
            got = out[row:row + 1, :, :count].double()
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True):
                raise AssertionError(f"layer {layer}, slot {slot}: the read differs from the "
                                     f"request's reference by "
                                     f"{(got - want).abs().nan_to_num(1e9).max():.3g}")
            if mixed and out[row, :, count:].any():
                raise AssertionError("a mixed batch's padding rows are not zero")
    report.reads += 1


def _per_row(attn, name: str, value, batch: int) -> bool:
    """Whether binding ``name`` is given with a row per batch row (declared [B, ...])."""
    declared = {tensor.name: tensor for tensor in attn.ir.tensors()}[name]
    return (declared.shape and str(declared.shape[0]) == "B" and value.dim() == len(declared.shape)
            and value.shape[0] == batch and batch > 1)


def run_sequence(rng: random.Random, operations: int, report: Report) -> None:
    """One sequence (see the module docstring); raises what the sequence finds."""
    from flexspec.testing.fuzz import _composed
    pool = Pool(rng)
    text = _composed(rng) if rng.random() < 0.5 else rng.choice(flexspec.patterns()).example
    try:
        attn = flexspec.compile(text)
    except SpecError:
        attn = flexspec.compile("causal")
    for _ in range(operations):
        kind = rng.choice(OPERATIONS)
        report.operations += 1
        if kind == "read":
            try:
                _read(pool, attn, report)
            except SpecError:  # a spec these bindings or this pool cannot take: a new one
                report.specs_refused += 1
                attn = flexspec.compile("causal")
        else:
            {"append": _append, "reserve": _reserve, "release": _release,
             "check": _check}[kind](pool, report)


def fuzz_serving(n: int, seed: int = 0, operations: int = 12, echo=print) -> Report:
    """Run ``n`` sequences from ``seed``; see the module docstring."""
    import torch
    torch.set_num_threads(1)  # small shapes: threads cost more than they give
    report = Report()
    for index in range(n):
        sequence_seed = seed * 1_000_003 + index
        try:
            with torch.no_grad():
                run_sequence(random.Random(sequence_seed), operations, report)
        except Exception:  # noqa: BLE001 - anything that escapes is the finding
            report.failures.append((sequence_seed, traceback.format_exc()))
            echo(f"FAILURE (sequence seed {sequence_seed})\n{traceback.format_exc()}")
        report.sequences += 1
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="how many sequences (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--operations", type=int, default=12,
                        help="operations in a sequence (default 12)")
    args = parser.parse_args(argv)
    report = fuzz_serving(args.n, args.seed, args.operations)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
