"""runtime.plan: what a call decides once per input signature (the Request the backend choice
reads, the tensors passed by name, the checks of sizes, scale, dtypes and integer ranges), the
signature plans are cached under, and the per-call steps a plan keeps cheap (its values, the
lookups it checks only when their tensors change).

Plans are made with :func:`make_plan` directly; the facts it records are compared with values
worked out by hand. No kernel runs here (the backend runs are tested in test_backends.py).
"""

import re

import pytest
import torch

import flexspec
from flexspec import BindingError, SpecError, ir, limits
from flexspec.lang.library import load_text
from flexspec.runtime import plan as planning
from flexspec.ir.forms import sdpa_form
from flexspec.runtime import lookups
from flexspec.runtime.bindings import Tensors
from flexspec.kernels.reference import reference_attention
from flexspec.runtime.contract import (Backend, BackendError, Prepared, Replan, Request,
                                       Slot)
from flexspec.runtime.fa4 import INSTALLED
from flexspec.runtime.masks import MaskCache
from flexspec.runtime.plan import PlanCache, call_key, check_ranges, make_mask_plan, make_plan
from flexspec.testing import Shape

LIBRARY = load_text(f"""
score first(t: float[4]) = score + t[0]
score biased(t: float[KV_LEN]) = score + t[kv]
mask same_group(group: int[KV_LEN]) = group[group[q]] == group[kv]
mask big32 = q * {(2**31 - 1) // 7} >= kv
mask big64 = q * {2**61} >= kv
mask even_heads = h % 2 == 0 | q >= kv
""")


def plan_for(text, q, k, v, *, asked="auto", scale=None, learnables=None, return_lse=False,
             block_size=(16, 32), written=None, **bindings):
    spec = flexspec.parse(text, library=LIBRARY)
    masks = MaskCache("exact", block_size)
    return make_plan(text=text, asked=asked, tensors=Tensors(spec.ir), masks=masks,
                     block_size=block_size, q=q, k=k, v=v, scale=scale, bindings=bindings,
                     learnables=learnables, return_lse=return_lse, written=written)


def key_of(text, name):
    spec = flexspec.parse(text, library=LIBRARY).ir
    return next(ir.tensor_key(t) for t in spec.tensors() if t.name == name)


def qkv(B=2, Hq=4, Hkv=2, Q_LEN=24, KV_LEN=40, D=8, Dv=12, dtype=torch.float32):
    q, k, _ = Shape(B, Hq, Hkv, Q_LEN, KV_LEN, D).qkv(seed=0, dtype=dtype)
    v = torch.randn(B, Hkv, KV_LEN, Dv, dtype=dtype)
    return q, k, v


# --- the request -------------------------------------------------------------------------------


def test_the_request_holds_the_facts_of_the_call():
    q, k, v = qkv()
    plan = plan_for("causal + first", q, k, v, asked="reference", scale=0.5, return_lse=True,
                    t=torch.arange(4.0))
    assert plan.request == Request(
        device_type="cpu", capability=None, dtype=torch.float32, batch=2, heads=4, kv_heads=2,
        q_len=24, kv_len=40, head_dim=8, v_head_dim=12, grads=False, table_grads=False,
        score_tensors=True, block_size=(16, 32), reference_fits=True, lse=True, scale=0.5,
        facts=((INSTALLED, False),), failed=())
    assert (plan.sizes, plan.device, plan.text, plan.asked, plan.scale) == (
        {"B": 2, "H": 4, "Q_LEN": 24, "KV_LEN": 40}, torch.device("cpu"), "causal + first",
        "reference", 0.5)
    assert plan.gqa  # 4 query heads share 2 key/value heads
    assert not plan_for("causal", *qkv(Hkv=4)).gqa


def test_the_score_reads_tensors_when_it_reads_a_table_or_a_scale_is_given():
    q, k, v = qkv()
    assert not plan_for("causal", q, k, v).request.score_tensors
    assert plan_for("causal", q, k, v, scale=0.5).request.score_tensors
    assert plan_for("causal + alibi", q, k, v).request.score_tensors
    # the mask's tensors are not the score's
    assert not plan_for("causal & document", q, k, v,
                        doc_ids=torch.zeros(40, dtype=torch.int64)).request.score_tensors


def test_the_request_says_whether_the_dense_reference_fits(monkeypatch):
    q, k, v = qkv()  # B x Hq x Q_LEN x KV_LEN float64 scores
    monkeypatch.setattr(limits, "MAX_DENSE_ARRAY_BYTES", 2 * 4 * 24 * 40 * 8)
    assert plan_for("full", q, k, v).request.reference_fits
    monkeypatch.setattr(limits, "MAX_DENSE_ARRAY_BYTES", 2 * 4 * 24 * 40 * 8 - 1)
    assert not plan_for("full", q, k, v).request.reference_fits  # SDPA runs it


@pytest.mark.parametrize("which", [0, 1, 2])
def test_any_of_q_k_v_requiring_gradients_asks_for_gradients(which):
    tensors = list(qkv())
    tensors[which].requires_grad_()
    request = plan_for("causal", *tensors, asked="reference").request
    assert request.grads and not request.table_grads
    with torch.no_grad():
        plan = plan_for("causal", *tensors, asked="reference")
    assert not plan.request.grads and plan.detach
    assert not plan_for("causal", *qkv(), asked="reference").request.grads


def test_a_score_table_requiring_gradients_asks_for_table_gradients():
    q, k, v = qkv()
    table = torch.zeros(40, requires_grad=True)
    plan = plan_for("causal + biased", q, k, v, asked="reference", t=table)
    assert plan.request.grads and plan.request.table_grads and not plan.detach
    assert plan.values({"t": table})[key_of("causal + biased", "t")].requires_grad
    with torch.no_grad():
        plan = plan_for("causal + biased", q, k, v, asked="reference", t=table)
    assert not plan.request.grads and not plan.request.table_grads and plan.detach
    # under no_grad, the values handed to the backend are detached
    assert not plan.values({"t": table})[key_of("causal + biased", "t")].requires_grad
    plan = plan_for("causal + biased", q, k, v, asked="reference", t=torch.zeros(40))
    assert not plan.request.table_grads and not plan.request.grads


# --- the choice and the checks -----------------------------------------------------------------


def test_float64_runs_only_where_the_reference_was_asked_for(monkeypatch):
    q, k, v = qkv(dtype=torch.float64)
    with pytest.raises(BindingError, match="torch.float64, which only the reference backend"):
        plan_for("causal", q, k, v)
    plan = plan_for("causal", q, k, v, asked="reference")
    assert (plan.choice.backend, plan.choice.reason) == ("reference",
                                                         "backend='reference' was asked for")
    assert plan.backend.name == "reference"
    # beyond its memory budget the reference runs nothing, in float64 or not
    monkeypatch.setattr(limits, "MAX_DENSE_ARRAY_BYTES", 8)
    for inputs in ((q, k, v), qkv()):
        with pytest.raises(flexspec.BackendError, match="memory budget"):
            plan_for("causal", *inputs, asked="reference")


def test_the_choice_is_the_backend_rules_choice():
    q, k, v = qkv(Q_LEN=128, KV_LEN=128, Dv=8)
    plan = plan_for("causal", q, k, v)
    assert plan.choice.backend == "sdpa" and plan.backend.name == "sdpa"
    assert plan.state == sdpa_form(plan.spec)  # prepared by the backend chosen
    plan = plan_for("causal & window(3)", q, k, v)
    assert plan.choice.backend == "flex" and plan.backend.name == "flex"
    assert plan.state.block_mask is not None
    # the backend prepares with the call's values: the slopes the score reads
    plan = plan_for("causal & window(3) + alibi", q, k, v)
    assert plan.choice.backend == "flex" and not plan.state.score_varies
    # ALiBi's slope of head 1 of 4 is 2 ** -4; query 5 is 3 positions after key 2
    score = plan.state.score_mod(torch.tensor(1.5), torch.tensor(0), torch.tensor(1),
                                    torch.tensor(5), torch.tensor(2))
    assert score.item() == 1.5 - 2 ** -4 * 3


def test_a_plan_made_without_the_optional_arguments_asks_for_no_lse():
    spec = flexspec.parse("causal")
    q, k, v = qkv()
    plan = make_plan(text="causal", asked="auto", tensors=Tensors(spec.ir),
                     masks=MaskCache("exact", (16, 32)), block_size=(16, 32), q=q, k=k, v=v,
                     scale=None, bindings={}, learnables=None)
    assert not plan.request.lse


@pytest.mark.parametrize("return_lse", [1, None, "yes"])
def test_return_lse_must_be_a_bool(return_lse):
    with pytest.raises(BindingError, match=f"^return_lse must be True or False, got "
                                           f"{return_lse!r}$"):
        plan_for("causal", *qkv(), return_lse=return_lse)


def test_the_scale_is_checked():
    with pytest.raises(BindingError, match="scale must be a finite number or None"):
        plan_for("causal", *qkv(), scale=float("inf"))


def test_integer_ranges_are_checked_over_every_position_a_plan_serves():
    # q * 306783378 fits int32 up to q = 7; queries may stand anywhere up to max(Q_LEN, KV_LEN)
    spec = flexspec.parse("big32", library=LIBRARY).ir
    check_ranges(spec, {"B": 1, "H": 1, "Q_LEN": 4, "KV_LEN": 8}, "int32")
    check_ranges(spec, {"B": 1, "H": 1, "Q_LEN": 8, "KV_LEN": 4}, "int32")
    check_ranges(spec, {"B": 1, "H": 1, "Q_LEN": 9, "KV_LEN": 9}, "int64")
    for q_len, kv_len in ((4, 9), (9, 4)):
        with pytest.raises(SpecError, match=f"reaches 0..2454267024 for Q_LEN={q_len}, "
                                            f"KV_LEN={kv_len} on a GPU, beyond the 32-bit"):
            check_ranges(spec, {"B": 1, "H": 1, "Q_LEN": q_len, "KV_LEN": kv_len}, "int32")
    with pytest.raises(SpecError, match=r"for Q_LEN=9, KV_LEN=9, beyond the 64-bit"):
        check_ranges(flexspec.parse("big64", library=LIBRARY).ir,
                     {"B": 1, "H": 1, "Q_LEN": 9, "KV_LEN": 9}, "int64")


def test_a_plan_checks_the_ranges_of_the_spec_as_written():
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Q_LEN=9, KV_LEN=9)
    with pytest.raises(SpecError, match="for Q_LEN=9, KV_LEN=9, beyond the 64-bit"):
        plan_for("big64", q, k, v)
    written = flexspec.parse("big64", library=LIBRARY).ir
    with pytest.raises(SpecError, match="for Q_LEN=9, KV_LEN=9, beyond the 64-bit"):
        plan_for("causal", q, k, v, written=written)
    plan_for("causal", q, k, v, written=flexspec.parse("causal").ir)


# --- tensors passed by name --------------------------------------------------------------------


def test_bindings_are_slots_and_everything_else_is_fixed():
    text = "causal & document + alibi + biased"
    q, k, v = qkv()
    plan = plan_for(text, q, k, v, doc_ids=torch.zeros(40, dtype=torch.int64),
                    t=torch.zeros(40))
    doc, t, slopes = (key_of(text, name) for name in ("doc_ids", "t", "alibi_slopes"))
    assert plan.slots == (Slot("doc_ids", doc, 2), Slot("t", t, 1))
    assert set(plan.fixed) == {slopes}
    assert plan.score_keys == frozenset({t, slopes})
    assert plan.masks.key == plan.masks.key.__class__(plan.masks.key.token, 1, 1, (doc,))


def test_a_plan_with_its_prepared_state_is_what_dataclasses_replace_makes():
    """_prepared copies the draft plan without re-running its __init__: the same as
    dataclasses.replace while Plan (and InputPlan) have no __post_init__."""
    import dataclasses
    from flexspec.runtime.contract import InputPlan, Plan
    assert not any(hasattr(cls, "__post_init__") for cls in (Plan, InputPlan))
    q, k, v = qkv()
    plan = plan_for("causal & document", q, k, v, doc_ids=torch.zeros(40, dtype=torch.int64))
    changes = {"state": object(), "fallback": None, "needs_values": True}
    made, replaced = planning._with(plan, **changes), dataclasses.replace(plan, **changes)
    assert type(made) is Plan and made is not plan
    assert made.__dict__ == replaced.__dict__
    assert plan.state is not changes["state"]  # the draft is left as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.state = None


def test_the_plan_s_mask_key_is_its_spec_s_on_its_device():
    text = "causal & document"
    q, k, v = qkv(Q_LEN=40)
    spec = flexspec.parse(text)
    masks = MaskCache("exact", (16, 32))
    plan = make_plan(text=text, asked="auto", tensors=Tensors(spec.ir), masks=masks,
                     block_size=(16, 32), q=q, k=k, v=v, scale=None,
                     bindings={"doc_ids": torch.zeros(40, dtype=torch.int64)}, learnables=None)
    assert plan.masks.key == masks.key(plan.spec, plan.sizes, torch.device("cpu"))


def test_the_plan_s_mask_key_is_in_its_backend_s_dialect_of_the_lowering(monkeypatch):
    # FLASH's dialect (cute) cannot be chosen on the CPU: flex is made to take it, as FLASH does
    from flexspec.runtime.backends import REGISTRY
    q, k, v = qkv(Q_LEN=200, KV_LEN=200)
    plain = plan_for("causal", q, k, v, asked="flex")
    monkeypatch.setattr(REGISTRY["flex"], "dialect", "cute")
    flash_like = plan_for("causal", q, k, v, asked="flex")
    assert plain.masks.key.dialect == "torch" and flash_like.masks.key.dialect == "cute"
    assert (flash_like.masks.batch, flash_like.masks.heads) == (plain.masks.batch,
                                                                plain.masks.heads)


def test_a_learnable_table_is_a_slot_only_when_passed_by_name():
    text = "causal + rel_bias(max_distance=2)"
    key = key_of(text, "rel_bias_table")
    q, k, v = qkv(Hq=2, Hkv=2)
    plan = plan_for(text, q, k, v, asked="reference")
    assert plan.slots == () and set(plan.fixed) == {key}
    assert torch.equal(plan.fixed[key], torch.zeros(2, 5))
    table = torch.randn(2, 5)
    plan = plan_for(text, q, k, v, asked="reference", rel_bias_table=table)
    assert plan.slots == (Slot("rel_bias_table", key, 2),) and plan.fixed == {}
    given = torch.randn(2, 5)
    plan = plan_for(text, q, k, v, asked="reference", learnables={key: given})
    assert plan.slots == () and plan.fixed[key] is given


def test_a_call_s_values_are_its_bindings_contiguous_with_their_declared_dimensions():
    text = "causal & document + biased"
    q, k, v = qkv()
    ids = torch.zeros(2, 80, dtype=torch.int64)
    plan = plan_for(text, q, k, v, doc_ids=ids[:, ::2], t=torch.zeros(40))
    table = torch.arange(40.0)
    values = plan.values({"doc_ids": ids[0, ::2], "t": table})
    doc = values[key_of(text, "doc_ids")]
    assert doc.shape == (1, 40) and doc.is_contiguous()
    assert values[key_of(text, "t")] is table
    assert plan.fixed == {}
    # without slots the values are the fixed ones themselves
    plan = plan_for("causal + alibi", q, k, v)
    assert plan.values({}) is plan.fixed and len(plan.fixed) == 1


# --- the mask alone (Attention.block_mask) ------------------------------------------------------


def mask_plan_for(text, sizes, **bindings):
    spec = flexspec.parse(text, library=LIBRARY)
    masks = MaskCache("exact", (16, 32))
    plan = make_mask_plan(tensors=Tensors(spec.ir), masks=masks, sizes=sizes, bindings=bindings,
                          device=torch.device("cpu"))
    return plan, masks


def test_a_mask_plan_holds_the_mask_s_tensors_and_its_key_only():
    text = "causal & document + alibi + biased"
    sizes = {"B": 2, "H": 4, "Q_LEN": 24, "KV_LEN": 40}
    ids = torch.zeros(2, 40, dtype=torch.int64)
    plan, masks = mask_plan_for(text, sizes, doc_ids=ids, t=torch.zeros(40))
    doc = key_of(text, "doc_ids")
    assert plan.slots == (Slot("doc_ids", doc, 2),) and plan.fixed == {}  # no score tensors
    assert plan.spec.score == ir.SCORE and plan.masks.reads == (doc,)
    assert plan.masks.key == masks.key(plan.spec, sizes, torch.device("cpu"))
    assert plan.values({"doc_ids": ids})[doc] is ids
    assert plan.sizes == sizes


def test_a_mask_plan_checks_its_mask_s_ranges_and_remembers_unproven_lookups():
    sizes = {"B": 1, "H": 1, "Q_LEN": 9, "KV_LEN": 9}
    with pytest.raises(SpecError, match="for Q_LEN=9, KV_LEN=9, beyond the 64-bit"):
        mask_plan_for("big64", sizes)
    group = torch.zeros(9, dtype=torch.int64)
    plan, _ = mask_plan_for("same_group", sizes, group=group)
    assert [str(index) for _, _, index in plan.lookups.unproven] == ["group[q]"]
    wild = torch.zeros(9, dtype=torch.int64)
    wild[2] = 9  # group[group[2]] reads past the end
    with pytest.raises(BindingError, match=r"'group' is indexed by group\[q\] .* Q_LEN=9"):
        plan.lookups.check(plan.values({"group": wild}))
    # the values the plan was made with were checked then: they would have been refused
    with pytest.raises(BindingError, match=r"'group' is indexed by group\[q\]"):
        mask_plan_for("same_group", sizes, group=wild)


# --- lookups checked by value ------------------------------------------------------------------


def test_lookups_are_checked_again_only_when_their_tensors_change(monkeypatch):
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Q_LEN=8, KV_LEN=8, Dv=8)
    group = torch.zeros(8, dtype=torch.int64)
    plan = plan_for("same_group", q, k, v, group=group)
    key = key_of("same_group", "group")
    assert [str(index) for _, _, index in plan.lookups.unproven] == ["group[q]"]
    assert plan.needs_values  # the lookups read the call's values
    checks = []
    original = lookups.check_lookups
    monkeypatch.setattr(lookups, "check_lookups",
                        lambda *args: checks.append(args[2].get(key)) or original(*args))
    plan.lookups.check(plan.values({"group": group}))
    assert checks == []  # checked when the plan was made
    other = torch.ones(8, dtype=torch.int64)
    plan.lookups.check(plan.values({"group": other}))
    plan.lookups.check(plan.values({"group": other}))
    assert len(checks) == 1
    other[0] = 9  # in place: checked again, and refused
    with pytest.raises(BindingError, match=r"'group' is indexed by group\[q\]"):
        plan.lookups.check(plan.values({"group": other}))
    assert len(checks) == 2
    # values that take turns (the runs of batch rows of a wide decode call) are checked once
    # each: every check is a host read
    third = torch.zeros(8, dtype=torch.int64)
    for _ in range(3):
        plan.lookups.check(plan.values({"group": group}))
        plan.lookups.check(plan.values({"group": third}))
    assert len(checks) == 3
    # a kernel plan whose score reads no binding gathers values only for such lookups
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Q_LEN=128, KV_LEN=128, Dv=8)
    group = torch.zeros(128, dtype=torch.int64)
    plan = plan_for("same_group", q, k, v, group=group)
    assert plan.choice.backend == "flex" and plan.lookups and plan.needs_values
    plan = plan_for("causal & document", q, k, v, doc_ids=group)
    assert plan.choice.backend == "flex" and not plan.lookups and not plan.needs_values
    # proven lookups are never evaluated
    assert plan.lookups.unproven == ()
    plan.lookups.check({})  # reads no value
    assert not plan.needs_values or plan.backend.name == "reference"


# --- the signature plans are cached under ------------------------------------------------------


def test_the_plan_cache_keeps_the_most_recently_used_plans_up_to_its_size(monkeypatch):
    monkeypatch.setattr(planning, "PLAN_CACHE_SIZE", 2)
    cache = PlanCache()
    first, second, third = object(), object(), object()
    cache.put("a", first)
    cache.put("b", second)
    assert cache.get("a") is first  # "b" is now the least recently used
    cache.put("c", third)
    assert cache.get("b") is None and cache.get("a") is first and cache.get("c") is third
    assert cache.values() == [first, third]
    with pytest.raises(TypeError):
        cache.get(["unhashable"])


def test_the_call_key_is_the_signature_of_the_inputs():
    q, k, v = qkv()
    ids = torch.zeros(40, dtype=torch.int64)
    base = call_key(q, k, v, None, {"doc_ids": ids}, None)
    # another call with equal shapes, dtypes, devices and strides has the same signature
    assert call_key(q.clone(), k.clone(), v.clone(), None, {"doc_ids": ids.clone()}, None) == base
    changed = [
        call_key(q[:1], k, v, None, {"doc_ids": ids}, None),
        call_key(q, k.double(), v, None, {"doc_ids": ids}, None),
        call_key(q, k, v[..., :4], None, {"doc_ids": ids}, None),
        call_key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None, {"doc_ids": ids},
                 None),
        call_key(q.requires_grad_(False).clone().requires_grad_(), k, v, None,
                 {"doc_ids": ids}, None),
        call_key(q, k, v, 0.5, {"doc_ids": ids}, None),
        call_key(q, k, v, None, {"doc_ids": ids}, None, return_lse=True),
        call_key(q, k, v, None, {"ids": ids}, None),
        call_key(q, k, v, None, {"doc_ids": ids[None]}, None),
        call_key(q, k, v, None, {"doc_ids": 3}, None),
        call_key(q, k, v, None, {"doc_ids": ids}, {}),
    ]
    with torch.no_grad():
        changed.append(call_key(q, k, v, None, {"doc_ids": ids}, None))
    assert all(key != base for key in changed)
    assert len(set(changed)) == len(changed)
    # learnable tables by identity: another table is another signature
    table = torch.zeros(2, 5)
    with_table = call_key(q, k, v, None, {}, {"t": table})
    assert call_key(q, k, v, None, {}, {"t": table}) == with_table
    assert call_key(q, k, v, None, {}, {"t": table.clone()}) != with_table
    assert call_key(q, k, v, None, {}, {"t": torch.zeros(2, 6)}) != with_table
    assert call_key(q, k, v, None, {}, {"u": table}) != with_table
    table.requires_grad_()  # the same table, frozen no more: gradients change the plan
    assert call_key(q, k, v, None, {}, {"t": table}) != with_table


def test_a_mask_free_spec_keeps_a_block_mask_off_cuda():
    """flexspec.workarounds: cpu-mask-free-block-mask. The compiled CPU kernel is wrong with
    block_mask=None and a score_mod: a spec without a mask gets an all-full block mask there;
    on CUDA none (faster)."""
    import dataclasses
    from flexspec.runtime.backends import REGISTRY
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Q_LEN=200, KV_LEN=200, Dv=8)
    plan = plan_for("alibi", q, k, v, asked="flex", block_size=(128, 128))
    block_mask = plan.state.block_mask
    assert block_mask is not None
    # every tile of 2 x 2 is computed (the ragged ones as partial)
    assert int(block_mask.full_kv_num_blocks.sum() + block_mask.kv_num_blocks.sum()) == 2 * 2
    on_cuda = dataclasses.replace(plan, request=dataclasses.replace(plan.request,
                                                                    device_type="cuda"))
    assert REGISTRY["flex"].prepare(on_cuda, plan.values({})).state.block_mask is None


@pytest.mark.parametrize("rows, kept", [(1, True), (127, True), (128, False)])
def test_a_mask_free_decode_call_keeps_its_block_mask_on_cuda(rows, kept):
    """flexspec.workarounds: flex-decoding-one-block. Without a block mask FlexAttention's
    decoding kernel (fewer than 128 query rows) gets the whole cache as one block, which one
    split-KV program reads alone: a mask-free decode call on CUDA keeps an all-full block mask
    of the plan's blocks; longer calls go without."""
    import dataclasses
    from flexspec.runtime.backends import REGISTRY
    # planned on the CPU at 128 rows (flex refuses fewer there), then asked as a CUDA call
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Q_LEN=128, KV_LEN=300, Dv=8)
    plan = plan_for("softcap(30)", q, k, v, asked="flex", block_size=(128, 128))
    on_cuda = dataclasses.replace(plan, request=dataclasses.replace(
        plan.request, device_type="cuda", q_len=rows))
    block_mask = REGISTRY["flex"].prepare(on_cuda, plan.values({})).state.block_mask
    assert (block_mask is not None) == kept
    if kept:
        assert block_mask.BLOCK_SIZE == (128, 128)
        # the decoding kernel's form: every tile listed, none as full (block_tables.as_partial)
        assert block_mask.full_kv_num_blocks is None
        assert int(block_mask.kv_num_blocks.sum()) == 3


def as_cuda_call(plan, **request):
    """``plan`` as if its call came on CUDA (with ``request``'s facts changed)."""
    import dataclasses
    return dataclasses.replace(plan, request=dataclasses.replace(
        plan.request, **{"device_type": "cuda", **request}))


@pytest.mark.parametrize("change, decodes", [
    ({}, True), ({"q_len": 128}, False), ({"device_type": "cpu"}, False),
    ({"grads": True}, False), ({"heads": 6, "kv_heads": 2}, False),  # 3 heads a group
    ({"heads": 8, "kv_heads": 2}, True),
    # keys of 2**31 elements: the decoding kernel does not compile, the main kernel runs them
    ({"batch": 64, "kv_heads": 8, "kv_len": 32768, "head_dim": 128, "heads": 32}, False),
])
def test_calls_of_few_rows_on_cuda_run_on_the_decoding_kernel(change, decodes):
    """torch runs FlexAttention calls of fewer than 128 query rows with no backward on its
    decoding kernel when the query heads per key head are a power of two and the block mask
    has one head: flexspec.runtime.flexattention.decodes says when, and such plans get the
    decoding kernel's options and block masks whose full tiles are listed as partial."""
    from flexspec.runtime import flexattention
    from flexspec.runtime.backends import REGISTRY
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Q_LEN=128, KV_LEN=300, Dv=8)
    plan = plan_for("causal & window(200)", q, k, v, asked="flex", block_size=(128, 128))
    on_cuda = as_cuda_call(plan, **{"q_len": 3, **change})
    assert flexattention.decodes(on_cuda) is decodes
    state = REGISTRY["flex"].prepare(on_cuda, plan.values({})).state
    assert state.kernel.decoding is decodes
    assert state.masks.key.partial is decodes
    assert ((state.kernel.options or {}).get("num_stages") == 3) is decodes
    wide = change.get("batch") == 64
    assert bool((state.kernel.options or {}).get("FORCE_USE_FLEX_ATTENTION")) is wide
    # what explain says of it
    kernel = REGISTRY["flex"].kernel(on_cuda)
    if change.get("q_len") == 128 or change.get("device_type") == "cpu":
        assert kernel is None
    else:
        assert kernel.startswith("FlexAttention's decoding kernel" if decodes
                                 else "FlexAttention's main kernel")
        assert ("2**31" in kernel) is wide
        assert ("gradients" in kernel) is bool(change.get("grads"))
    # the flash backend's FLASH kernel has no decoding form
    assert REGISTRY["flash"].decoding is False


def test_a_block_mask_with_one_head_per_query_head_decodes_only_without_grouped_heads():
    from flexspec.runtime import flexattention
    q, k, v = qkv(B=1, Hq=4, Hkv=4, Q_LEN=128, KV_LEN=300, Dv=8)
    plan = plan_for("even_heads", q, k, v, asked="flex", block_size=(128, 128))
    assert plan.masks.heads == 4
    assert flexattention.decodes(as_cuda_call(plan, q_len=1))
    grouped = plan_for("even_heads", q, k[:, :2], v[:, :2], asked="flex",
                       block_size=(128, 128))
    assert grouped.gqa and not flexattention.decodes(as_cuda_call(grouped, q_len=1))


# --- calls handed back, and compiles that failed -----------------------------------------------


class HandingBack(Backend):
    """A backend for these tests: it may hand back ``hands_back`` (None: never), hands back the
    calls ``refuses`` says it cannot run, and runs the others on the dense reference; it
    records the values it is prepared with and the step of every call it is given."""

    def __init__(self, name, hands_back=None, refuses=lambda q: False):
        self.name, self.hands_back, self.refuses = name, hands_back, refuses
        self.prepared_with, self.steps = [], []

    def why_not(self, request, spec):
        return None

    def prepare(self, plan, values):
        self.prepared_with.append(values)
        return Prepared(state=f"{self.name}'s state", needs_values=True,
                        hands_back=self.hands_back)

    def run(self, plan, q, k, v, scale, bindings, values, step=None):
        self.steps.append(step)
        if self.refuses(q):
            raise Replan(f"{self.name} cannot run a batch of {q.shape[0]}")
        return reference_attention(plan.spec, q, k, v, scale=scale, tensors=values)


@pytest.fixture
def handing_back(monkeypatch):
    """Two backends first in auto's CPU order: "odd" hands back calls of an odd batch, "even"
    says it may hand back calls (it never does), then the usual ones."""
    from flexspec.runtime import backends, order
    odd = HandingBack("odd", "calls of an odd batch", refuses=lambda q: q.shape[0] % 2 == 1)
    even = HandingBack("even", "calls it may not run")
    for backend in (odd, even):
        monkeypatch.setitem(backends.REGISTRY, backend.name, backend)
    monkeypatch.setattr(backends, "BACKENDS", ("auto", *backends.REGISTRY))
    rows = tuple(order.Row(("cpu",), "any", name, f"{name} goes first")
                 for name in ("odd", "even"))
    monkeypatch.setattr(order, "ORDER", rows + order.ORDER)
    return odd, even


def test_a_plan_whose_backend_may_hand_calls_back_keeps_the_next_backend_s_plan(handing_back):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Q_LEN=24, KV_LEN=24, Dv=8)
    ids = torch.tensor([0] * 10 + [1] * 14)
    plan = plan_for("causal & document", q, k, v, doc_ids=ids)
    assert plan.choice.backend == "odd" and plan.state == "odd's state"
    fallback = plan.fallback
    # the first other backend auto would take, for what the first hands back
    assert fallback.backend.name == "even" and fallback.state == "even's state"
    assert fallback.choice.reason == "even goes first (for calls of an odd batch)"
    assert fallback.choice.rejected == plan.choice.rejected
    assert fallback.choice.viable == plan.choice.viable[1:]
    # which may hand back too: its own fallback is the next one
    assert fallback.fallback.backend.name == plan.choice.viable[1][0]
    assert fallback.fallback.choice.viable == plan.choice.viable[2:]
    # prepared with the values of the call that made the plan
    odd, even = handing_back
    doc = key_of("causal & document", "doc_ids")
    assert [torch.equal(values[doc], ids[None]) for values in even.prepared_with] == [True]
    # a call of a batch of one is handed to "even", with every argument of the call
    step = object()
    out = planning.run(plan, q, k, v, 0.5, {"doc_ids": ids}, step)
    assert odd.steps == [step] and even.steps == [step]
    expected = flexspec.compile("causal & document").reference(q, k, v, scale=0.5, doc_ids=ids)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_a_plan_whose_backend_never_hands_back_has_no_fallback(handing_back):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Q_LEN=24, KV_LEN=24, Dv=8)
    assert plan_for("causal", q, k, v, asked="reference").fallback is None
    assert plan_for("causal", q, k, v, asked="odd").fallback.backend.name == "even"


def test_a_call_handed_back_with_no_backend_to_take_it_says_why(handing_back, monkeypatch):
    from flexspec.runtime import order
    monkeypatch.setattr(order, "ORDER", order.ORDER[:1])  # "odd" alone
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Q_LEN=24, KV_LEN=24, Dv=8)
    plan = plan_for("causal", q, k, v)
    assert plan.choice.viable == ()
    reasons = "; ".join(f"{name}: {reason}" for name, reason in plan.choice.rejected)
    assert "; reference: ranked lower for this call" in reasons
    message = ("backend 'odd' hands back calls of an odd batch, and no other backend can run "
               f"this call ({reasons})")
    assert isinstance(plan.fallback, BackendError) and str(plan.fallback) == message
    with pytest.raises(BackendError, match="^" + re.escape(message) + "$"):
        planning.run(plan, q, k, v, None, {})


def test_a_call_handed_back_by_a_backend_that_said_it_would_not_is_a_bug_to_report(
        handing_back):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Q_LEN=24, KV_LEN=24, Dv=8)
    odd, _ = handing_back
    odd.hands_back = None  # it says it runs every call, then hands back this one
    plan = plan_for("causal", q, k, v)
    assert plan.fallback is None
    with pytest.raises(BackendError, match="^" + re.escape(
            "backend 'odd' handed back a call it said it would run (odd cannot run a batch of "
            "1); please report it") + "$"):
        planning.run(plan, q, k, v, None, {})


def test_a_call_runs_with_its_scale_and_its_lookups_checked(handing_back):
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Q_LEN=8, KV_LEN=8, Dv=8)
    group = torch.zeros(8, dtype=torch.int64)
    plan = plan_for("same_group", q, k, v, group=group)
    assert plan.choice.backend == "odd" and plan.lookups
    out = planning.run(plan, q, k, v, 0.25, {"group": group})
    expected = flexspec.compile("same_group", library=LIBRARY).reference(q, k, v, scale=0.25,
                                                                          group=group)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    wild = group.clone()
    wild[2] = 8  # group[group[2]] reads past the end
    with pytest.raises(BindingError, match=r"'group' is indexed by group\[q\]"):
        planning.run(plan, q, k, v, None, {"group": wild})


def test_failures_keep_the_most_recent_ones_per_spec():
    causal, window = flexspec.parse("causal").ir, flexspec.parse("causal & window(3)").ir
    failures = planning.Failures(kept=2)
    failures.remember("flex", causal, "first")
    failures.remember("flash", window, "second")
    assert failures.of(causal) == (("flex", "first"),) and len(failures) == 2
    failures.remember("flex", causal, "again")  # the most recent now, with what went wrong
    failures.remember("fa4", causal, "third")  # the least recent one goes: flash's
    assert failures.of(causal) == (("flex", "again"), ("fa4", "third"))
    assert failures.of(window) == () and len(failures) == 2


def test_a_failed_compile_is_remembered_for_the_next_plans_of_the_spec(monkeypatch):
    monkeypatch.setattr(planning, "FAILURES", planning.Failures())
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Q_LEN=128, KV_LEN=128, Dv=8)
    plan = plan_for("causal & window(3)", q, k, v)
    assert plan.choice.backend == "flex" and plan.request.failed == ()
    planning.failed(plan, Replan("it did not compile", lasting=True))  # auto: no error
    again = plan_for("causal & window(3)", q, k, v)
    assert again.request.failed == (("flex", "it did not compile"),)
    assert dict(again.choice.rejected)["flex"] == (
        "it failed to compile this spec before: it did not compile")
    assert again.choice.backend == "reference"
    # asked for by name, the failure is the caller's error
    asked = plan_for("causal & window(3)", q, k, v, asked="reference")
    with pytest.raises(BackendError, match="^" + re.escape(
            "backend 'reference' could not compile this spec: out of memory. backend='auto' "
            "runs it on another backend") + "$"):
        planning.failed(asked, Replan("out of memory", lasting=True))
    assert planning.FAILURES.of(asked.spec) == (("flex", "it did not compile"),
                                                ("reference", "out of memory"))
