"""Every formula in a pattern's pitfalls does what the text says it does.

The pitfalls are prose in each pattern's ``description`` (``patterns/*.yaml``): the part of a
paragraph from the word "Pitfall" on. A wrong formula there is worse than none: the
``sliding_window`` page advised ``causal_bottom_right & abs(q + KV_LEN - Q_LEN - kv) <= n`` for
decoding, which shifts the rows twice and lets every row see nothing.

So every span in backticks there that flexspec reads as a formula (an ``.attn`` statement, a spec,
or a definition expression, but not a bare name or number) must have an entry in :data:`CLAIMS`:
either a check of what the text claims, run on the CPU against masks from
``flexspec.compile(...).dense_mask`` (and, for score modifiers, against attention written out
here with torch), or a reason why it is not flexspec's formula (another library's code quoted).
A new pitfall formula fails :func:`test_every_pitfall_formula_has_a_claim` until it gets one.
"""

from __future__ import annotations

import re

import pytest
import torch

import flexspec
from flexspec.errors import Source, SpecError
from flexspec.lang import ast
from flexspec.lang.parser import parse_expr, parse_file, parse_spec

# (Q_LEN, KV_LEN) of decoding steps: one token, a few, and the whole sequence (prefill)
DECODING = [(1, 9), (3, 13), (13, 13)]


def pitfall_spans(description: str) -> list[str]:
    """The backticked spans of the pitfalls: each paragraph from "Pitfall" on."""
    spans = []
    for paragraph in description.split("\n\n"):
        start = paragraph.find("Pitfall")
        if start >= 0:
            spans += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", paragraph[start:])]
    return spans


def is_formula(text: str) -> bool:
    try:
        return bool(parse_file(text).statements)
    except SpecError:
        pass
    for parse in (parse_spec, lambda t: parse_expr(Source(t))):
        try:
            node = parse(text)
        except SpecError:
            continue
        return not isinstance(node, (ast.Name, ast.Int, ast.Float, ast.Bool, ast.Str))
    return False


def formulas() -> list[tuple[str, str]]:
    return [(p.name, span) for p in flexspec.patterns() for span in pitfall_spans(p.description)
            if is_formula(span)]


# ---- how a formula of the text is run


def as_mask(formula: str, params: str = "", args: str = ""):
    """The compiled mask of a definition expression or spec with free parameters: the body of
    ``mask claim(params)``, called as ``claim(args)``."""
    library = flexspec.loads(f"mask claim({params}) = {formula}\n", "pitfall.attn")
    return flexspec.compile(flexspec.parse(f"claim({args})", library=library))


def assert_decodes_like(attn, square, *, q_offset: bool = False, **bindings):
    """``attn`` at (Q_LEN, KV_LEN) gives the last Q_LEN rows of ``square`` at (KV_LEN, KV_LEN):
    the new tokens of a decoding step stand at the end of the cache. ``q_offset`` places them
    with the call's offset; ``bindings`` maps a name to a function of (Q_LEN, KV_LEN)."""
    for q_len, kv_len in DECODING:
        placed = {"q_offset": kv_len - q_len} if q_offset else {}
        values = {name: make(q_len, kv_len) for name, make in bindings.items()}
        got = attn.dense_mask(q_len, kv_len, **placed, **values)
        full = square(kv_len).dense_mask(kv_len, kv_len, **(
            {"doc_ids": values["kv_doc"]} if "kv_doc" in values else {}))
        expected = full[..., kv_len - q_len:, :]
        assert got.any(), f"no row sees any key at {q_len}x{kv_len}"
        assert torch.equal(got, expected.expand_as(got)), f"differs at {q_len}x{kv_len}"


def reference_output(q, k, v, bias, scale=None):
    """Softmax attention with an additive bias, written out (scale 1/sqrt(D) by default)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    weights = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
    return weights @ v


def qkv(heads: int = 2, length: int = 9, dim: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, length, dim, generator=generator, dtype=torch.float64)
            for _ in range(3)]


# ---- the claims, one function per formula


def sliding_window_counts_the_query_out():
    # transformers' `sliding_window: 4096` keeps q - kv < 4096 (with causal): sliding_window(4095)
    hf = as_mask("causal & (q - kv < 4096)")
    ours = flexspec.compile("sliding_window(4095)")
    for q_len, kv_len, offset in [(13, 13, 0), (8, 4200, 4192), (8, 4200, 4080)]:
        got = hf.dense_mask(q_len, kv_len, q_offset=offset)
        assert torch.equal(got, ours.dense_mask(q_len, kv_len, q_offset=offset))
    # and the edge lies where the text says: 4095 keys back is seen, 4096 is not
    row = ours.dense_mask(1, 4200, q_offset=4199)[0, 0, 0]
    assert row[4199 - 4095] and not row[4199 - 4096]


def sliding_window_decodes_from_the_end():
    for n in (0, 3):
        assert_decodes_like(flexspec.compile(f"causal_bottom_right & window({n})"),
                            lambda _: flexspec.compile(f"sliding_window({n})"))


def sliding_window_decodes_with_an_offset():
    for n in (0, 3):
        assert_decodes_like(as_mask("sliding_window(n)", "n: int", str(n)),
                            lambda _: flexspec.compile(f"sliding_window({n})"), q_offset=True)


def document_decodes_with_two_id_tensors():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4])
    attn = as_mask("q_doc[b, q] == kv_doc[b, kv]",
                   "q_doc: int[B, Q_LEN], kv_doc: int[B, KV_LEN]", "q_doc, kv_doc")
    assert_decodes_like(attn, lambda _: flexspec.compile("document"),
                        q_doc=lambda q_len, kv_len: ids[kv_len - q_len:kv_len][None],
                        kv_doc=lambda q_len, kv_len: ids[:kv_len][None])


def prefix_lm_per_row_prefix():
    library = flexspec.loads("mask plm(pl: int[B]) = causal | kv < pl[b]\n", "pitfall.attn")
    attn = flexspec.compile(flexspec.parse("plm", library=library))
    lengths = [2, 5, 0]
    got = attn.dense_mask(9, 9, batch=3, pl=torch.tensor(lengths))
    for row, n in enumerate(lengths):
        expected = flexspec.compile(f"prefix_lm({n})").dense_mask(9, 9)[0, 0]
        assert torch.equal(got[row, 0], expected), row


def alibi_takes_a_model_s_slopes():
    q, k, v = qkv(heads=3)
    slopes = torch.tensor([0.5, 0.1, 0.03], dtype=torch.float64)
    attn = flexspec.compile("causal + alibi(slopes=my_slopes)")
    got = attn.reference(q, k, v, my_slopes=slopes)
    positions = torch.arange(9)
    distance = (positions[:, None] - positions[None, :]).abs().to(torch.float64)
    causal = positions[:, None] >= positions[None, :]
    bias = torch.where(causal, -slopes[:, None, None] * distance, -torch.inf)
    torch.testing.assert_close(got, reference_output(q, k, v, bias))


def scale_multiplies_the_call_s_scale():
    q, k, v = qkv()
    stacked = flexspec.compile("scale(2.0)").reference(q, k, v, scale=0.25)  # x = 2
    replaced = flexspec.compile("full").reference(q, k, v, scale=0.5)
    torch.testing.assert_close(stacked, replaced)
    torch.testing.assert_close(replaced, reference_output(q, k, v, 0.0, scale=0.5))


def sink_leaks_to_later_sink_keys():
    mask = flexspec.compile("sliding_window(2) | sink(4)").dense_mask(10, 10)[0, 0]
    above = {(q, kv) for q in range(10) for kv in range(10) if kv > q and mask[q, kv]}
    assert above == {(q, kv) for q in range(3) for kv in range(q + 1, 4)}  # queries 0..2, keys 1..3


def t5_bias_shares_a_table_passed_by_name():
    q, k, v = qkv(heads=2)
    table = torch.randn(2, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    shared = flexspec.compile("causal + t5_bias(table=t) + t5_bias(table=t)")
    assert shared.bindings == ["t"]  # one tensor, read by both uses
    own = flexspec.compile("causal + t5_bias + t5_bias")
    assert own.bindings == [] and {t.name for t in own.spec.ir.tensors()
                                    if t.origin == "learnable"} == {"t5_bias_table",
                                                                    "t5_bias_table_2"}
    twice = flexspec.compile("causal + t5_bias(table=t) + scale(1.0)").reference(q, k, v, t=table)
    learnable = flexspec.compile("causal + t5_bias").reference(q, k, v, t5_bias_table=table)
    torch.testing.assert_close(twice, learnable)


class Foreign:
    """A span that reads as a formula but is not flexspec's (another library's code, a type)."""

    def __init__(self, why: str):
        self.why = why


CLAIMS = {
    ("sliding_window", "q - kv < 4096"): sliding_window_counts_the_query_out,
    ("sliding_window", "sliding_window(4095)"): sliding_window_counts_the_query_out,
    ("sliding_window", "kv_idx > q_idx - sliding_window"): Foreign(
        "transformers' code, in its names; its flexspec form q - kv < 4096 is checked"),
    ("sliding_window", "causal_bottom_right & window(n)"): sliding_window_decodes_from_the_end,
    ("sliding_window", "sliding_window(n)"): sliding_window_decodes_with_an_offset,
    ("document", "q_doc[b, q] == kv_doc[b, kv]"): document_decodes_with_two_id_tensors,
    ("prefix_lm", "mask plm(pl: int[B]) = causal | kv < pl[b]"): prefix_lm_per_row_prefix,
    ("alibi", "alibi(slopes=my_slopes)"): alibi_takes_a_model_s_slopes,
    ("alibi", "float[H]"): Foreign("the type of the slopes tensor, not a formula"),
    ("natten", "q // canvas_w"): Foreign("attention-gym's code, quoted to show its mistake"),
    ("scale", "scale(x)"): scale_multiplies_the_call_s_scale,
    ("sink", "sliding_window(w) | sink(4)"): sink_leaks_to_later_sink_keys,
    ("t5_bias", "t5_bias(table=t)"): t5_bias_shares_a_table_passed_by_name,
}


def test_every_pitfall_formula_has_a_claim():
    missing = [found for found in formulas() if found not in CLAIMS]
    assert missing == [], "add a check of these to CLAIMS"


def test_every_claim_is_a_formula_of_the_pitfalls():
    stale = sorted(set(CLAIMS) - set(formulas()))
    assert stale == [], "these formulas are no longer in the pitfalls"


@pytest.mark.parametrize("pattern, formula", [key for key, claim in CLAIMS.items()
                                              if not isinstance(claim, Foreign)],
                         ids=lambda x: x)
def test_a_pitfall_formula_does_what_the_text_says(pattern, formula):
    CLAIMS[pattern, formula]()


def test_the_decoding_check_refuses_the_advice_it_replaced():
    """The formula the sliding_window page gave before: its rows are shifted twice (once by
    causal_bottom_right's alignment, once by hand) and see nothing, which the check finds."""
    old = as_mask("causal_bottom_right & abs(q + KV_LEN - Q_LEN - kv) <= n", "n: int", "3")
    with pytest.raises(AssertionError, match="no row sees any key at 1x9"):
        assert_decodes_like(old, lambda _: flexspec.compile("sliding_window(3)"))
    assert formulas()  # and the detector finds formulas at all
    assert is_formula("causal_bottom_right & abs(q + KV_LEN - Q_LEN - kv) <= n")
