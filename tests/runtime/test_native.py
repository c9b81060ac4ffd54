"""The ``fa4`` backend's reading of a spec (flexspec.runtime.backends.native) on the CPU.

FA4's own kernels are not available here, so what they would compute is emulated from FA4's
documented arguments (a window ``(left, right)`` around the diagonal, variable-length sequences
from cumulative lengths, ``softcap * tanh(scale * qk / softcap)``) in float64, and compared with
flexspec's dense reference: a wrong form or wrong segments give another answer. The kernels
themselves are tested in tests/test_gpu.py.
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flexspec
from flexspec.ir.forms import native_form
from flexspec.runtime.backends.native import document_segments

ATOMS = ["causal", "window({n})", "sliding_window({n})", "left({n})", "right({n})",
         "left_open({n})", "behind({n})", "causal", "abs_window({n})", "doc", "full",
         "ahead({n})", "negated({n})"]
# hand-written masks, as an .attn file would define them
LIBRARY = flexspec.loads("""
mask left(n: int) = q - kv <= n
mask right(n: int) = kv - q <= n
mask left_open(n: int) = q - kv < n
mask behind(n: int) = kv >= q - n
mask abs_window(n: int) = abs(kv - q) <= n
mask ahead(n: int) = q + n >= kv
mask strictly_causal = q - kv >= 1
mask tall = q - kv <= KV_LEN
mask negated(n: int) = -(q - kv) >= -n
score halve = score / 2.0
""")
SCORES = ["", " + scale(0.5)", " + softcap(2.0)", " + scale(3.0) + softcap(0.7)"]


def emulated_fa4(form, q, k, v, segments, scale):
    """What FA4's own kernels compute for ``form``: float64, dense, from its arguments."""
    batch, heads, length, _ = q.shape
    logits = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale * form.factor
    if form.softcap is not None:
        logits = form.softcap * torch.tanh(logits / form.softcap)
    rows = torch.arange(length).view(-1, 1)
    cols = torch.arange(length).view(1, -1)
    visible = torch.ones(length, length, dtype=torch.bool)
    if form.left is not None:
        visible &= cols >= rows - form.left
    if form.right is not None:
        visible &= cols <= rows + form.right
    visible = visible.expand(batch, length, length).clone()
    if segments is not None:
        cumulative, _ = segments
        document = torch.zeros(batch * length, dtype=torch.long)
        document[cumulative[1:-1].long()] = 1
        document = document.cumsum(0).view(batch, length)
        visible &= document[:, :, None] == document[:, None, :]
    logits = logits.masked_fill(~visible[:, None], -math.inf)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return weights @ v.double()


def documents(draw, batch, length):
    """Per-row document ids: runs of random lengths and ids, sometimes an id that comes back."""
    rows = []
    for _ in range(batch):
        ids, current = [], draw(st.integers(-3, 3))
        while len(ids) < length:
            ids += [current] * draw(st.integers(1, max(1, length // 2)))
            current += draw(st.sampled_from([1, 2, 7, -1]))
        rows.append(ids[:length])
    return torch.tensor(rows)


@st.composite
def native_cases(draw):
    atoms = draw(st.lists(st.sampled_from(ATOMS), min_size=1, max_size=3))
    text = " & ".join(a.format(n=draw(st.integers(0, 9))) for a in atoms)
    text += draw(st.sampled_from(SCORES))
    batch, heads, length = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(
        st.integers(1, 24))
    return text, batch, heads, length, documents(draw, batch, length)


@given(native_cases(), st.integers(0, 2**16))
@settings(max_examples=150, deadline=None)
def test_the_native_form_computes_what_the_reference_does(case, seed):
    text, batch, heads, length, ids = case
    attn = flexspec.compile(text, library=LIBRARY)
    form = native_form(attn.ir)
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, 8, generator=generator, dtype=torch.float64)
               for _ in range(3))
    bindings = {"doc_ids": ids} if "doc" in text else {}
    if form is None:  # only a window that hides the diagonal (q - kv < 0) is outside the form
        assert "left_open(0)" in text, text
        return
    assert (form.documents is not None) == ("doc" in text)
    segments = document_segments(ids) if form.documents is not None else None
    if form.documents is not None and segments is None:
        return  # runs elsewhere (see test_ids_that_come_back_are_not_segments)
    expected = attn.reference(q, k, v, **bindings)
    got = emulated_fa4(form, q, k, v, segments, 1 / math.sqrt(8))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, msg=text)


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_segments_are_the_runs_of_ids(data):
    batch, length = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 40))
    ids = documents(data.draw, batch, length)
    segments = document_segments(ids)
    rows = ids.tolist()
    runs = [[row[i] for i in range(len(row)) if i == 0 or row[i] != row[i - 1]] for row in rows]
    if any(len(set(r)) != len(r) for r in runs):
        assert segments is None
        return
    cumulative, longest = segments
    assert cumulative.dtype == torch.int32
    expected, lengths = [0], []
    for row_number, row in enumerate(rows):
        start = 0
        for i in range(1, length + 1):
            if i == length or row[i] != row[i - 1]:
                expected.append(row_number * length + i)
                lengths.append(i - start)
                start = i
    assert cumulative.tolist() == expected
    assert longest == max(lengths)


def test_ids_that_come_back_are_not_segments():
    assert document_segments(torch.tensor([[0, 0, 1, 1, 0]])) is None
    # another row may reuse the ids: only a repeat within a row counts
    assert document_segments(torch.tensor([[0, 1], [0, 1]])) is not None


def _plan_on_a_gpu_that_is_not_there(text, **facts):
    """A real CPU plan of ``text`` whose request says it runs on an H200 with FA4, chosen for
    that request (the choice of a fallback reads only the request and the choice)."""
    import dataclasses
    from flexspec.runtime.backends import REGISTRY, choose
    from flexspec.runtime.fa4 import INSTALLED
    attn = flexspec.compile(text)
    q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
    ids = torch.arange(256) // 100
    plan = attn._calls.plan(q, k, v, None, {"doc_ids": ids}, None)
    request = dataclasses.replace(plan.request, device_type="cuda", capability=(9, 0),
                                  facts=((INSTALLED, True),), dtype=torch.bfloat16, batch=4,
                                  heads=16, q_len=8192, kv_len=8192, **facts)
    choice = choose("auto", request, plan.spec)
    values = plan.values({"doc_ids": ids})
    return (dataclasses.replace(plan, request=request, choice=choice,
                                backend=REGISTRY[choice.backend]), values, attn._calls.masks)


def test_ids_that_are_not_runs_go_where_auto_would_send_them_without_fa4():
    from flexspec.runtime import plan as planning
    from flexspec.runtime.backends import native
    plan, values, masks = _plan_on_a_gpu_that_is_not_there("causal & doc")
    assert plan.choice.backend == "fa4"
    assert [name for name, _ in plan.choice.viable] == ["flash", "flex"]
    fallback = planning._fallback(plan, values, masks, native.HANDS_BACK)
    assert fallback.choice.backend == "flash" and fallback.backend.name == "flash"
    assert "not contiguous runs" in fallback.choice.reason
    assert fallback.state is not None and fallback.state is not plan.state
    assert [name for name, _ in fallback.choice.viable] == ["flex"]
    # its block masks carry FLASH's form of the mask (FLASH compiles it in partial tiles)
    assert fallback.masks.key == masks.key(plan.spec, plan.sizes, plan.device, "cute")
    assert plan.masks.key.dialect == "torch"
    # training with blocks Triton's backward cannot tile: nothing else can run it, said in words
    plan, values, masks = _plan_on_a_gpu_that_is_not_there("causal & doc", grads=True,
                                                             block_size=(64, 64))
    error = planning._fallback(plan, values, masks, native.HANDS_BACK)
    assert isinstance(error, flexspec.BackendError)
    assert "no other backend can run this call (flash: FLASH needs block sizes" in str(error)


def test_a_fallback_plan_is_warmed_outside_a_capture_only(monkeypatch):
    """A capture after a warm-up hands documents to the fallback: what its first call would
    build (its block mask, whose program compiles) is built when it is planned."""
    from flexspec.runtime import plan as planning
    from flexspec.runtime.backends import REGISTRY, native
    warmed = []
    monkeypatch.setattr(REGISTRY["flash"], "warm", lambda plan, values: warmed.append(plan))
    plan, values, masks = _plan_on_a_gpu_that_is_not_there("causal & doc")
    fallback = planning._fallback(plan, values, masks, native.HANDS_BACK)
    assert warmed == [fallback]
    monkeypatch.setattr(planning, "capturing", lambda device: True)
    planning._fallback(plan, values, masks, native.HANDS_BACK)
    assert len(warmed) == 1


def test_warming_builds_the_block_mask_of_bindings_and_skips_one_too_large():
    import dataclasses
    from types import SimpleNamespace
    from flexspec.runtime.backends import REGISTRY
    attn = flexspec.compile("causal & doc")
    q = torch.randn(1, 2, 150, 16)
    ids = torch.arange(150) // 30
    plan = attn._calls.plan(q, q, q, None, {"doc_ids": ids}, None)
    values = plan.values({"doc_ids": ids})
    assert plan.backend.name == "flex" and plan.state.mask_bindings == ("doc_ids",)
    built = []
    stub = SimpleNamespace(get=lambda values, device: built.append((values, device)))

    def with_masks(plan, masks):  # the block masks the plan's kernel reads (FlexCall.masks)
        return dataclasses.replace(plan, state=dataclasses.replace(plan.state, masks=masks))
    REGISTRY["flex"].warm(with_masks(plan, stub), values)
    assert built == [(values, q.device)]

    def too_large(values, device):
        raise flexspec.BindingError("the block mask would take too much memory")
    REGISTRY["flex"].warm(with_masks(plan, SimpleNamespace(get=too_large)), values)
    # a plan whose mask reads no binding built its block mask when it was prepared
    plain = flexspec.compile("causal & window(4)")._calls.plan(q, q, q, None, {}, None)
    REGISTRY["flex"].warm(with_masks(plain, stub), {})
    assert len(built) == 1


def test_documents_beyond_int32_positions_run_elsewhere():
    import dataclasses
    from flexspec.runtime.backends import REGISTRY
    plan, _, _ = _plan_on_a_gpu_that_is_not_there("causal & doc")
    fa4 = REGISTRY["fa4"]
    assert fa4.why_not(plan.request, plan.spec) is None
    huge = dataclasses.replace(plan.request, batch=2**18, q_len=2**13, kv_len=2**13)
    assert "int32" in fa4.why_not(huge, plan.spec)
    assert fa4.why_not(huge, flexspec.parse("causal").ir) is None  # no lengths to write


# ---- the backend's call path, with FA4's interface emulated on the CPU ---------------------------


def _emulated_attention(q, k, v, softmax_scale, causal, window_size, softcap):
    """One sequence as FA4 defines it: q (S, H, D), k and v (S, Hkv, D); float64, dense.
    Returns the output (S, H, D) and the log-sum-exp of the scores (H, S), float32 as FA4's."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * softmax_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    rows = torch.arange(q.shape[0]).view(-1, 1)
    cols = torch.arange(k.shape[0]).view(1, -1)
    left, right = (None, 0) if causal else window_size
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if left is not None:
        visible &= cols >= rows - left
    if right is not None:
        visible &= cols <= rows + right
    logits = logits.masked_fill(~visible, -math.inf)
    weights = torch.softmax(logits, -1).nan_to_num(0.0)
    return (torch.einsum("hqk,khd->qhd", weights, v.double()).to(q.dtype),
            torch.logsumexp(logits, -1).float())


@pytest.fixture
def fa4_interface(monkeypatch):
    """``flash_attn.cute`` with its two entry points emulated (what they are called with is
    recorded), so that the backend's own code (layouts, cumulative lengths) runs here."""
    import sys
    import types
    calls = []

    def flash_attn_func(q, k, v, *, softmax_scale, causal, window_size, softcap,
                        return_lse=False):
        calls.append(("dense", q.shape))
        rows = [_emulated_attention(q[b], k[b], v[b], softmax_scale, causal, window_size,
                                    softcap) for b in range(q.shape[0])]
        # FA4 returns the lse whenever it computed one: with return_lse or gradients
        return (torch.stack([out for out, _ in rows]),
                torch.stack([lse for _, lse in rows]) if return_lse else None)

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal, window_size, softcap,
                               return_lse=False):
        calls.append(("varlen", cu_seqlens_q.tolist(), max_seqlen_q))
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
        bounds = cu_seqlens_q.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(bounds, bounds[1:]))
        rows = [_emulated_attention(q[a:b], k[a:b], v[a:b], softmax_scale, causal, window_size,
                                    softcap) for a, b in zip(bounds, bounds[1:])]
        return (torch.cat([out for out, _ in rows]),
                torch.cat([lse for _, lse in rows], 1) if return_lse else None)

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


def _run_on_fa4(attn, q, k, v, bindings, return_lse=False, fallback=None, scale=None):
    """One CPU call through the fa4 backend's own ``run``, as the runtime makes it
    (:func:`flexspec.runtime.plan.run`): the call's plan, handed to fa4 with what its
    ``prepare`` keeps on a GPU and ``fallback`` as the plan calls handed back run on. Returns
    the output, the plan and its values."""
    import dataclasses
    from flexspec.runtime import plan as planning
    from flexspec.runtime.backends import REGISTRY
    plan = attn._calls.plan(q, k, v, scale, bindings, None, return_lse=return_lse)
    prepared = REGISTRY["fa4"].prepare(plan, plan.values(bindings))
    plan = dataclasses.replace(plan, backend=REGISTRY["fa4"], state=prepared.state,
                               needs_values=prepared.needs_values, fallback=fallback)
    return planning.run(plan, q, k, v, scale, bindings), plan, plan.values(bindings)


@pytest.mark.parametrize("text", ["causal & doc", "window(7) & doc + softcap(2.0)",
                                  "sliding_window(5) + scale(0.5)", "full"])
def test_the_call_path_lays_out_inputs_and_documents_as_fa4_reads_them(text, fa4_interface):
    """q, k, v as (B, H, S, D) views of (B, S, H, D) tensors, GQA, ids per batch row: the
    backend's output equals the float64 reference."""
    attn = flexspec.compile(text)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 150, 4, 16, generator=generator).transpose(1, 2)
    k, v = (torch.randn(2, 150, 2, 16, generator=generator).transpose(1, 2) for _ in range(2))
    ids = torch.stack([torch.arange(150) // 40, torch.arange(150) // 70 + 3])
    bindings = {"doc_ids": ids} if "doc" in text else {}
    out, _, _ = _run_on_fa4(attn, q, k, v, bindings)  # contiguous ids: no fallback kept
    expected = attn.reference(q.double(), k.double(), v.double(), **bindings)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    if "doc" in text:
        assert fa4_interface == [("varlen", [0, 40, 80, 120, 150, 220, 290, 300], 70)]
    else:
        assert fa4_interface == [("dense", (2, 150, 4, 16))]


@pytest.mark.parametrize("text", ["causal & doc", "sliding_window(5) + scale(0.5)"])
def test_the_log_sum_exp_comes_back_in_the_layout_of_the_reference(text, fa4_interface):
    """FA4's lse is (B, H, S) for the dense call and (H, B * S) for the variable-length one:
    both come back as (B, H, S), equal to the reference's."""
    attn = flexspec.compile(text)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 130, 3, 8, generator=generator).transpose(1, 2) for _ in range(3))
    ids = torch.stack([torch.arange(130) // 50, torch.arange(130) // 20])
    bindings = {"doc_ids": ids} if "doc" in text else {}
    (out, lse), _, _ = _run_on_fa4(attn, q, k, v, bindings, return_lse=True)
    expected, expected_lse = attn.reference(q.double(), k.double(), v.double(), return_lse=True,
                                            **bindings)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    assert lse.shape == (2, 3, 130)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


def _handed_to_the_fallback(ids):
    """Runs ``causal & doc`` on the fa4 backend with a stand-in fallback plan; returns the
    output, the fallback and what was handed to it, the plan and its values."""
    from types import SimpleNamespace
    attn = flexspec.compile("causal & doc")
    q = k = v = torch.randn(1, 2, 150, 16)
    handed = []
    fallback = SimpleNamespace(needs_values=False, lookups=None, backend=SimpleNamespace(
        run=lambda plan, *args: handed.append(plan) or "fallback's output"))
    out, plan, values = _run_on_fa4(attn, q, k, v, {"doc_ids": ids}, fallback=fallback)
    return out, fallback, handed, (plan, q, values)


def test_ids_that_are_not_runs_are_handed_to_the_fallback_plan(fa4_interface):
    import dataclasses
    from flexspec.runtime import plan as planning
    ids = (torch.arange(150) // 30) % 2  # document 0 comes back
    out, fallback, handed, (plan, q, values) = _handed_to_the_fallback(ids)
    assert out == "fallback's output" and handed == [fallback] and fa4_interface == []
    plan = dataclasses.replace(plan, fallback=flexspec.BackendError("nothing else"))
    with pytest.raises(flexspec.BackendError, match="nothing else"):
        planning.run(plan, q, q, q, None, {"doc_ids": ids})
    # contiguous ids stay on fa4
    out, _, handed, _ = _handed_to_the_fallback(torch.arange(150) // 30)
    assert handed == [] and [call[0] for call in fa4_interface] == ["varlen"]


def test_inside_a_cuda_graph_capture_documents_are_handed_to_the_fallback_plan(fa4_interface,
                                                                               monkeypatch):
    """Cumulative lengths need a host read, which a capture cannot make: contiguous ids too go
    to the fallback (a block-mask backend, whose mask is built inside the graph)."""
    from flexspec.runtime.backends import native
    monkeypatch.setattr(native, "capturing", lambda device: True)
    out, fallback, handed, _ = _handed_to_the_fallback(torch.arange(150) // 30)
    assert out == "fallback's output" and handed == [fallback] and fa4_interface == []


def test_a_step_finds_its_documents_once_for_every_layer(fa4_interface, monkeypatch):
    """Issue 26: the ids were turned into boundaries with a host read on every call, so a
    32-layer model paid it 32 times a step. With a step: once; with boundaries given
    (cu_seqlens, max_seqlen): never, and FA4 gets them as they are."""
    import dataclasses
    from flexspec.runtime import plan as planning
    from flexspec.runtime.backends import REGISTRY, native
    looked = []
    real = native.document_segments
    monkeypatch.setattr(native, "document_segments",
                        lambda ids: looked.append(1) or real(ids))
    attn = flexspec.compile("causal & doc")
    generator = torch.Generator().manual_seed(3)
    ids = torch.tensor([[0] * 60 + [1] * 90, [2] * 150])

    def layer(step, bindings):
        q, k, v = (torch.randn(2, 2, 150, 16, generator=generator) for _ in range(3))
        placed = {**bindings, **step.bindings_for(2, 150)}
        plan = attn._calls.plan(q, k, v, None, placed, None)
        prepared = REGISTRY["fa4"].prepare(plan, plan.values(placed))
        plan = dataclasses.replace(plan, backend=REGISTRY["fa4"], state=prepared.state,
                                   needs_values=True)
        out = planning.run(plan, q, k, v, None, placed, step)
        torch.testing.assert_close(out.double(), attn.reference(
            q.double(), k.double(), v.double(), doc_ids=placed["doc_ids"]), rtol=1e-4, atol=1e-5)

    step = flexspec.Step(doc_ids=ids)
    for _ in range(3):
        layer(step, {})
    assert len(looked) == 1 and [call[0] for call in fa4_interface] == ["varlen"] * 3
    looked.clear()
    fa4_interface.clear()
    bounds = flexspec.Step(cu_seqlens=torch.tensor([0, 60, 150, 300]), max_seqlen=150)
    for _ in range(3):
        layer(bounds, {})
    assert looked == [] and fa4_interface == [("varlen", [0, 60, 150, 300], 150)] * 3


# ---- mutation testing of runtime/backends/native -------------------------------------------------


def _h200(**changes):
    """The facts of a call on an H200 with FA4 installed (bfloat16, D = 64)."""
    import dataclasses
    from flexspec.runtime.backends import Request
    from flexspec.runtime.fa4 import INSTALLED
    request = Request(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=4,
                      heads=16, kv_heads=16, q_len=8192, kv_len=8192, head_dim=64,
                      v_head_dim=64, grads=False, table_grads=False, facts=((INSTALLED, True),))
    return dataclasses.replace(request, **changes)


def _whole(message):
    import re
    return "^" + re.escape(message) + "$"


def test_the_fa4_backend_says_why_it_cannot_run_a_spec_or_a_call_in_full():
    from flexspec import ir
    from flexspec.runtime.backends import REGISTRY
    fa4 = REGISTRY["fa4"]
    chunked = flexspec.parse("causal & chunked(8) + alibi").ir
    message = ("FA4's own kernels run full or causal attention, sliding windows and documents "
               "(`doc_ids[b, q] == doc_ids[b, kv]`), times a constant and soft-capped; this spec "
               f"has mask `{ir.to_text(chunked.mask)}` and score `{ir.to_text(chunked.score)}`")
    assert fa4.cannot_run(chunked) == message
    assert fa4.why_not(_h200(), chunked) == message
    for text in ("causal", "full", "sliding_window(5) & doc + softcap(2.0)"):
        assert fa4.cannot_run(flexspec.parse(text).ir) is None, text
    with pytest.raises(flexspec.BackendError, match=_whole(
            "backend 'fa4' cannot run 'causal & chunked(8) + alibi': " + message +
            ". backend='auto' chooses one that can")):
        flexspec.compile("causal & chunked(8) + alibi", backend="fa4")
    causal = flexspec.parse("causal").ir
    assert fa4.why_not(_h200(device_type="cpu", capability=None), causal) == \
        "FA4's own interface runs on CUDA GPUs only, not on cpu"
    documents = flexspec.parse("causal & doc").ir
    assert fa4.why_not(_h200(batch=2**18, q_len=2**13, kv_len=2**13), documents) == (
        "FA4's cumulative sequence lengths are int32: 262144 rows of 8192 positions "
        "(2,147,483,648) do not fit")
    assert fa4.why_not(_h200(q_len=100, kv_len=200), causal) == (
        "FA4 aligns causal masks and windows at the bottom right, flexspec at the top left: "
        "they agree only when Q_LEN == KV_LEN, got 100 and 200")


def test_auto_passes_over_fa4_for_small_problems_and_its_softcap_saying_why_in_full():
    from flexspec.runtime.backends import REGISTRY
    fa4 = REGISTRY["fa4"]
    causal = flexspec.parse("causal").ir
    # 1 x 1 x 128 x 128 x 2 x (64 + 64) = 4,194,304 FLOPs: 0.00419 GFLOP
    small = _h200(batch=1, heads=1, kv_heads=1, q_len=128, kv_len=128)
    assert fa4.auto_veto(small, causal) == (
        "the problem is small (0.00419 GFLOP dense < 200): FA4's own interface's fixed cost "
        "per call outweighs its speed (docs/performance.md, FLASH's small-problem veto)")
    assert fa4.auto_veto(_h200(), flexspec.parse("causal + softcap(30.0)").ir) == (
        "FA4's own softcap ran slower than FlexAttention's FLASH kernel (docs/performance.md, "
        "the order auto tries)")
    assert fa4.auto_veto(_h200(), causal) is None


def test_only_documents_make_the_fa4_backend_read_values_and_hand_calls_back():
    from flexspec.runtime.backends import REGISTRY, native
    plan, values, _ = _plan_on_a_gpu_that_is_not_there("causal & doc")
    prepared = REGISTRY["fa4"].prepare(plan, values)
    assert prepared.needs_values and prepared.hands_back == native.HANDS_BACK
    assert prepared.state == native_form(plan.spec)
    q = torch.randn(1, 2, 130, 8)
    plan = flexspec.compile("causal & window(8)")._calls.plan(q, q, q, None, {}, None)
    prepared = REGISTRY["fa4"].prepare(plan, {})
    assert not prepared.needs_values and prepared.hands_back is None
    assert prepared.state == native_form(plan.spec)


def test_a_call_s_scale_reaches_fa4(fa4_interface):
    attn = flexspec.compile("sliding_window(5) + scale(0.5)")
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 130, 8, generator=generator) for _ in range(3))
    out, _, _ = _run_on_fa4(attn, q, k, v, {}, scale=0.3)
    torch.testing.assert_close(out.double(), attn.reference(
        q.double(), k.double(), v.double(), scale=0.3), rtol=1e-4, atol=1e-5)
    default, _, _ = _run_on_fa4(attn, q, k, v, {})
    assert not torch.allclose(out, default)


def test_a_call_without_gradients_runs_fa4_on_detached_inputs(fa4_interface):
    attn = flexspec.compile("causal & doc")
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 130, 8, generator=generator, requires_grad=True)
               for _ in range(3))
    ids = torch.arange(130) // 50
    with torch.no_grad():
        out, plan, _ = _run_on_fa4(attn, q, k, v, {"doc_ids": ids})
        expected = attn.reference(q.double(), k.double(), v.double(), doc_ids=ids)
    assert plan.detach and not out.requires_grad
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_a_call_handed_back_says_why(fa4_interface, monkeypatch):
    """A call fa4 hands back with no fallback kept is a bug to report, with fa4's reason."""
    from flexspec.runtime.backends import native
    attn = flexspec.compile("causal & doc")
    q = torch.randn(1, 2, 150, 16)
    ids = (torch.arange(150) // 30) % 2  # document 0 comes back
    with pytest.raises(flexspec.BackendError, match=_whole(
            "backend 'fa4' handed back a call it said it would run (document ids that are not "
            "contiguous runs); please report it")):
        _run_on_fa4(attn, q, q, q, {"doc_ids": ids})
    monkeypatch.setattr(native, "capturing", lambda device: True)
    with pytest.raises(flexspec.BackendError, match=_whole(
            "backend 'fa4' handed back a call it said it would run (documents inside a CUDA "
            "graph capture (their lengths need a host read)); please report it")):
        _run_on_fa4(attn, q, q, q, {"doc_ids": torch.arange(150) // 30})


def test_a_step_keeps_the_segments_of_each_ids_tensor_apart(fa4_interface):
    """Layers of one step given different document ids by name each get their own segments
    (the step keeps them by the ids tensor, its batch and its length)."""
    import dataclasses
    from flexspec.runtime import plan as planning
    from flexspec.runtime.backends import REGISTRY
    attn = flexspec.compile("causal & doc")
    generator = torch.Generator().manual_seed(6)
    step = flexspec.Step()
    first = torch.tensor([[0] * 60 + [1] * 90, [2] * 150])
    second = torch.tensor([[0] * 100 + [1] * 50, [3] * 20 + [4] * 130])
    for ids in (first, second, first):
        q, k, v = (torch.randn(2, 2, 150, 16, generator=generator) for _ in range(3))
        bindings = {"doc_ids": ids}
        plan = attn._calls.plan(q, k, v, None, bindings, None)
        prepared = REGISTRY["fa4"].prepare(plan, plan.values(bindings))
        plan = dataclasses.replace(plan, backend=REGISTRY["fa4"], state=prepared.state,
                                   needs_values=True)
        out = planning.run(plan, q, k, v, None, bindings, step)
        torch.testing.assert_close(out.double(), attn.reference(
            q.double(), k.double(), v.double(), doc_ids=ids), rtol=1e-4, atol=1e-5)
    assert [call[1] for call in fa4_interface] == \
        [[0, 60, 150, 300], [0, 100, 150, 170, 300], [0, 60, 150, 300]]


def test_a_step_keeps_the_segments_of_each_ids_tensor_by_its_identity(monkeypatch):
    """The native backend's documents per step: made once for views of the same unchanged ids
    (each call gathers a fresh view), apart for other ids, and anew after an in-place change;
    the ids are kept alive with them, so no later tensor can take their place."""
    from flexspec.runtime.backends import native
    made = []
    real = native.document_segments
    monkeypatch.setattr(native, "document_segments",
                        lambda ids: made.append(ids.clone()) or real(ids))
    step = flexspec.Step()
    first = torch.tensor([[0, 0, 1, 1, 1, 2]])
    other = torch.tensor([[0, 1, 1, 1, 1, 1]])
    a = native._step_segments(step, first.view(1, 6), 1, 6)
    assert native._step_segments(step, first.view(1, 6), 1, 6) is a and len(made) == 1
    b = native._step_segments(step, other, 1, 6)
    assert b[0].tolist() == [0, 1, 6] and a[0].tolist() == [0, 2, 5, 6] and len(made) == 2
    first[0, 5] = 1  # in place: a new version
    assert native._step_segments(step, first, 1, 6)[0].tolist() == [0, 2, 6]
    assert native._step_segments(step, torch.tensor([[0, 1, 0, 0, 0, 0]]), 1, 6) \
        == native.NOT_RUNS
