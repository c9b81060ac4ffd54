"""runtime.tuning (issue 27, item 4): kernel options given to compile reach FlexAttention over
flexspec's own; Attention.tune times candidates, refuses wrong answers, pins the fastest for the
call's signature, and the pinned table travels (JSON, compile(tuned=...), copies); explain
reports them."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
import torch

import flexspec
from flexspec.runtime.tuning import KernelOptions, checked_options, default_candidates, signature
from flexspec.testing import Shape


class Recorded(list):
    """The kernel options of each call, and the purposes of the entries they ran in."""

    def __init__(self):
        super().__init__()
        self.purposes = set()


@pytest.fixture
def recorded(eager_kernels, monkeypatch):
    """The kernel options each flex call passes to FlexAttention (eager, see eager_kernels)."""
    from flexspec.runtime import compiled
    seen = Recorded()
    entry = compiled.compiled_entry

    def recording(lowered, purpose="call"):
        run = entry(lowered, purpose)
        seen.purposes.add(purpose)

        def record(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, lse,
                   pinned=()):
            seen.append(dict(kernel_options or {}))
            return run(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, lse,
                       pinned)
        return record
    monkeypatch.setattr(compiled, "compiled_entry", recording)
    return seen


def qkv(seed=0, q_len=130):
    return Shape(1, 2, 2, q_len, 130, 16).qkv(seed)


def test_options_given_to_compile_reach_the_kernel_and_explain(recorded):
    attn = flexspec.compile("causal & window(20)", backend="flex",
                            kernel_options={"BLOCK_M": 64, "num_warps": 4})
    q, k, v = qkv()
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v), attn.reference(q, k, v), rtol=1e-4,
                                   atol=1e-4)
    assert recorded[-1] == {"BLOCK_M": 64, "num_warps": 4}
    text = str(attn.explain(q, k, v))
    assert "options:  {'BLOCK_M': 64, 'num_warps': 4} (given to compile)" in text
    assert "kernel_options={'BLOCK_M': 64, 'num_warps': 4}" in repr(attn)
    assert "options:" not in str(flexspec.compile("causal & window(20)").explain(q, k, v))


def test_tuning_pins_the_fastest_candidate_that_gives_the_same_answer(recorded, monkeypatch):
    """With a fake clock (each option set its own time), tune picks the fastest candidate,
    leaves out one that fails and one that answers differently, and later calls of the
    signature run with the pinned options; another signature keeps flexspec's own."""
    attn = flexspec.compile("causal & window(20) + alibi", backend="flex")
    q, k, v = qkv()
    fake = {"{}": 5.0, "{'num_warps': 4}": 3.0, "{'num_warps': 8}": 1.0,
            "{'BLOCK_N': 32}": 2.0}
    from flexspec.runtime import tuning
    # a fake clock: each option set its own time, read off the options of the run it times
    monkeypatch.setattr(tuning, "median_ms", lambda run, repeats, device: (
        run(), fake[str(recorded[-1])])[1])
    from flexspec.runtime import flexattention
    real_run = flexattention.FlexAttentionBackend.run

    def wrong_for_eight_warps(self, plan, q, k, v, *args):
        out = real_run(self, plan, q, k, v, *args)
        return out + 1 if dict(plan.request.kernel_options).get("num_warps") == 8 else out

    def failing_for_small_blocks(self, plan, q, k, v, *args):
        if dict(plan.request.kernel_options).get("BLOCK_N") == 32:
            raise flexspec.BackendError("no kernel for these tiles")
        return wrong_for_eight_warps(self, plan, q, k, v, *args)
    monkeypatch.setattr(flexattention.FlexAttentionBackend, "run", failing_for_small_blocks)
    result = attn.tune(q, k, v, candidates=[{"num_warps": 4}, {"num_warps": 8},
                                           {"BLOCK_N": 32}], repeats=1)
    assert result.best == {"num_warps": 4}
    assert result.failed == {"{'num_warps': 8}": "a different answer",
                             "{'BLOCK_N': 32}": "no kernel for these tiles"}
    assert [ms for _, ms in result.times] == [5.0, 3.0, None, None]
    assert result.signature == "cpu:float32:B1:H2:KV2:Q130:K130:D16:forward"
    assert attn.tuned == {result.signature: {"num_warps": 4}}
    # each option set compiled in an entry of its own: the default entry holds no candidate's
    # graphs, whose guards its later calls would check
    assert recorded.purposes == {"call", "call with {'num_warps': 4}",
                                 "call with {'num_warps': 8}", "call with {'BLOCK_N': 32}"}
    assert "best {'num_warps': 4}" in str(result) and "a different answer" in str(result)
    recorded.clear()
    with torch.no_grad():
        attn(q, k, v)
        assert recorded[-1] == {"num_warps": 4}
        assert "(tuned for this call's signature)" in str(attn.explain(q, k, v))
        other = Shape(1, 2, 2, 140, 140, 16).qkv(1)
        attn(*other)
        assert recorded[-1] == {}


def test_tuning_the_backward_times_gradients_and_pins_for_calls_that_need_them(monkeypatch):
    """backward=True: the answer compared is the output and the gradients of q, k and v (a
    candidate whose dq alone is wrong is left out), the signature is the backward one, and
    only calls that need gradients run with what it pinned. torch's CPU FlexAttention has no
    backward, so the flex backend is let take gradients here and runs the dense reference,
    recording the options it was given (tests/test_gpu.py tunes the real kernels)."""
    from flexspec.runtime import flexattention, tuning
    from flexspec.runtime.backends import flex
    real_why_not = flex.FlexBackend.why_not
    monkeypatch.setattr(flex.FlexBackend, "why_not", lambda self, request, spec: real_why_not(
        self, dataclasses.replace(request, grads=False), spec))
    attn = flexspec.compile("causal & window(20)", backend="flex")
    recorded = []

    class WrongDq(torch.autograd.Function):  # the output is right, its gradient to q is not
        @staticmethod
        def forward(ctx, out):
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    def reference_run(self, plan, q, k, v, *args):
        options = dict(plan.request.kernel_options)
        recorded.append(options)
        out = attn.reference(q, k, v)
        return WrongDq.apply(out) if options.get("bwd_num_warps") == 8 else out
    monkeypatch.setattr(flexattention.FlexAttentionBackend, "run", reference_run)
    fake = {"{}": 5.0, "{'bwd_num_warps': 4}": 2.0, "{'bwd_num_warps': 8}": 1.0}
    monkeypatch.setattr(tuning, "median_ms", lambda run, repeats, device: (
        run(), fake[str(recorded[-1])])[1])
    q, k, v = qkv()
    result = attn.tune(q, k, v, backward=True, repeats=1,
                       candidates=[{"bwd_num_warps": 4}, {"bwd_num_warps": 8}])
    assert result.failed == {"{'bwd_num_warps': 8}": "a different answer"}
    assert result.best == {"bwd_num_warps": 4}
    assert result.signature == "cpu:float32:B1:H2:KV2:Q130:K130:D16:backward"
    assert q.grad is None and not q.requires_grad  # tune worked on copies
    with torch.no_grad():
        attn(q, k, v)
    assert recorded[-1] == {}
    attn(q.clone().requires_grad_(), k, v)
    assert recorded[-1] == {"bwd_num_warps": 4}


def test_backward_candidates_tune_the_backward_kernels_alone():
    from flexspec.runtime.contract import Request
    request = Request(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=4,
                      heads=16, kv_heads=16, q_len=8192, kv_len=8192, head_dim=128,
                      v_head_dim=128, grads=True, table_grads=False)
    candidates = default_candidates(request)
    assert signature(request).endswith(":backward") and len(candidates) == 9
    assert all(name.startswith("bwd_") for options in candidates for name in options)
    # the dk/dv tile and the dq tile are each other's transpose
    assert all(options["bwd_BLOCK_M1"] == options["bwd_BLOCK_N2"] for options in candidates)


def test_a_tuned_table_travels_through_json_compile_and_copies(recorded):
    key = "cpu:float32:B1:H2:KV2:Q130:K130:D16:forward"
    table = json.loads(json.dumps({key: {"num_stages": 2}}))
    attn = flexspec.compile("causal & window(20)", backend="flex", tuned=table)
    q, k, v = qkv()
    for same in (attn, copy.deepcopy(attn), pickle.loads(pickle.dumps(attn))):
        assert same.tuned == table
        with torch.no_grad():
            same(q, k, v)
        assert recorded[-1] == {"num_stages": 2}


def test_tuning_a_call_on_another_backend_says_so():
    attn = flexspec.compile("causal")  # SDPA
    q, k, v = Shape(1, 2, 2, 16, 16, 8).qkv(0)
    result = attn.tune(q, k, v, candidates=[{"num_warps": 4}])
    assert result.best == {} and "runs on backend 'sdpa', which takes no tuned" in \
        result.failed["all"]
    assert attn.tuned == {}


def test_bad_options_are_refused_with_what_to_do():
    with pytest.raises(flexspec.BindingError, match="'BACKEND' is flexspec's to set: pick the "
                                                    "kernel with compile"):
        flexspec.compile("causal", kernel_options={"BACKEND": "FLASH"})
    with pytest.raises(flexspec.BindingError, match=r"^kernel_options must be a dict of "
                                                    r"FlexAttention kernel options \(name -> "
                                                    r"value\), got list$"):
        flexspec.compile("causal", kernel_options=[("num_warps", 4)])
    with pytest.raises(flexspec.BindingError, match="option 'num_warps' must be an int, a bool "
                                                    "or a str, got 4.5"):
        checked_options({"num_warps": 4.5})
    with pytest.raises(flexspec.BindingError, match="tuned must be a dict .* got list$"):
        KernelOptions(None, ["x"])
    with pytest.raises(flexspec.BindingError, match=r"tuned\['k'\]: option names are strings"):
        KernelOptions(None, {"k": {1: 2}})
    nested = torch.nested.nested_tensor([torch.randn(3, 2, 8)], layout=torch.jagged)
    with pytest.raises(flexspec.BindingError, match="tune times dense q, k, v"):
        flexspec.compile("causal").tune(nested.transpose(1, 2), nested.transpose(1, 2),
                                        nested.transpose(1, 2))


def test_default_candidates_fit_the_kernel_a_call_runs_on():
    from flexspec.runtime.contract import Request
    request = Request(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=8,
                      heads=32, kv_heads=8, q_len=1, kv_len=32768, head_dim=128, v_head_dim=128,
                      grads=False, table_grads=False)
    assert signature(request) == "cuda:bfloat16:B8:H32:KV8:Q1:K32768:D128:forward"
    assert {"num_stages": 3, "SPLIT_KV": 16} in default_candidates(request)
    assert all("BLOCK_M" not in options for options in default_candidates(request))
    import dataclasses
    longer = dataclasses.replace(request, q_len=8192, kv_len=8192)
    assert all("BLOCK_M" in options for options in default_candidates(longer))


def test_a_candidate_replaces_the_own_options_only_beyond_the_timing_noise():
    from flexspec.runtime.tuning import MARGIN, fastest
    own, candidate = {}, {"num_warps": 4}
    just_inside = 10.0 * (1 - MARGIN) + 0.01
    assert fastest([(own, 10.0), (candidate, just_inside)]) == {}
    assert fastest([(own, 10.0), (candidate, 10.0 * (1 - MARGIN) - 0.01)]) == candidate
    assert fastest([(own, None), (candidate, 12.0)]) == candidate  # the own options failed
    assert fastest([(own, None), (candidate, None)]) == {}


def test_the_own_options_are_timed_again_last_and_keep_their_faster_time(monkeypatch):
    """The first options timed ran on a cold GPU: timed again after the candidates, their
    faster time is the one compared (here it keeps a candidate that only beat the cold run
    from being pinned)."""
    from flexspec.runtime import tuning
    pinned, asked = [], []
    clock = {"{}": [5.0, 2.0], "{'num_warps': 4}": [3.0]}

    def timed(run, repeats, device):
        asked.append((repeats, device))
        return clock[str(pinned[-1])].pop(0)
    monkeypatch.setattr(tuning, "median_ms", timed)
    result = tuning.Tuned("sig", {})
    tuning.time_candidates(lambda: (torch.ones(2),), [{}, {"num_warps": 4}], pinned.append,
                           result, 5, torch.device("cpu"))
    assert asked == [(5, torch.device("cpu"))] * 3
    assert result.times == [({}, 2.0), ({"num_warps": 4}, 3.0)]
    assert pinned == [{}, {"num_warps": 4}, {}]
    assert tuning.fastest(result.times) == {}


def test_candidates_are_timed_with_the_repeats_and_device_asked_for(monkeypatch):
    """A candidate that fails does not end the search; the own options failing leave them
    out of the re-timing; every timing gets the repeats and the device tune was given."""
    from flexspec.runtime import tuning
    pinned, asked = [], []

    def clock(run, repeats, device):
        asked.append((repeats, device))
        return {"{'num_warps': 8}": 1.0, "{'num_warps': 4}": 2.0}[str(pinned[-1])]

    def run():
        if pinned[-1] in ({}, {"num_stages": 9}):
            raise RuntimeError("no kernel")
        return (torch.ones(2),)
    monkeypatch.setattr(tuning, "median_ms", clock)
    result = tuning.Tuned("sig", {})
    cpu = torch.device("cpu")
    tuning.time_candidates(run, [{}, {"num_stages": 9}, {"num_warps": 4}, {"num_warps": 8}],
                           pinned.append, result, 7, cpu)
    assert result.times == [({}, None), ({"num_stages": 9}, None), ({"num_warps": 4}, 2.0),
                            ({"num_warps": 8}, 1.0)]
    assert pinned == [{}, {"num_stages": 9}, {"num_warps": 4}, {"num_warps": 8}]
    assert asked == [(7, cpu), (7, cpu)]
    assert tuning.fastest(result.times) == {"num_warps": 8}
    # the own options alone: timed once
    alone, pinned[:] = tuning.Tuned("sig", {}), []
    monkeypatch.setattr(tuning, "median_ms", lambda run, repeats, device: 3.0)
    tuning.time_candidates(lambda: (torch.ones(2),), [{}], pinned.append, alone, 1, cpu)
    assert pinned == [{}] and alone.times == [({}, 3.0)]


def test_a_candidate_at_exactly_the_margin_does_not_replace_the_own_options():
    from flexspec.runtime.tuning import MARGIN, fastest
    assert fastest([({}, 10.0), ({"num_warps": 4}, 10.0 * (1 - MARGIN))]) == {}


def test_answers_are_the_same_within_their_dtype_s_rounding_and_scale():
    from flexspec.runtime.tuning import same_answer
    want = torch.linspace(-1, 1, 64)
    assert same_answer((want + 5e-5,), (want,))
    assert not same_answer((want + 5e-3,), (want,))  # float32: 1e-4
    half = want.bfloat16()
    assert same_answer((half + 0.01,), (half,))
    assert not same_answer((half + 0.1,), (half,))  # bfloat16: 2e-2
    # gradients may be large: the tolerance grows with the largest value...
    large = want * 1000
    assert same_answer((large + 0.05,), (large,))
    assert not same_answer((large + 0.5,), (large,))
    # ...and relative error counts where values are large
    ramp = torch.cat([torch.zeros(1), torch.full((3,), 1e6)])
    assert not same_answer((ramp * 1.001,), (ramp,))
    assert not same_answer((want.view(8, 8),), (want,))  # another shape
    assert not same_answer((want,), (want, want))  # a gradient missing


def test_the_backward_answer_keeps_one_output_gradient_of_the_output_s_dtype():
    """answer_of(backward=True): the output and the gradients of q, k and v, the same random
    output gradient on every run and for every candidate (seeded), of the output's dtype."""
    from flexspec.runtime.tuning import answer_of
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))

    def call(q, k, v):
        return q * k.sum() + v
    first = answer_of(call, q, k, v, backward=True)
    one, two = first(), first()
    other = answer_of(call, q, k, v, backward=True)()
    for a, b, c in zip(one, two, other):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)
    out, dq, dk, dv = one
    assert dv.dtype == torch.float64 and not torch.equal(dv, torch.ones_like(dv))
    torch.testing.assert_close(dq, dv * k.sum())
    forward = answer_of(call, q, k, v, backward=False)()
    assert len(forward) == 1 and not forward[0].requires_grad


def test_a_tuning_result_reads_as_a_table_of_its_candidates():
    from flexspec.runtime.tuning import Tuned
    result = Tuned("cuda:bfloat16:B1", {"num_warps": 4},
                   times=[({}, 1.5), ({"num_warps": 4}, 1.0), ({"BLOCK_N": 32}, None),
                          ({"num_stages": 9}, None)],
                   failed={"{'BLOCK_N': 32}": "a different answer"}, seconds=2.04)
    assert str(result) == ("tuned cuda:bfloat16:B1 in 2.0 s: best {'num_warps': 4}\n"
                           "  default: 1.5000 ms\n"
                           "  {'num_warps': 4}: 1.0000 ms\n"
                           "  {'BLOCK_N': 32}: a different answer\n"
                           "  {'num_stages': 9}: failed")
    assert str(Tuned("s", {}, seconds=0.0)) == "tuned s in 0.0 s: best default"


def test_explain_says_where_a_call_s_options_come_from():
    from flexspec.runtime.contract import Request
    request = Request(device_type="cpu", capability=None, dtype=torch.float32, batch=1,
                      heads=2, kv_heads=2, q_len=130, kv_len=130, head_dim=16, v_head_dim=16,
                      grads=False, table_grads=False)
    key = signature(request)
    assert KernelOptions().source(request) is None
    assert KernelOptions({"num_warps": 4}).source(request) == "given to compile"
    assert KernelOptions(None, {key: {}}).source(request) == "tuned for this call's signature"
    assert KernelOptions({"num_warps": 4}, {key: {}}).source(request) == (
        "tuned for this call's signature over those given to compile")
    assert KernelOptions({"num_warps": 4}, {key: {"num_warps": 8}}).for_request(request) == (
        ("num_warps", 8),)


def _power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("q_len, grads", [(1, False), (8192, False), (8192, True)])
def test_default_candidates_are_distinct_options_the_kernels_take(q_len, grads):
    """Tiles are powers of two from 16 to 128 (the backward's dk/dv key tile a multiple of its
    query tile, its dq query tile a multiple of its key tile, as FlexAttention's backward
    requires), splits powers of two, stages 1-4 and warps 2, 4 or 8; no candidate twice."""
    from flexspec.runtime.contract import Request
    request = Request(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=4,
                      heads=16, kv_heads=16, q_len=q_len, kv_len=8192, head_dim=128,
                      v_head_dim=128, grads=grads, table_grads=False)
    candidates = default_candidates(request)
    assert len({str(sorted(c.items())) for c in candidates}) == len(candidates) >= 9
    for options in candidates:
        for name, value in options.items():
            bare = name.removeprefix("bwd_")
            if bare.startswith("BLOCK_"):
                assert _power_of_two(value) and 16 <= value <= 128, options
            elif bare == "SPLIT_KV":
                assert _power_of_two(value), options
            elif bare == "num_stages":
                assert 1 <= value <= 4, options
            else:
                assert bare == "num_warps" and value in (2, 4, 8), options
        if grads:
            assert options["bwd_BLOCK_N1"] % options["bwd_BLOCK_M1"] == 0
            assert options["bwd_BLOCK_M2"] % options["bwd_BLOCK_N2"] == 0


def test_repeats_that_are_not_a_positive_int_are_refused_naming_them():
    """tune(repeats=0, -1, 1.5 or True) and a paged read's tune(repeats=0) raise a flexspec
    error that names repeats (statistics' StatisticsError came out of the median of no round)."""
    from flexspec.runtime.serving.cache import PagedKVCache
    attn = flexspec.compile("causal")
    q = torch.randn(1, 2, 8, 16)
    for repeats in (0, -1, 1.5, True):
        with pytest.raises(flexspec.BindingError, match=r"repeats must be a positive int"):
            attn.tune(q, q, q, repeats=repeats)
    cache = PagedKVCache(pages=2, page_size=16, kv_heads=2, head_dim=16, slots=1, max_pages=2)
    cache.append(torch.tensor([0]), q, q)
    with torch.no_grad():
        read = attn.paged_read(q[:, :, :1], cache, torch.tensor([0]), read="auto")
        with pytest.raises(flexspec.BindingError, match=r"repeats must be a positive int"):
            read.tune(q[:, :, :1], repeats=0)
