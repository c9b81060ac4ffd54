"""auto's order table (flexspec.runtime.order) and the registry the backends' files make
(flexspec.runtime.backends.discover): the order per device and mode, every row's backend and
reason, and a new backend added as one file and one row."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import flexspec
from flexspec.runtime import order
from flexspec.runtime.backends import BACKENDS, REGISTRY, auto_order
from flexspec.runtime.contract import Request
from flexspec.runtime.fa4 import INSTALLED
from flexspec.testing import Shape

H200 = Request(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=4, heads=16,
               kv_heads=16, q_len=8192, kv_len=8192, head_dim=128, v_head_dim=128, grads=False,
               table_grads=False, facts=((INSTALLED, True),))
CPU = dataclasses.replace(H200, device_type="cpu", capability=None, dtype=torch.float32)


def names(request):
    return [name for name, _ in auto_order(request)]


def test_auto_order_per_device():
    assert names(H200) == ["fa4", "flash", "sdpa", "flex"]
    assert names(dataclasses.replace(H200, grads=True)) == ["fa4", "flash", "sdpa", "flex"]
    for device in ("cpu", "mps"):
        request = dataclasses.replace(CPU, device_type=device)
        assert names(request) == ["sdpa", "flex", "reference"]
        assert names(dataclasses.replace(request, grads=True)) == ["sdpa", "reference", "flex"]
    for device in ("xpu", "hpu"):  # any other device: the rows of "*"
        for grads in (False, True):
            request = dataclasses.replace(CPU, device_type=device, grads=grads)
            assert names(request) == ["sdpa", "flex", "reference"]


def test_every_row_names_a_registered_backend_with_a_reason_and_its_measurement():
    assert {row.backend for row in order.ORDER} == set(REGISTRY)
    for row in order.ORDER:
        assert row.mode in ("forward", "backward", "any")
        assert row.reason and row.measured.startswith("docs/performance.md#")
        assert order.reason(row, CPU) == row.reason.format(device="cpu")
    # each device and mode lists a backend once
    for request in (H200, CPU, dataclasses.replace(CPU, grads=True),
                    dataclasses.replace(CPU, device_type="xpu")):
        assert len(names(request)) == len(set(names(request)))


def test_the_notice_of_a_row_is_warned_once_when_auto_takes_it(monkeypatch):
    from flexspec.runtime import notices
    monkeypatch.setattr(notices, "_warned", set())
    attn = flexspec.compile("causal & window(3)")
    q, k, v = (t.requires_grad_() for t in Shape(1, 2, 2, 200, 200, 8).qkv(seed=0))
    with pytest.warns(UserWarning, match="FlexAttention has no backward pass on cpu") as caught:
        attn(q, k, v)
    assert attn.explain(q, k, v).choice.backend == "reference"
    # it points at the user's line, not into flexspec or torch (first-hour review, 2026-12-02)
    assert [w.filename for w in caught] == [__file__]
    # through a module's forward, too
    layer = flexspec.MultiheadAttention(16, 2, "causal & window(3)", batch_first=True)
    monkeypatch.setattr(notices, "_warned", set())
    with pytest.warns(UserWarning, match="no backward pass") as caught:
        layer(torch.randn(1, 130, 16))
    assert [w.filename for w in caught] == [__file__]


def test_the_registry_names_the_backends():
    assert BACKENDS == ("auto", *REGISTRY) == ("auto", "fa4", "flash", "sdpa", "flex",
                                                   "reference")
    assert all(backend.name == name for name, backend in REGISTRY.items())
    assert flexspec.backends() == BACKENDS


TOY = '''"""A toy backend: the dense reference under another name, on the CPU only."""

from flexspec.kernels.reference import reference_attention
from flexspec.runtime.contract import Backend, Prepared


class ToyBackend(Backend):
    name = "toy"

    def why_not(self, request, spec):
        return None if request.device_type == "cpu" else "the toy runs on the CPU only"

    def prepare(self, plan, values):
        return Prepared(state="toy state", needs_values=True)

    def run(self, plan, q, k, v, scale, bindings, values, step=None):
        assert plan.state == "toy state"
        return reference_attention(plan.spec, q, k, v, scale=scale, tensors=values)


BACKEND = ToyBackend()
'''


def test_a_new_backend_is_one_file_and_one_row_in_the_order_table(tmp_path, monkeypatch,
                                                                   request):
    """The file goes where the backends live (here: a folder added to the package's path) and
    the row into the order table; discovery, the choice, explain and the call need nothing
    else."""
    from flexspec.runtime import backends
    (tmp_path / "toy.py").write_text(TOY)
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    request.addfinalizer(lambda: sys.modules.pop("flexspec.runtime.backends.toy", None))
    row = order.Row(("cpu",), "any", "toy", "the toy goes first on the CPU")
    monkeypatch.setattr(order, "ORDER", (row,) + order.ORDER)
    found = backends.discover()  # what importing the package does
    assert list(found) == ["toy", "fa4", "flash", "sdpa", "flex", "reference"]
    monkeypatch.setitem(backends.REGISTRY, "toy", found["toy"])
    monkeypatch.setattr(backends, "BACKENDS", ("auto", *backends.REGISTRY))

    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=1)
    attn = flexspec.compile("causal & window(3) + alibi")
    explanation = attn.explain(q, k, v)
    assert (explanation.choice.backend, explanation.choice.reason) == (
        "toy", "the toy goes first on the CPU")
    assert "flex" in dict(explanation.choice.viable)
    torch.testing.assert_close(attn(q, k, v), attn.reference(q, k, v))
    asked = flexspec.compile("causal & window(3)", backend="toy")
    torch.testing.assert_close(asked(q, k, v), asked.reference(q, k, v))
    assert "toy" in flexspec.backends()
    # where its why_not refuses, auto goes on down the table
    gpu_like = dataclasses.replace(CPU, device_type="cuda", capability=(9, 0))
    assert "toy" not in names(gpu_like)


def test_rows_and_backend_names_of_a_table_given_in_place_of_the_order():
    # a table of its own: its rows, not ORDER's, in its order
    table = (order.Row(("cpu",), "backward", "reference", "gradients densely"),
             order.Row(("cpu",), "any", "flex", "every spec"),
             order.Row(("*",), "any", "sdpa", "elsewhere"),
             order.Row(("cpu",), "forward", "flex", "again"))
    assert [row.reason for row in order.rows_for(CPU, table)] == ["every spec", "again"]
    grads = dataclasses.replace(CPU, grads=True)
    assert [row.reason for row in order.rows_for(grads, table)] == ["gradients densely",
                                                                    "every spec"]
    xpu = dataclasses.replace(CPU, device_type="xpu")
    assert [row.reason for row in order.rows_for(xpu, table)] == ["elsewhere"]
    assert order.backend_names(table) == ["reference", "flex", "sdpa"]
    assert order.backend_names() == ["fa4", "flash", "sdpa", "flex", "reference"]


def test_a_module_of_the_backends_without_a_backend_is_not_one(tmp_path, monkeypatch):
    # a helper module beside the backends' files defines no BACKEND: discovery passes over it
    from flexspec.runtime import backends
    (tmp_path / "helpers_for_tests.py").write_text("SHARED = 1\n")
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "flexspec.runtime.backends.helpers_for_tests",
                        raising=False)
    try:
        assert list(backends.discover()) == ["fa4", "flash", "sdpa", "flex", "reference"]
    finally:
        sys.modules.pop("flexspec.runtime.backends.helpers_for_tests", None)


def test_paged_reads_have_rows_of_their_own():
    """auto's order for a paged call (Request.pages): the backends that read pages in place,
    flex on every device, vetoed off CUDA (a CPU call is copied out of its pages instead);
    every other backend says it does not read a paged pool."""
    from flexspec.runtime.backends import choose, why_not
    from flexspec.runtime.contract import PageGeometry
    geometry = PageGeometry(page_size=64, pages=512, max_pages=128)
    paged = dataclasses.replace(H200, pages=geometry, kv_len=geometry.capacity)
    spec = flexspec.compile("causal").ir
    for request in (paged, dataclasses.replace(paged, device_type="cpu", capability=None)):
        assert names(request) == ["flex"]
        assert names(dataclasses.replace(request, grads=True)) == ["flex"]
    assert choose("auto", paged, spec).backend == "flex"
    cpu = dataclasses.replace(paged, device_type="cpu", capability=None, dtype=torch.float32)
    with pytest.raises(flexspec.BackendError, match="no backend reads this paged pool in place "
                                                    r"\(flex: on cpu, copying the sequences"):
        choose("auto", cpu, spec)
    assert choose("auto", cpu, spec, vetoes=False).backend == "flex"
    for name in ("fa4", "flash", "sdpa", "reference"):
        assert why_not(name, paged, spec) == "it does not read a paged pool in place"
    with pytest.raises(flexspec.BackendError, match="flex: the pool is read in place for "
                                                    "inference only"):
        choose("auto", dataclasses.replace(paged, grads=True), spec)
    assert paged.layout == "paged" and H200.layout == "contiguous"
    assert paged.key_positions == 16 * 512 * 64 and H200.key_positions == 4 * 16 * 8192


TOY_PAGED = '''"""A toy page-table kernel: it copies each row's pages out and runs the dense reference."""

from flexspec.kernels.reference import reference_attention
from flexspec.runtime.contract import Backend, Prepared


class ToyPages(Backend):
    name = "toypages"
    reads_pages = True

    def why_not(self, request, spec):
        if request.pages is None:
            return "the toy reads paged pools only"
        return None if request.device_type == "cpu" else "the toy runs on the CPU only"

    def prepare(self, plan, values):
        return Prepared(state="toy pages", needs_values=True)

    def run(self, plan, q, k, v, scale, bindings, values, step=None, pages=None):
        assert plan.state == "toy pages" and plan.request.pages == pages.geometry
        return reference_attention(plan.spec, q, pages.gather(k), pages.gather(v), scale=scale,
                                   tensors=values)


BACKEND = ToyPages()
'''


def test_a_page_table_kernel_is_one_file_and_one_row(tmp_path, monkeypatch, request):
    """A backend that reads pages in place is one file (reads_pages, its why_not and run, which
    takes the call's PageTables) and one paged row of the order table: auto picks it for paged
    calls, explain names it, and each row of a paged call equals the float64 reference over its
    own sequence; a layer's read made once runs another cache of the same layout."""
    from flexspec.runtime import backends
    (tmp_path / "toypages.py").write_text(TOY_PAGED)
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    request.addfinalizer(lambda: sys.modules.pop("flexspec.runtime.backends.toypages", None))
    row = order.Row(("cpu",), "any", "toypages", "the toy reads pages on the CPU",
                    layout="paged")
    monkeypatch.setattr(order, "ORDER", (row,) + order.ORDER)
    found = backends.discover()
    assert list(found)[0] == "toypages"
    monkeypatch.setitem(backends.REGISTRY, "toypages", found["toypages"])
    monkeypatch.setattr(backends, "BACKENDS", ("auto", *backends.REGISTRY))

    attn = flexspec.compile("causal & window(5) + alibi")
    caches = [flexspec.PagedKVCache(pages=12, page_size=4, kv_heads=2, head_dim=8, slots=4,
                                    max_pages=6) for _ in range(2)]
    generator = torch.Generator().manual_seed(3)
    slots, lengths = torch.tensor([3, 0]), [13, 7]
    sequences = []
    for cache in caches:
        kv = [torch.randn(2, 2, 13, 8, generator=generator) for _ in range(2)]
        for row, (slot, length) in enumerate(zip(slots.tolist(), lengths)):
            cache.append(torch.tensor([slot]), kv[0][row:row + 1, :, :length],
                         kv[1][row:row + 1, :, :length])
        sequences.append(kv)
    q = torch.randn(2, 4, 2, 8, generator=generator)
    explanation = attn.explain(q, caches[0], slots)
    assert (explanation.choice.backend, explanation.choice.reason) == (
        "toypages", "the toy reads pages on the CPU")
    assert explanation.pages.startswith("read in place")
    read = attn.paged_read(q, caches[0], slots)
    for cache, (keys, values) in zip(caches, sequences):
        out = attn.paged(q, cache, slots)
        torch.testing.assert_close(read(q, cache), out)
        for row, length in enumerate(lengths):
            want = attn.reference(q[row:row + 1].double(), keys[row:row + 1, :, :length].double(),
                                  values[row:row + 1, :, :length].double(),
                                  q_offset=length - 2)
            torch.testing.assert_close(out[row:row + 1].double(), want)
