"""kernels.replay: compiled calls run the cached code dynamo's guards accept without dynamo's
frame evaluation, and go through dynamo (which may compile) for anything else; a step's later
layers run the compiled code its first layer's call ran, without dynamo's guards, only where
their inputs agree with the first layer's in what those guards check; anything else takes the
compiled call. Results equal the float64 reference."""

from __future__ import annotations

import pytest
import torch

import flexspec
from flexspec.kernels import replay
from flexspec.runtime import flexattention
from flexspec.kernels.generations import call_compiled, call_kept, call_with_settings
from flexspec.kernels.replay import MISSED, ExactReplays, Replay, cached_code, run_cached, signature
from flexspec.testing import Shape


def scaled_sum(q, k, v, factor=2.0):
    return (q * factor + k - v).sum(-1)


@pytest.fixture
def compiled_sum():
    """A compiled function (dynamo's eager backend: no kernel compile) and one call of it."""
    torch._dynamo.reset()
    entry = torch.compile(scaled_sum, backend="eager")
    q, k, v = (torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    entry(q, k, v, 2.0)
    return entry, (q, k, v, 2.0)


def test_the_cached_code_runs_without_dynamo_and_computes_the_same(compiled_sum):
    entry, args = compiled_sum
    function = cached_code(entry, args)
    assert function is not None and function is not scaled_sum
    fresh = [torch.randn(2, 3, 4) for _ in range(3)]
    torch.testing.assert_close(function(*fresh, 2.0), scaled_sum(*fresh, 2.0))
    # a default left out is the function's own, as in the call dynamo saw
    assert cached_code(entry, args[:3]) is not None
    # arguments no cached code accepts (a new constant): none
    assert cached_code(entry, (*args[:3], 3.0)) is None
    # not a compiled function, or too many arguments: none
    assert cached_code(scaled_sum, args) is None
    assert cached_code(entry, (*args, 1)) is None


def dynamo_lookups(function) -> int:
    """How many times ``function()`` entered dynamo's cache lookup (the profiler's event)."""
    from torch.profiler import profile
    with profile() as profiled:
        function()
    return sum(event.name == "TorchDynamo Cache Lookup" for event in profiled.events())


def test_a_call_the_guards_accept_runs_the_cached_code_without_entering_dynamo(compiled_sum):
    entry, args = compiled_sum
    fresh = tuple(torch.randn(2, 3, 4) for _ in range(3))
    assert dynamo_lookups(lambda: entry(*fresh, 2.0)) == 1  # what the profile counts
    for call in (lambda: call_compiled(entry, *fresh, 2.0),
                 lambda: call_with_settings({"recompile_limit": 3}, entry, *fresh, 2.0)):
        assert dynamo_lookups(call) == 0
        torch.testing.assert_close(call(), scaled_sum(*fresh, 2.0))
    torch.testing.assert_close(run_cached(entry, (*fresh, 2.0)), scaled_sum(*fresh, 2.0))


def test_a_call_no_cached_code_accepts_goes_through_dynamo_and_compiles(compiled_sum):
    """Arguments the guards refuse (another dtype or constant, the grad mode, a tensor that
    requires gradients) are not run from the cache: the call compiles, and the new code then
    serves."""
    entry, (q, k, v, factor) = compiled_sum
    compiles = []
    torch._dynamo.reset()
    entry = torch.compile(scaled_sum, backend=lambda graph, inputs: compiles.append(1)
                          or graph.forward)
    entry(q, k, v, factor)
    refused = [(q.double(), k.double(), v.double(), factor), (q, k, v, 3.0)]
    for args in refused:
        assert run_cached(entry, args) is MISSED
        torch.testing.assert_close(call_compiled(entry, *args), scaled_sum(*args))
        assert run_cached(entry, args) is not MISSED
    assert len(compiles) == 3
    with torch.no_grad():
        assert run_cached(entry, (q, k, v, factor)) is MISSED
    assert run_cached(entry, (q.requires_grad_(), k, v, factor)) is MISSED


def test_a_kept_call_checks_the_guards_once_and_keeps_the_code_that_ran(compiled_sum,
                                                                        monkeypatch):
    """call_kept: a call the cached code's guards accept runs that code and returns its Replay
    after one guard check; a call that compiles goes through dynamo, then keeps the new code."""
    entry, (q, k, v, factor) = compiled_sum
    checks = []
    real = replay.cached_code
    monkeypatch.setattr(replay, "cached_code",
                        lambda entry, args: checks.append(1) or real(entry, args))
    fresh = tuple(torch.randn(2, 3, 4) for _ in range(3))
    out, kept = call_kept(entry, *fresh, factor)
    torch.testing.assert_close(out, scaled_sum(*fresh, factor))
    assert len(checks) == 1 and dynamo_lookups(lambda: call_kept(entry, *fresh, factor)) == 0
    torch.testing.assert_close(kept.run((*fresh, factor)), scaled_sum(*fresh, factor))
    checks.clear()
    other = (q.double(), k.double(), v.double(), factor)
    out, kept = call_kept(entry, *other)  # a new dtype: compiles
    torch.testing.assert_close(out, scaled_sum(*other))
    assert kept is not None and len(checks) == 2
    torch.testing.assert_close(kept.run(other), scaled_sum(*other))


def test_no_cached_run_where_dynamo_would_not_run_cached_code(compiled_sum, monkeypatch):
    entry, args = compiled_sum
    assert run_cached(entry, args) is not MISSED
    with torch.compiler.set_stance("force_eager"):
        assert run_cached(entry, args) is MISSED
    # inside an outer compile the call is traced into the outer graph, never run from a cache
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def outer(q, k, v):
        out = run_cached(entry, (q, k, v, 2.0))
        seen.append(out is MISSED)
        return (entry(q, k, v, 2.0) if out is MISSED else out) + 1
    torch.testing.assert_close(outer(*args[:3]), scaled_sum(*args) + 1)
    assert seen == [True]
    # not a compiled function; a call that does not fit its parameters
    assert run_cached(scaled_sum, args) is MISSED
    assert run_cached(entry, (*args, 1)) is MISSED
    # dynamo dropped its code (torch._dynamo.reset): through dynamo, which compiles again
    torch._dynamo.reset()
    assert run_cached(entry, args) is MISSED
    torch.testing.assert_close(call_compiled(entry, *args), scaled_sum(*args))
    assert run_cached(entry, args) is not MISSED
    # while dynamo's callback is set (code after a graph break of a user's compiled function),
    # it would take the plain function's frames for its own
    monkeypatch.setattr(replay, "get_eval_frame_callback", lambda: object())
    assert run_cached(entry, args) is MISSED
    monkeypatch.setattr(replay, "_debug_get_cache_entry_list", None)
    assert run_cached(entry, args) is MISSED


def test_cached_code_reads_sizes_without_dynamo_s_wrapped_helpers(monkeypatch):
    """The code of a call at dynamic lengths reads each length through torch._dynamo.utils'
    call_size, wrapped against tracing (host time at every call): the plain function reads them
    directly, and computes the same."""
    torch._dynamo.reset()
    entry = torch.compile(scaled_sum, backend="eager", dynamic=True)
    args = tuple(torch.randn(2, 3, 7) for _ in range(3))
    entry(*args)
    code = replay._compiled(entry)
    assert any("call_size" in cached.code.co_names
               for cached in replay._debug_get_cache_entry_list(code.code))

    def refused(*args):
        raise AssertionError("dynamo's wrapped helper called")
    monkeypatch.setattr(torch._dynamo.utils, "call_size", refused)
    fresh = tuple(torch.randn(2, 3, 11) for _ in range(3))
    torch.testing.assert_close(run_cached(entry, fresh), scaled_sum(*fresh))


def test_the_code_accepted_last_is_checked_first(compiled_sum, monkeypatch):
    """dynamo moves the entry that served a call to the front of its list; calls made without
    dynamo do not, so run_cached tries the code it ran last first, and a call that entry's
    guards refuse still finds another."""
    entry, args = compiled_sum
    real = replay._debug_get_cache_entry_list(replay._compiled(entry).code)[0]
    checked = []

    class Entry:
        def __init__(self, name, accepts):
            self.code = real.code.replace(co_name=name)  # a code of its own
            self.guard_manager = self
            self.name, self.accepts = name, accepts

        def check(self, given):
            checked.append(self.name)
            return self.accepts(given)

    entries = [Entry("refuses", lambda given: given["factor"] == 3.0),
               Entry("accepts", lambda given: given["factor"] == 2.0)]
    monkeypatch.setattr(replay, "_debug_get_cache_entry_list", lambda code: entries)
    for _ in range(2):
        torch.testing.assert_close(run_cached(entry, args), scaled_sum(*args))
    assert checked == ["refuses", "accepts", "accepts"]
    checked.clear()
    assert run_cached(entry, (*args[:3], 5.0)) is MISSED
    assert checked == ["accepts", "refuses"]


def test_a_closure_s_variables_are_what_the_guards_read():
    """A compiled closure (as flexspec's block-mask programs are): its cached code runs while
    the closure's variables are what it was compiled for, and a changed variable is refused
    (dynamo guards on it), so the call compiles anew."""
    torch._dynamo.reset()
    factor = 2.0

    def closure(x):
        return x * factor

    entry = torch.compile(closure, backend="eager")
    x = torch.randn(3)
    entry(x)
    torch.testing.assert_close(run_cached(entry, (x,)), x * 2.0)
    factor = 3.0
    assert run_cached(entry, (x,)) is MISSED
    torch.testing.assert_close(call_compiled(entry, x), x * 3.0)
    torch.testing.assert_close(run_cached(entry, (x,)), x * 3.0)


def test_a_dynamic_program_at_a_new_length_runs_cached_and_equals_the_plain_function():
    torch._dynamo.reset()
    compiles = []
    entry = torch.compile(scaled_sum, backend=lambda graph, inputs: compiles.append(1)
                          or graph.forward, dynamic=True)
    for length in (5, 9, 300, 1, 2):
        args = tuple(torch.randn(2, 3, length) for _ in range(3))
        out = call_compiled(entry, *args)
        torch.testing.assert_close(out, scaled_sum(*args))
    # one compile for every length of 2 or more, one for the length 1 torch specialises
    assert len(compiles) == 2


def summed(tensors, sizes):
    return tensors["a"][: sizes["n"]] * 2 + tensors["b"][: sizes["n"]]


@pytest.fixture
def exact():
    """A compiled function of a dict of tensors and a dict of lengths (as a block-mask program
    is), its ExactReplays, and a call of it that counts the calls made through dynamo."""
    torch._dynamo.reset()
    entry = torch.compile(summed, backend="eager", dynamic=True)
    replays = ExactReplays(entry)
    through = []

    def call(tensors, sizes):
        def via_dynamo():
            through.append(1)
            return call_compiled(entry, tensors, sizes)
        return replays.call((tensors, sizes), tuple(sizes.values()), via_dynamo)
    return call, through


def fresh(length=6, **like):
    return {name: torch.randn(length, **like) for name in "ab"}


def test_calls_that_repeat_their_signature_run_the_kept_code_without_dynamo(exact):
    call, through = exact
    for _ in range(3):  # the lengths' first call, the signature's first, its second (kept)
        tensors = fresh()
        torch.testing.assert_close(call(tensors, {"n": 5}), summed(tensors, {"n": 5}))
    assert len(through) == 3
    for _ in range(3):  # fresh tensors of the same signature
        tensors = fresh()
        assert dynamo_lookups(lambda: call(tensors, {"n": 5})) == 0
        torch.testing.assert_close(call(tensors, {"n": 5}), summed(tensors, {"n": 5}))
    assert len(through) == 3


def test_a_call_that_differs_in_what_the_guards_read_goes_through_dynamo(exact):
    call, through = exact
    for _ in range(3):
        call(fresh(), {"n": 5})
    through.clear()
    tensors = fresh()
    same = {"a": tensors["a"], "b": tensors["a"]}  # one tensor twice: one input to dynamo
    others = [({"a": tensors["a"], "b": tensors["b"].double()}, {"n": 5}),
              ({"a": tensors["a"].requires_grad_(), "b": tensors["b"]}, {"n": 5}),
              (same, {"n": 5}), ({"a": tensors["b"], "b": tensors["a"][::1]}, {"n": 4}),
              ({"a": torch.randn(12)[::2], "b": tensors["b"]}, {"n": 5}),
              ({"b": tensors["b"], "a": tensors["a"]}, {"n": 5})]
    for tensors, sizes in others:
        torch.testing.assert_close(call(tensors, sizes), summed(tensors, sizes))
    assert len(through) == len(others)
    through.clear()
    with torch.no_grad(), torch.autocast("cpu"):  # global state, each apart
        call(fresh(), {"n": 5})
    with torch.compiler.set_stance("force_eager"):
        call(fresh(), {"n": 5})
    assert len(through) == 2
    call(fresh(), {"n": 5})
    assert len(through) == 2  # still kept


def test_lengths_that_never_repeat_cost_no_signature(exact, monkeypatch):
    call, through = exact
    computed = []
    real = replay.signature
    monkeypatch.setattr(replay, "signature", lambda args: computed.append(1) or real(args))
    for length in range(2, 30):
        tensors = fresh(40)
        torch.testing.assert_close(call(tensors, {"n": length}), summed(tensors, {"n": length}))
    assert not computed and len(through) == 28


def test_a_signature_tells_apart_what_dynamo_guards_on():
    x = torch.randn(4, 3)
    assert signature(({"x": x}, 5)) == signature(({"x": torch.randn(4, 3)}, 5))
    different = [({"x": x.t().contiguous().t()}, 5), ({"x": x[1:]}, 5), ({"x": x.half()}, 5),
                 ({"x": torch.nn.Parameter(x)}, 5), ({"x": x}, 6), ({"x": x}, 5.0),
                 ({"y": x}, 5), ((x,), 5), ({"x": x, "z": x}, 5)]
    signatures = {signature(args) for args in different}
    assert len(signatures) == len(different) and signature(({"x": x}, 5)) not in signatures
    with torch.inference_mode():
        inference = torch.randn(4, 3)
    assert signature(({"x": inference}, 5)) != signature(({"x": x}, 5))
    # arguments of another kind: no signature (the call goes through dynamo)
    assert signature((object(),)) is None and signature(({"x": [x, {1}]},)) is None


def test_a_replay_runs_only_for_inputs_that_agree_with_the_first_call(compiled_sum):
    entry, (q, k, v, factor) = compiled_sum
    found = Replay.of(entry, (q, k, v, factor))
    other = [torch.randn(2, 3, 4) for _ in range(3)]
    torch.testing.assert_close(found.run((*other, factor)), scaled_sum(*other, factor))
    # an argument after q, k and v that is not the very same object
    assert found.run((*other, float("2.0"))) is None
    # one object passed twice: dynamo would pass it once
    assert found.run((other[0], other[1], other[1], factor)) is None
    # a tensor that requires gradients, of another dtype's dispatch keys, of another type
    assert found.run((other[0].requires_grad_(), other[1], other[2], factor)) is None
    assert found.run((torch.nn.Parameter(other[1]), other[1].clone(), other[2], factor)) is None
    with torch.inference_mode():
        made_inside = torch.randn(2, 3, 4)
    assert found.run((made_inside, other[1], other[2], factor)) is None
    # the global state dynamo guards: autocast, deterministic algorithms, grad mode
    with torch.autocast("cpu"):
        assert found.run((other[1], other[1].clone(), other[2], factor)) is None
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not deterministic)
    try:
        assert found.run((other[1], other[1].clone(), other[2], factor)) is None
    finally:
        torch.use_deterministic_algorithms(deterministic)
    with torch.no_grad():
        assert found.run((other[1], other[1].clone(), other[2], factor)) is None
    # a compile stance under which dynamo runs no compiled code
    with torch.compiler.set_stance("force_eager"):
        assert found.run((other[1], other[1].clone(), other[2], factor)) is None


def test_a_torch_without_dynamo_s_internals_has_no_replays(compiled_sum, monkeypatch):
    entry, args = compiled_sum
    monkeypatch.setattr(replay, "_debug_get_cache_entry_list", None)
    assert Replay.of(entry, args) is None

    def unexpected(code):
        raise AttributeError("no guard_manager here")
    monkeypatch.setattr(replay, "_debug_get_cache_entry_list", unexpected)
    assert Replay.of(entry, args) is None


def count_compiled_calls(monkeypatch) -> list:
    """Each call of a compiled FlexAttention entry that is not a replay (made through its
    guards, checked or by dynamo) appends to it."""
    counted = []
    for name in ("call_compiled", "call_kept"):
        real = getattr(flexattention, name)
        monkeypatch.setattr(flexattention, name,
                            lambda *args, _real=real: counted.append(1) or _real(*args))
    return counted


def test_later_layers_of_a_step_replay_the_compiled_kernel_and_equal_the_reference(
        monkeypatch):
    """Issue 26: steps of layers on the CPU's compiled kernels (130 query rows). In the first
    step the first layer plans and compiles, and every later layer replays the code of that
    first call, with no call into dynamo; so does every layer of a step with the same
    positions (the same block mask). A step at a new offset has a new block mask: its first
    layer's launch calls the compiled entry and the layers after it replay that call's code.
    Every layer equals the float64 reference."""
    torch._dynamo.reset()
    attn = flexspec.compile("causal & (window(100) | sink(4)) + softcap(20)", backend="flex")
    shape = Shape(1, 4, 2, 130, 400, 16)
    inputs = [shape.qkv(seed) for seed in range(5)]
    counted = count_compiled_calls(monkeypatch)
    replayed = []
    real = Replay.run

    def run(self, args):
        out = real(self, args)
        replayed.append(out is not None)
        return out
    monkeypatch.setattr(Replay, "run", run)
    with torch.no_grad():
        # (layers, offset, calls of the compiled entry, replays): the first step's first layer
        # compiles (its own path); a step at the same offset replays all; a new offset's first
        # layer calls the entry
        for layers, offset, compiled_calls, replays in ((5, 250, 0, 4), (3, 250, 0, 3),
                                                         (3, 251, 1, 2)):
            counted.clear()
            replayed.clear()
            step = flexspec.Step(q_offset=offset)
            for q, k, v in inputs[:layers]:
                torch.testing.assert_close(attn(q, k, v, step=step),
                                           attn.reference(q, k, v, q_offset=offset),
                                           rtol=1e-4, atol=1e-4)
            assert len(counted) == compiled_calls, offset
            assert replayed.count(True) == replays, offset


def count_replays(monkeypatch) -> tuple:
    """``(served, made)``: each Replay.run appends whether it served the call, each Replay.of
    appends whether it found code."""
    served, made = [], []
    real_run, real_of = Replay.run, Replay.of.__func__

    def run(self, args):
        out = real_run(self, args)
        served.append(out is not None)
        return out

    def of(cls, entry, args):
        found = real_of(cls, entry, args)
        made.append(found is not None)
        return found
    monkeypatch.setattr(Replay, "run", run)
    monkeypatch.setattr(Replay, "of", classmethod(of))
    return served, made


def test_repeated_calls_of_a_warm_plan_replay_until_their_arguments_change_every_call(
        monkeypatch):
    """Plain calls (no step) on the CPU's compiled kernels (130 query rows): calls with the
    same offset (the same block mask and score) replay the code of the plan's call before; calls
    whose block mask is new at every call (fresh document ids) stop trying after one replay that
    never served. Every call equals the float64 reference."""
    torch._dynamo.reset()
    served, made = count_replays(monkeypatch)
    attn = flexspec.compile("causal & (window(100) | sink(4)) + softcap(20)", backend="flex")
    shape = Shape(1, 4, 2, 130, 400, 16)
    with torch.no_grad():
        for seed in range(5):
            q, k, v = shape.qkv(seed)
            torch.testing.assert_close(attn(q, k, v, q_offset=250),
                                       attn.reference(q, k, v, q_offset=250),
                                       rtol=1e-4, atol=1e-4)
        # the first call compiles, the second calls the entry and keeps its code, three replay
        assert made == [True] and served.count(True) == 3
        served.clear(), made.clear()
        docs = flexspec.compile("causal & doc", backend="flex")
        for seed in range(6):
            q, k, v = shape.qkv(seed)
            ids = (torch.arange(400) // (60 + seed)).expand(1, 400).clone()
            torch.testing.assert_close(docs(q, k, v, q_offset=250, doc_ids=ids),
                                       docs.reference(q, k, v, q_offset=250, doc_ids=ids),
                                       rtol=1e-4, atol=1e-4)
        assert made == [True] and not any(served)
