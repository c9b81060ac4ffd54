"""runtime.tuning (issue 27, item 4): kernel options given to compile reach FlexAttention over
flexspec's own; Attention.tune times candidates, refuses wrong answers, pins the fastest for the
call's signature, and the pinned table travels (JSON, compile(tuned=...), copies); explain
reports them."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch

import flexspec
from flexspec.runtime.tuning import KernelOptions, checked_options, default_candidates, signature
from flexspec.testing import Shape


@pytest.fixture
def recorded(eager_kernels, monkeypatch):
    """The kernel options each flex call passes to FlexAttention (eager, see eager_kernels)."""
    from flexspec.runtime import compiled
    seen = []
    entry = compiled.compiled_entry

    def recording(lowered):
        run = entry(lowered)

        def record(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, lse):
            seen.append(dict(kernel_options or {}))
            return run(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, lse)
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
    from flexspec.runtime import attention
    monkeypatch.setattr(attention, "median_ms", lambda run, repeats, device: fake[
        str(recorded[-1] if recorded else {})])
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
                             "{'BLOCK_N': 32}": "failed: BackendError"}
    assert [ms for _, ms in result.times] == [5.0, 3.0, None, None]
    assert result.signature == "cpu:float32:B1:H2:KV2:Q130:K130:D16:forward"
    assert attn.tuned == {result.signature: {"num_warps": 4}}
    assert "best {'num_warps': 4}" in str(result) and "a different answer" in str(result)
    recorded.clear()
    with torch.no_grad():
        attn(q, k, v)
        assert recorded[-1] == {"num_warps": 4}
        assert "(tuned for this call's signature)" in str(attn.explain(q, k, v))
        other = Shape(1, 2, 2, 140, 140, 16).qkv(1)
        attn(*other)
        assert recorded[-1] == {}


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
    with pytest.raises(flexspec.BindingError, match="must be a dict of FlexAttention kernel"):
        flexspec.compile("causal", kernel_options=[("num_warps", 4)])
    with pytest.raises(flexspec.BindingError, match="option 'num_warps' must be an int, a bool "
                                                    "or a str, got 4.5"):
        checked_options({"num_warps": 4.5})
    with pytest.raises(flexspec.BindingError, match="tuned must be a dict"):
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
