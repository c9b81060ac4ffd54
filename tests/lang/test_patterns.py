"""The named patterns (``patterns/*.yaml``) against independent, hand-written definitions.

Each pattern's meaning is pinned by a plain-Python function over ``b h q kv`` (ints and ``math``
only, no flexspec code), evaluated with loops on small shapes and compared with the registry's IR
as run by the eager reference (``flexspec.kernels.reference``). Masks compare the dense boolean mask;
score modifiers compare the score pipeline applied to random logits. Shapes include
``Q_LEN != KV_LEN`` and lengths that are not multiples of anything in particular (13, 17).

The file also checks the registry's content: every file loads, names match file stems, examples
parse, aliases resolve, references carry URLs, and every pattern has a hand-written test here.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
import torch
import yaml

import flexspec
from flexspec import ir
from flexspec.kernels.reference import dense_mask, dense_scores
from flexspec.kernels.tensors import builtin_tensor, tensor_key

PATTERNS_DIR = Path(__file__).resolve().parents[2] / "patterns"
PATTERN_FILES = sorted(PATTERNS_DIR.glob("*.yaml"))

B, H = 2, 3
# (Q_LEN, KV_LEN): square, more keys than queries (decoding / cache), more queries than keys.
SHAPES = [(13, 13), (13, 17), (17, 13)]
SELF_SHAPES = [(13, 13), (13, 17)]  # for patterns that look queries up in the key sequence


# ---------------------------------------------------------------------------------------------
# Helpers


def rand_ints(seed: int, shape, low: int, high: int) -> list:
    rng = random.Random(seed)
    if len(shape) == 1:
        return [rng.randrange(low, high) for _ in range(shape[0])]
    return [rand_ints(seed * 31 + i + 1, shape[1:], low, high) for i in range(shape[0])]


def sorted_doc_ids(seed: int, batch: int, length: int) -> list:
    """Packed-sequence ids: runs of equal ids, different per batch row."""
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        row, doc = [], 0
        while len(row) < length:
            row += [doc] * rng.randrange(1, 6)
            doc += 1
        rows.append(row[:length])
    return rows


def as_tensor(value, dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def tensors_for(spec_ir: ir.AttentionIR, sizes: dict, values: dict) -> dict:
    """The tensor dict the reference reads: builtins computed, the others from ``values``, keyed
    by binding name, or for a learnable by the parameter it comes from (``table``: its stable
    name, e.g. ``rel_bias_table``, ends with the parameter name)."""
    out = {}
    for t in spec_ir.tensors():
        key = tensor_key(t)
        if t.origin == "builtin":
            out[key] = builtin_tensor(t, sizes, dtype=torch.float64)
        elif t.name in values:
            out[key] = values[t.name]
        else:
            [param] = [name for name in values if t.origin == "learnable" and t.name.endswith(name)]
            out[key] = values[param]
    return out


def python_mask(fn, batch, heads, q_len, kv_len) -> torch.Tensor:
    sizes = dict(B=batch, H=heads, Q_LEN=q_len, KV_LEN=kv_len)
    return torch.tensor([[[[bool(fn(b, h, q, kv, sizes)) for kv in range(kv_len)]
                           for q in range(q_len)] for h in range(heads)] for b in range(batch)])


def python_scores(fn, logits: torch.Tensor) -> torch.Tensor:
    batch, heads, q_len, kv_len = logits.shape
    sizes = dict(B=batch, H=heads, Q_LEN=q_len, KV_LEN=kv_len)
    s = logits.tolist()
    return torch.tensor([[[[float(fn(s[b][h][q][kv], b, h, q, kv, sizes)) for kv in range(kv_len)]
                           for q in range(q_len)] for h in range(heads)] for b in range(batch)],
                        dtype=torch.float64)


def spec_mask(text: str, batch, heads, q_len, kv_len, values=None) -> torch.Tensor:
    spec = flexspec.parse(text)
    sizes = dict(B=batch, H=heads, Q_LEN=q_len, KV_LEN=kv_len)
    return dense_mask(spec.ir, batch, heads, q_len, kv_len, tensors_for(spec.ir, sizes, values or {}))


def spec_scores(text: str, logits: torch.Tensor, values=None) -> torch.Tensor:
    spec = flexspec.parse(text)
    batch, heads, q_len, kv_len = logits.shape
    sizes = dict(B=batch, H=heads, Q_LEN=q_len, KV_LEN=kv_len)
    return dense_scores(spec.ir, logits, tensors_for(spec.ir, sizes, values or {}))


def random_logits(seed, batch, heads, q_len, kv_len, scale=4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, q_len, kv_len, generator=gen, dtype=torch.float64) * scale


def assert_same_mask(got: torch.Tensor, want: torch.Tensor, text: str):
    assert got.shape == want.shape, f"{text}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        diff = (got != want).nonzero().tolist()
        b, h, q, kv = diff[0]
        raise AssertionError(f"{text}: {len(diff)} positions differ, first at b={b} h={h} q={q} "
                             f"kv={kv}: spec says {bool(got[b, h, q, kv])}, hand-written says "
                             f"{bool(want[b, h, q, kv])}")


# ---------------------------------------------------------------------------------------------
# Hand-written definitions (plain Python; sizes = dict(B, H, Q_LEN, KV_LEN))


def hw_natten(width, height, kernel_w, kernel_h):
    """NATTEN as its papers describe it: the kernel_h x kernel_w window *starts* at the query's
    row/col minus half the kernel, shifted to stay inside the canvas."""
    def start(pos, kernel, extent):
        return min(max(pos - kernel // 2, 0), extent - kernel)

    def fn(b, h, q, kv, s):
        q_row, q_col = divmod(q, width)
        kv_row, kv_col = divmod(kv, width)
        if kv_row >= height:          # keys past the canvas are never visible
            return False
        q_row = min(q_row, height - 1)  # queries past the canvas: their row is clamped
        r0, c0 = start(q_row, kernel_h, height), start(q_col, kernel_w, width)
        return r0 <= kv_row < r0 + kernel_h and c0 <= kv_col < c0 + kernel_w
    return fn


DOC_IDS = sorted_doc_ids(7, B, 17)
DOC_IDS_SHUFFLED = rand_ints(11, (B, 17), 0, 3)  # ids need not be contiguous
IS_GLOBAL = [[i in (0, 5) for i in range(17)], [i in (3, 16) for i in range(17)]]
# row 0 padded on the left (3 positions), row 1 on the right (4 positions)
VALID = [[i >= 3 for i in range(17)], [i < 13 for i in range(17)]]

# (spec text, hand-written mask fn, shapes, runtime tensors by name)
MASK_CASES = [
    ("full", lambda b, h, q, kv, s: True, SHAPES, {}),
    ("causal", lambda b, h, q, kv, s: kv <= q, SHAPES, {}),
    ("causal_bottom_right",
     lambda b, h, q, kv, s: kv <= q + (s["KV_LEN"] - s["Q_LEN"]), SHAPES + [(1, 17)], {}),
    ("window(3)", lambda b, h, q, kv, s: q - 3 <= kv <= q + 3, SHAPES, {}),
    ("window(0)", lambda b, h, q, kv, s: kv == q, SHAPES, {}),
    ("sliding_window(3)", lambda b, h, q, kv, s: q - 3 <= kv <= q, SHAPES, {}),
    ("sliding_window(0)", lambda b, h, q, kv, s: kv == q, SHAPES, {}),
    ("sliding_window", lambda b, h, q, kv, s: q - 1024 <= kv <= q, SHAPES, {}),
    ("prefix(4)", lambda b, h, q, kv, s: kv in (0, 1, 2, 3), SHAPES, {}),
    ("prefix_lm(5)", lambda b, h, q, kv, s: kv < 5 or kv <= q, SHAPES, {}),
    ("prefix_lm(0)", lambda b, h, q, kv, s: kv <= q, SHAPES, {}),
    ("sink", lambda b, h, q, kv, s: kv < 4, SHAPES, {}),
    ("sink(2)", lambda b, h, q, kv, s: kv < 2, SHAPES, {}),
    ("sliding_window(3) | sink(2)", lambda b, h, q, kv, s: 0 <= q - kv <= 3 or kv < 2, SHAPES, {}),
    ("causal & (window(3) | sink(2))",
     lambda b, h, q, kv, s: kv <= q and (q - kv <= 3 or kv < 2), SHAPES, {}),
    ("document", lambda b, h, q, kv, s: DOC_IDS[b][q] == DOC_IDS[b][kv], SELF_SHAPES,
     {"doc_ids": as_tensor(DOC_IDS, torch.int64)}),
    ("causal & document",
     lambda b, h, q, kv, s: kv <= q and DOC_IDS[b][q] == DOC_IDS[b][kv], SELF_SHAPES,
     {"doc_ids": as_tensor(DOC_IDS, torch.int64)}),
    ("doc", lambda b, h, q, kv, s: DOC_IDS_SHUFFLED[b][q] == DOC_IDS_SHUFFLED[b][kv], SELF_SHAPES,
     {"doc_ids": as_tensor(DOC_IDS_SHUFFLED, torch.int64)}),
    # one id row for the whole batch, given as [KV_LEN]: broadcasts over b
    ("causal & doc", lambda b, h, q, kv, s: kv <= q and DOC_IDS[1][q] == DOC_IDS[1][kv],
     SELF_SHAPES, {"doc_ids": as_tensor(DOC_IDS[1], torch.int64)}),
    ("chunked(4)", lambda b, h, q, kv, s: int(q / 4) == int(kv / 4), SHAPES, {}),
    ("chunked(1)", lambda b, h, q, kv, s: q == kv, SHAPES, {}),
    ("causal & chunked(5)", lambda b, h, q, kv, s: kv <= q and q - q % 5 <= kv, SHAPES, {}),
    ("block_causal(4)", lambda b, h, q, kv, s: kv < (q // 4 + 1) * 4, SHAPES, {}),
    ("block_causal(1)", lambda b, h, q, kv, s: kv <= q, SHAPES, {}),
    ("dilated(6, 2)", lambda b, h, q, kv, s: abs(q - kv) <= 6 and abs(q - kv) % 2 == 0, SHAPES, {}),
    ("dilated(5, 3)", lambda b, h, q, kv, s: kv in (q - 3, q, q + 3), SHAPES, {}),
    ("dilated(4, 1)", lambda b, h, q, kv, s: abs(q - kv) <= 4, SHAPES, {}),
    ("causal & dilated(7, 2)", lambda b, h, q, kv, s: kv in range(q, q - 8, -2), SHAPES, {}),
    ("strided(4)", lambda b, h, q, kv, s: abs(q - kv) % 4 == 0, SHAPES, {}),
    ("causal & strided(3)", lambda b, h, q, kv, s: kv in range(q, -1, -3), SHAPES, {}),
    ("global_tokens", lambda b, h, q, kv, s: IS_GLOBAL[b][q] or IS_GLOBAL[b][kv], SELF_SHAPES,
     {"is_global": as_tensor(IS_GLOBAL, torch.bool)}),
    # one flag row for the whole batch, given as [1, KV_LEN]
    ("global_tokens", lambda b, h, q, kv, s: IS_GLOBAL[0][q] or IS_GLOBAL[0][kv], SELF_SHAPES,
     {"is_global": as_tensor(IS_GLOBAL[:1], torch.bool)}),
    ("window(1) | global_tokens",
     lambda b, h, q, kv, s: abs(q - kv) <= 1 or IS_GLOBAL[b][q] or IS_GLOBAL[b][kv], SELF_SHAPES,
     {"is_global": as_tensor(IS_GLOBAL, torch.bool)}),
    ("key_padding", lambda b, h, q, kv, s: VALID[b][kv], [(13, 17), (17, 17)],
     {"valid": as_tensor(VALID, torch.bool)}),
    ("causal & padding", lambda b, h, q, kv, s: kv <= q and VALID[b][kv], [(17, 17)],
     {"valid": as_tensor(VALID, torch.bool)}),
    ("natten(4, 4, 3, 3)", hw_natten(4, 4, 3, 3), [(16, 16)], {}),
    ("natten(5, 3, 3, 1)", hw_natten(5, 3, 3, 1), [(15, 15)], {}),
    ("natten(3, 5, 1, 3)", hw_natten(3, 5, 1, 3), [(15, 15)], {}),
    ("natten(6, 3, 5, 3)", hw_natten(6, 3, 5, 3), [(18, 18)], {}),
    ("natten(7, 4, 3, 1)", hw_natten(7, 4, 3, 1), [(28, 28)], {}),
    ("natten(4, 4, 1, 1)", hw_natten(4, 4, 1, 1), [(16, 16)], {}),
    ("natten(4, 3, 3, 3)", hw_natten(4, 3, 3, 3), [(12, 17), (17, 12)], {}),
]


@pytest.mark.parametrize("text, fn, shapes, values", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_mask_matches_hand_written(text, fn, shapes, values):
    for q_len, kv_len in shapes:
        got = spec_mask(text, B, H, q_len, kv_len, values)
        want = python_mask(fn, B, H, q_len, kv_len)
        assert_same_mask(got, want, f"{text} at Q_LEN={q_len}, KV_LEN={kv_len}")


@pytest.mark.parametrize("text, tensors", [
    ("document", {"doc_ids": as_tensor(DOC_IDS, torch.int64)}),
    ("global_tokens", {"is_global": as_tensor(IS_GLOBAL, torch.bool)}),
])
def test_query_lookups_need_q_len_at_most_kv_len(text, tensors):
    """`document` and `global_tokens` look queries up in the key-length tensor: with more
    queries than keys the reference refuses to read past its end (documented in the YAML)."""
    with pytest.raises(flexspec.SpecError):
        spec_mask(text, B, H, 18, 17, tensors)


@pytest.mark.parametrize("width, height, kw, kh", [(4, 4, 3, 3), (5, 3, 3, 1), (6, 3, 5, 3),
                                                   (7, 4, 3, 3), (5, 5, 5, 5), (9, 2, 7, 1)])
def test_natten_every_query_sees_a_full_kernel(width, height, kw, kh):
    n = width * height
    mask = spec_mask(f"natten({width}, {height}, {kw}, {kh})", 1, 1, n, n)
    assert mask.sum(-1).eq(kw * kh).all()


def hw_alibi_slopes(heads):
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def hw_t5_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128):
    """Hugging Face transformers' T5Attention._relative_position_bucket, one int at a time."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            bucket += num_buckets
        rel = abs(rel)
    else:
        rel = -min(rel, 0)
    max_exact = num_buckets // 2
    if rel < max_exact:
        return bucket + rel
    large = max_exact + int(math.log(rel / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def _table(seed, rows, cols):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64)


REL_TABLE = _table(1, H, 2 * 4 + 1)
T5_TABLE = _table(2, H, 8)
T5_TABLE_32 = _table(3, H, 32)
REL, T5, T5_32 = REL_TABLE.tolist(), T5_TABLE.tolist(), T5_TABLE_32.tolist()  # plain lists
HEAD_BIAS = [0.5, -1.25, 3.0]
SLOPES = [0.3, 0.07, 1.5]

# (spec text, hand-written fn(score, b, h, q, kv, sizes), shapes, tensors by name or key)
SCORE_CASES = [
    ("alibi", lambda x, b, h, q, kv, s: x - hw_alibi_slopes(s["H"])[h] * abs(q - kv), SHAPES, {}),
    ("alibi(slopes=my_slopes)", lambda x, b, h, q, kv, s: x - SLOPES[h] * abs(q - kv), SHAPES,
     {"my_slopes": torch.tensor(SLOPES, dtype=torch.float64)}),
    ("softcap(20.0)", lambda x, b, h, q, kv, s: 20.0 * math.tanh(x / 20.0), SHAPES, {}),
    ("softcap(2.5)", lambda x, b, h, q, kv, s: 2.5 * math.tanh(x / 2.5), SHAPES, {}),
    ("softcap", lambda x, b, h, q, kv, s: 50.0 * math.tanh(x / 50.0), SHAPES, {}),
    ("scale(0.5)", lambda x, b, h, q, kv, s: x * 0.5, SHAPES, {}),
    ("scale(-3.0)", lambda x, b, h, q, kv, s: -3.0 * x, SHAPES, {}),
    ("head_bias", lambda x, b, h, q, kv, s: x + HEAD_BIAS[h], SHAPES,
     {"bias": torch.tensor(HEAD_BIAS, dtype=torch.float64)}),
    ("rel_bias(max_distance=4)",
     lambda x, b, h, q, kv, s: x + REL[h][max(-4, min(4, kv - q)) + 4], SHAPES,
     {"table": REL_TABLE}),
    ("t5_bias(num_buckets=8, max_distance=12)",
     lambda x, b, h, q, kv, s: x + T5[h][hw_t5_bucket(kv - q, True, 8, 12)], SHAPES,
     {"table": T5_TABLE}),
    ("t5_bias(num_buckets=8, max_distance=12, bidirectional=false)",
     lambda x, b, h, q, kv, s: x + T5[h][hw_t5_bucket(kv - q, False, 8, 12)], SHAPES,
     {"table": T5_TABLE}),
    ("t5_bias",
     lambda x, b, h, q, kv, s: x + T5_32[h][hw_t5_bucket(kv - q)], SHAPES,
     {"table": T5_TABLE_32}),
    # chains apply left to right: s2(s1(score))
    ("alibi + softcap(3.0)",
     lambda x, b, h, q, kv, s: 3.0 * math.tanh((x - hw_alibi_slopes(s["H"])[h] * abs(q - kv)) / 3.0),
     SHAPES, {}),
    ("softcap(3.0) + alibi",
     lambda x, b, h, q, kv, s: 3.0 * math.tanh(x / 3.0) - hw_alibi_slopes(s["H"])[h] * abs(q - kv),
     SHAPES, {}),
]


@pytest.mark.parametrize("text, fn, shapes, values", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_score_matches_hand_written(text, fn, shapes, values):
    for seed, (q_len, kv_len) in enumerate(shapes):
        logits = random_logits(seed, B, H, q_len, kv_len)
        got = spec_scores(text, logits, values)
        want = python_scores(fn, logits)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{text} at Q_LEN={q_len}, KV_LEN={kv_len}: {m}")


@pytest.mark.parametrize("heads", [1, 3, 8, 12])
def test_alibi_default_slopes(heads):
    logits = torch.zeros(1, heads, 1, 2, dtype=torch.float64)
    got = spec_scores("alibi", logits)[0, :, 0, 1].tolist()
    want = [-s for s in hw_alibi_slopes(heads)]
    assert got == pytest.approx(want, rel=1e-15)
    if heads == 8:
        assert got == [-1 / 2 ** (k + 1) for k in range(8)]


@pytest.mark.parametrize("num_buckets, max_distance, bidirectional",
                         [(32, 128, True), (32, 128, False), (8, 12, True), (16, 100, False),
                          (64, 256, True), (6, 10, True), (128, 128, True), (7, 20, False),
                          (4, 8, True), (4, 3, False)])
def test_t5_buckets_over_long_distances(num_buckets, max_distance, bidirectional):
    """The bucket itself, over distances up to 2.5 * max_distance in both directions: a table
    holding its own column index turns the bias into the bucket number."""
    text = (f"t5_bias(num_buckets={num_buckets}, max_distance={max_distance}, "
            f"bidirectional={'true' if bidirectional else 'false'})")
    n = int(2.5 * max_distance) + 2
    table = torch.arange(num_buckets, dtype=torch.float64).repeat(1, 1)
    values = {"table": table}
    after = spec_scores(text, torch.zeros(1, 1, 1, n, dtype=torch.float64), values)[0, 0, 0]
    before = spec_scores(text, torch.zeros(1, 1, n, 1, dtype=torch.float64), values)[0, 0, :, 0]
    assert after.tolist() == [hw_t5_bucket(kv, bidirectional, num_buckets, max_distance)
                              for kv in range(n)]
    assert before.tolist() == [hw_t5_bucket(-q, bidirectional, num_buckets, max_distance)
                               for q in range(n)]


# ---------------------------------------------------------------------------------------------
# The registry's content


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_every_pattern_has_a_hand_written_test():
    tested = set()
    for text, *_ in MASK_CASES + SCORE_CASES:
        tested |= _names_in(text)
    names = {p.name for p in flexspec.patterns()}
    assert names - tested == set(), f"patterns without a hand-written test: {sorted(names - tested)}"


def _names_in(text: str) -> set:
    """The registry patterns a spec text names (aliases resolved)."""
    found = set()
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
        try:
            found.add(flexspec.pattern(word).name)
        except flexspec.SpecError:
            pass
    return found


def test_registry_holds_every_file():
    assert len(PATTERN_FILES) >= 20
    assert sorted(p.name for p in flexspec.patterns()) == sorted(f.stem for f in PATTERN_FILES)


@pytest.mark.parametrize("path", PATTERN_FILES, ids=[p.stem for p in PATTERN_FILES])
def test_pattern_file(path):
    data = _load(path)
    assert data["name"] == path.stem
    assert data["kind"] in ("mask", "score")
    assert set(data) <= {"name", "kind", "summary", "description", "params", "definition",
                         "aliases", "tags", "references", "example", "align"}
    assert data.get("align", "start") in ("start", "end")
    assert data["summary"].strip() and "\n" not in data["summary"].strip()
    assert len(data.get("description", "")) > 200, "describe conventions and pitfalls"
    assert "\n" not in data["definition"].strip(), "the definition is one line"
    assert data["tags"] and all(t == t.lower() and " " not in t for t in data["tags"])
    for param in data.get("params") or []:
        assert param.get("doc"), f"parameter {param['name']} has no doc"

    pattern = flexspec.pattern(path.stem)
    assert pattern.name == path.stem and pattern.kind == data["kind"]
    assert pattern.references
    for ref in pattern.references:
        assert ref.url.startswith(("https://", "http://")) and ref.title.strip()

    example = flexspec.parse(pattern.example)
    assert path.stem in _names_in(pattern.example)
    assert example.ir.has_mask or example.ir.has_score or path.stem == "full"


@pytest.mark.parametrize("name", [p.stem for p in PATTERN_FILES])
def test_kind_matches_the_ir(name):
    """A mask pattern resolves to a mask only, a score pattern to a score pipeline only."""
    pattern = flexspec.pattern(name)
    args = {"window": "(2)", "prefix": "(2)", "prefix_lm": "(2)", "chunked": "(2)",
            "block_causal": "(2)", "dilated": "(4, 2)", "strided": "(2)",
            "natten": "(4, 4, 3, 3)", "scale": "(2.0)"}.get(pattern.name, "")
    spec = flexspec.parse(pattern.name + args)
    if pattern.kind == "mask":
        assert spec.ir.score == ir.SCORE
    else:
        assert spec.ir.mask == ir.TRUE and spec.ir.has_score


def test_aliases():
    assert flexspec.pattern("doc") == flexspec.pattern("document")
    assert flexspec.pattern("document").aliases == ("doc",)
    assert flexspec.parse("causal & doc").ir == flexspec.parse("causal & document").ir
    assert flexspec.parse("doc").ir.bindings() == flexspec.parse("document").ir.bindings()
    assert [t.name for t in flexspec.parse("doc").ir.bindings()] == ["doc_ids"]


def test_runtime_bindings_are_named_after_parameters():
    assert flexspec.parse("causal & document").bindings == ["doc_ids"]
    assert flexspec.parse("global_tokens").bindings == ["is_global"]
    assert flexspec.parse("head_bias").bindings == ["bias"]
    assert flexspec.parse("alibi").bindings == []
    assert flexspec.parse("rel_bias").bindings == []


@pytest.mark.parametrize("a, b", [
    ("sliding_window(5)", "causal & window(5)"),
    ("sliding_window", "sliding_window(1024)"),
    ("sink", "sink(4)"),
    ("sink(3)", "prefix(3)"),
    ("prefix_lm(3)", "causal | prefix(3)"),
    ("softcap", "softcap(50.0)"),
    ("t5_bias", "t5_bias(32, 128, true)"),
    ("rel_bias", "rel_bias(128)"),
])
def test_equivalent_spellings(a, b):
    assert flexspec.parse(a).ir == flexspec.parse(b).ir


@pytest.mark.parametrize("text, shape", [("block_causal(4)", (13, 13)), ("block_causal(3)", (17, 17))])
def test_block_causal_is_causal_or_chunked(text, shape):
    n = text[len("block_causal("):-1]
    q_len, kv_len = shape
    assert torch.equal(spec_mask(text, 1, 1, q_len, kv_len),
                       spec_mask(f"causal | chunked({n})", 1, 1, q_len, kv_len))


@pytest.mark.parametrize("text, constraint", [
    ("window(-1)", "n >= 0"),
    ("sliding_window(-2)", "n >= 0"),
    ("prefix(-1)", "n >= 0"),
    ("sink(-1)", "n >= 0"),
    ("chunked(0)", "n >= 1"),
    ("block_causal(0)", "n >= 1"),
    ("strided(0)", "n >= 1"),
    ("dilated(3, 0)", "d >= 1"),
    ("dilated(-1, 2)", "n >= 0"),
    ("natten(4, 4, 2, 3)", "kernel_w % 2 == 1"),
    ("natten(4, 4, 5, 3)", "kernel_w <= width"),
    ("natten(4, 4, 3, 5)", "kernel_h <= height"),
    ("natten(4, 4, -1, 3)", "kernel_w >= 1"),
    ("natten(0, 4, 1, 1)", "width >= 1"),
    ("softcap(0.0)", "c > 0"),
    ("softcap(-30.0)", "c > 0"),
    ("rel_bias(max_distance=-1)", "max_distance >= 0"),
    ("t5_bias(num_buckets=2)", "num_buckets >= 4"),
    ("t5_bias(num_buckets=32, max_distance=16)", "max_distance > num_buckets // 2"),
])
def test_constraints_reject_bad_arguments(text, constraint):
    with pytest.raises(flexspec.SpecError) as err:
        flexspec.parse(text)
    assert constraint in str(err.value)
