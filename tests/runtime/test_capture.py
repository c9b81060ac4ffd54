"""runtime.capture: whether a call runs inside a CUDA graph capture or the warm-up before one,
and leaving the warm-up's memory pool."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from flexspec.runtime import capture


# --- captures ------------------------------------------------------------------------------


def test_only_a_cuda_device_is_captured_while_its_stream_captures(monkeypatch):
    assert not capture.capturing(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert capture.capturing(torch.device("cuda")) and capture.capturing(torch.device("cuda", 1))
    assert not capture.capturing(torch.device("cpu")) and not capture.capturing(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not capture.capturing(torch.device("cuda"))


# --- CUDA graph trees' warm-up -------------------------------------------------------------
# The trees run on a GPU only: here a stand-in manager plays their part, with the attributes
# runtime.capture reads (in_warmup, stream, cuda_graphs_thread_pool).


class _Manager:
    def __init__(self, in_warmup=True, stream="graph stream", pool=(7, 3)):
        self.in_warmup, self.stream, self.cuda_graphs_thread_pool = in_warmup, stream, pool


@pytest.fixture
def trees(monkeypatch):
    """A stand-in for torch._inductor.cudagraph_trees on a CUDA device that started (the
    current one is 2), whose current stream is "graph stream"; ``trees.manager`` is what
    get_manager returns."""
    module = types.SimpleNamespace(manager=_Manager(), asked=[])

    def get_manager(index, create_if_none_exists=True):
        module.asked.append((index, create_if_none_exists))
        return module.manager
    module.get_manager = get_manager
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", module)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    # the graph's stream is current on the devices asked for by index (None: the current
    # device's, which the trees' own stream need not be)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index=None: "graph stream" if index is not None else "default")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return module


def test_a_warm_up_is_recognised_by_its_manager_and_stream(trees):
    cuda = torch.device("cuda")
    assert capture.warming_pool(cuda) == (7, 3)
    assert trees.asked == [(2, False)]  # the current device's manager, never a new one
    assert capture.warming_pool(torch.device("cuda", 1)) == (7, 3)
    assert trees.asked[-1] == (1, False)
    assert capture.warming_pool(torch.device("cpu")) is None


def test_a_thread_that_never_warmed_a_graph_up_is_not_in_graph_memory():
    answers = []
    thread = threading.Thread(target=lambda: answers.append(
        capture.in_graph_memory(torch.device("cpu"))))
    thread.start()
    thread.join()
    assert answers == [False] and answers[0] is False


def test_inside_outside_graph_pool_a_warm_up_s_tensors_are_in_graph_memory(trees, allocator):
    """Where flexspec is entered during a warm-up (the transformers operator, through
    outside_graph_pool), nothing is kept by the call's tensors; before and after, and without
    a warm-up, in_graph_memory says no (it does not look at the trees itself)."""
    cuda = torch.device("cuda")
    assert not capture.in_graph_memory(cuda)
    with capture.outside_graph_pool(cuda):
        assert capture.in_graph_memory(cuda) and not capture.capturing(cuda)
        with capture.outside_graph_pool(cuda):  # nested, it is restored as it was
            pass
        assert capture.in_graph_memory(cuda)
    assert not capture.in_graph_memory(cuda)
    with pytest.raises(ValueError):
        with capture.outside_graph_pool(cuda):
            raise ValueError
    assert not capture.in_graph_memory(cuda)
    trees.manager = _Manager(in_warmup=False)
    with capture.outside_graph_pool(cuda):
        assert not capture.in_graph_memory(cuda)


@pytest.mark.parametrize("manager", [None, _Manager(in_warmup=False), _Manager(stream="other")],
                         ids=["no manager", "not warming up", "another stream"])
def test_no_warm_up_without_a_manager_warming_up_on_this_stream(trees, manager):
    trees.manager = manager
    assert capture.warming_pool(torch.device("cuda")) is None


def test_a_capture_is_in_graph_memory_without_a_warm_up(trees, monkeypatch):
    trees.manager = None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert capture.in_graph_memory(torch.device("cuda"))


def test_no_warm_up_where_the_trees_were_never_imported_or_cuda_never_started(trees,
                                                                              monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert capture.warming_pool(torch.device("cuda")) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    assert capture.warming_pool(torch.device("cuda")) is None


def test_trees_that_changed_shape_are_taken_for_no_warm_up(trees):
    trees.manager = object()  # none of the attributes read
    assert capture.warming_pool(torch.device("cuda")) is None


@pytest.fixture
def allocator(monkeypatch):
    """The allocator's pool calls, recorded in order."""
    calls = []
    for name in ("_cuda_endAllocateToPool", "_cuda_beginAllocateCurrentThreadToPool",
                 "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name,
                            lambda *args, name=name: calls.append((name, *args)))
    return calls


def test_outside_graph_pool_leaves_the_warm_up_s_pool_and_comes_back(trees, allocator):
    with capture.outside_graph_pool(torch.device("cuda")) as warming:
        assert warming
        assert allocator == [("_cuda_endAllocateToPool", 2, (7, 3))]
    # beginning again adds a user of the pool, releasing takes it off: the count is as it was
    assert allocator[1:] == [("_cuda_beginAllocateCurrentThreadToPool", 2, (7, 3)),
                             ("_cuda_releasePool", 2, (7, 3))]


def test_outside_graph_pool_comes_back_after_an_error(trees, allocator):
    with pytest.raises(ValueError, match="inside"):
        with capture.outside_graph_pool(torch.device("cuda", 1)):
            raise ValueError("inside")
    assert [call[0] for call in allocator] == ["_cuda_endAllocateToPool",
                                               "_cuda_beginAllocateCurrentThreadToPool",
                                               "_cuda_releasePool"]
    assert {call[1] for call in allocator} == {1}


def test_outside_graph_pool_does_nothing_without_a_warm_up(trees, allocator):
    trees.manager = _Manager(in_warmup=False)
    with capture.outside_graph_pool(torch.device("cuda")) as warming:
        assert not warming
    with capture.outside_graph_pool(torch.device("cpu")) as warming:
        assert not warming
    assert allocator == []


# --- what a call in a graph's memory leaves behind --------------------------------------------


@pytest.mark.parametrize("text", ["causal & key_padding", "causal + alibi", "causal & doc"])
def test_a_call_in_a_graph_s_memory_keeps_none_of_its_tensors(monkeypatch, text):
    """A call in a CUDA graph's memory (here the warm-up flag the transformers operator sets,
    which in_graph_memory reads on every device) must keep no tensor behind: CUDA graph trees
    refuse a graph ('N tensor(s) in the cudagraph pool not tracked as outputs') when a tensor
    of its pool outlives the recording, and every tensor such a call makes or is given lives
    there. Each spec reads a binding in its mask or its score (through a tensor q_offset), on
    the compiled kernels (130 rows, 200 keys) with the block-mask program a graph builds with
    on a GPU. Outside the graph the plan is warmed up with repeated bindings (so that the code
    of its last call is kept and replayed); then a call inside it with fresh bindings, as a
    recorded graph makes one per layer; once the caller drops what it gave and got, no tensor
    made since is alive."""
    import gc

    import flexspec
    from flexspec.runtime import masks
    monkeypatch.setattr(masks, "FUSED_DEVICES", frozenset({"cpu"}))
    attn = flexspec.compile(text)
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 200, 16, generator=generator) for _ in range(2))

    def call():
        q = torch.randn(2, 4, 130, 16, generator=generator)
        given = {"q_offset": torch.tensor([70, 20])}
        if "key_padding" in text:
            given["valid"] = torch.arange(200) < torch.tensor([[200], [170]])
        if "doc" in text:
            given["doc_ids"] = (torch.arange(200) // 90).expand(2, 200).contiguous()
        return q, given

    def live() -> set:
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}

    q, given = call()
    for _ in range(3):  # warm; the kept code replays
        attn(q, k, v, **given)
    del q, given
    before = live()
    monkeypatch.setattr(capture._thread, "warming", True, raising=False)
    q, given = call()
    out = attn(q, k, v, **given)
    monkeypatch.setattr(capture._thread, "warming", False)
    q, given, out = q.clone(), {name: t.clone() for name, t in given.items()}, out.clone()
    gc.collect()
    kept = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and id(o) not in before
            and not any(o is mine for mine in (q, out, *given.values()))]
    assert [tuple(t.shape) for t in kept] == []
    # the reference keeps tables of its own (outside any graph): checked last
    torch.testing.assert_close(out, attn.reference(q, k, v, **given), atol=1e-4, rtol=1e-4)


def _captured_on_the_cpu(monkeypatch) -> None:
    """Make ``capturing`` true for every device, in each flexspec module that reads it."""
    original = capture.capturing
    for name, module in list(sys.modules.items()):
        if name.startswith("flexspec") and getattr(module, "capturing", None) is original:
            monkeypatch.setattr(module, "capturing", lambda device: True)


@pytest.mark.parametrize("text, offset", [
    ("causal & key_padding", "tensor"), ("causal + alibi", "tensor"),
    ("sliding_window(50) + softcap(20.0)", "tensor"), ("causal & key_padding", "int"),
    ("window(50) + alibi", None), ("causal & doc + rel_bias(8)", "tensor")])
def test_a_plan_made_inside_a_capture_keeps_none_of_its_tensors(monkeypatch, text, offset):
    """A capture can meet a signature with no plan: CUDA graph trees record a graph again,
    without a warm-up, at a later generate(), and the plan may have been evicted since (or
    forgotten, as benchmarks/generate.py does), or the signature is new. Every tensor made there
    lives in the graph's pool, so neither the plan (its scale tensor, built-in tables, score)
    nor a block mask made for it may be kept: the trees refused the graph ('1 tensor(s) in the
    cudagraph pool not tracked as outputs', H100, 2026-12-06). Here the CPU plays the capture
    (capturing() made true), on the compiled kernels (130 rows, 200 keys) with the block-mask
    program, with a given scale (a tensor the plan makes): masks that read a binding, a
    built-in table, a window, an int offset not met before (flexspec makes its tensor), a mask
    that reads none, whose kept block masks are dropped too (evicted), so that it is built
    inside, and documents with a learnable table the score looks up. The code compiled outside
    the capture first (nothing can compile inside one)."""
    import gc

    import flexspec
    from flexspec.runtime import masks
    monkeypatch.setattr(masks, "FUSED_DEVICES", frozenset({"cpu"}))
    attn = flexspec.compile(text)
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 200, 16, generator=generator) for _ in range(2))

    def call(at):
        q = torch.randn(2, 4, 130, 16, generator=generator)
        given = {} if offset is None else {
            "q_offset": at if offset == "int" else torch.tensor([at, 20])}
        if "key_padding" in text:
            given["valid"] = torch.arange(200) < torch.tensor([[200], [170]])
        if "doc" in text:
            given["doc_ids"] = (torch.arange(200) // 90).expand(2, 200).contiguous()
        return q, given

    q, given = call(70)
    with torch.no_grad():  # inference, as a captured decode step runs
        attn(q, k, v, scale=0.3, **given)
    attn._calls.forget_plans()
    attn._calls.masks._cache.clear()
    attn._calls.masks._probation.clear()
    del q, given
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    q, given = call(69)
    with monkeypatch.context() as inside, torch.no_grad():
        _captured_on_the_cpu(inside)
        out = attn(q, k, v, scale=0.3, **given)
    q, out = q.clone(), out.clone()
    given = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in given.items()}
    gc.collect()
    kept = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and id(o) not in before
            and not any(o is mine for mine in (q, out, *given.values()))]
    assert [tuple(t.shape) for t in kept] == []
    with torch.no_grad():
        assert attn.explain(q, k, v, scale=0.3, **given).choice.backend == "flex"
    torch.testing.assert_close(out, attn.reference(q, k, v, scale=0.3, **given), atol=1e-4,
                               rtol=1e-4)
