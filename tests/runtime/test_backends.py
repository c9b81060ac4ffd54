"""Backend rules (flexspec.runtime.backends) and the runtime's dispatch on the CPU.

The rules are tested on synthetic :class:`Request` facts (a Hopper GPU with and without FA4, the
CPU, MPS), so the GPU choices are covered here without a GPU; tests/test_gpu.py runs them there.
The CPU calls compare each backend's output with the dense float64 reference.
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flexspec
from flexspec import parse
from flexspec.ir.forms import sdpa_form
from flexspec.runtime.backends import REGISTRY, BackendError, Request, choose, why_not
from flexspec.runtime.fa4 import INSTALLED, MIN_FLOPS as FLASH_MIN_FLOPS
from flexspec.runtime.explanation import attention_flops
from flexspec.testing import Shape

H200 = Request(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=4, heads=16,
               kv_heads=16, q_len=8192, kv_len=8192, head_dim=128, v_head_dim=128, grads=False,
               table_grads=False, facts=((INSTALLED, True),))
CPU = dataclasses.replace(H200, device_type="cpu", capability=None, facts=((INSTALLED, False),),
                          dtype=torch.float32, batch=1, heads=8, q_len=4096, kv_len=4096,
                          head_dim=64, v_head_dim=64)


def ir(text):
    return parse(text).ir


# ---- which specs SDPA runs ---------------------------------------------------------------------


STRICT = """
mask strict = kv < q
mask strict_q = q > kv
mask causal_kv = kv <= q
mask later = kv >= q
"""


@pytest.mark.parametrize("text, causal", [("strict", None), ("strict_q", None),
                                          ("causal_kv", True), ("later", None)])
def test_sdpa_runs_only_causal_itself(text, causal):
    # `kv < q` hides the diagonal that is_causal keeps (found by mutation testing); on the CPU,
    # auto must then pick another backend, whose result is the reference
    from flexspec.lang.library import load_text

    library = load_text(STRICT)
    form = sdpa_form(parse(text, library=library).ir)
    assert (form and form.causal) == causal
    attn = flexspec.compile(text, library=library)
    q, k, v = Shape(1, 2, 2, 40, 40, 8).qkv(seed=4)
    assert (attn.explain(q, k, v).choice.backend == "sdpa") == bool(causal)
    torch.testing.assert_close(attn(q, k, v), attn.reference(q, k, v), atol=1e-5, rtol=1e-5)


# ---- auto on a GPU -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["full", "causal", "causal & window(1024)", "causal & doc",
                                  "window(64) & doc + scale(0.5)"])
def test_auto_takes_fa4s_own_kernels_for_the_structure_they_implement(text):
    choice = choose("auto", H200, ir(text))
    assert choice.backend == "fa4"
    assert dict(choice.rejected).keys() == {"flash", "sdpa", "flex", "reference"}


@pytest.mark.parametrize("text", ["causal + alibi", "causal & prefix_lm(64)",
                                  "causal + softcap(30)"])
def test_auto_takes_flash_on_hopper_for_the_rest(text):
    choice = choose("auto", H200, ir(text))
    assert choice.backend == "flash"
    assert dict(choice.rejected).keys() == {"fa4", "sdpa", "flex", "reference"}
    if "softcap" in text:  # FA4 runs it, but FLASH measured faster
        assert "softcap ran slower" in dict(choice.rejected)["fa4"]
        assert choose("fa4", H200, ir(text)).backend == "fa4"


def test_fa4s_own_kernels_need_equal_lengths_and_return_the_lse():
    with pytest.raises(BackendError, match="bottom right.*Q_LEN == KV_LEN, got 100 and 8192"):
        choose("fa4", dataclasses.replace(H200, q_len=100), ir("causal"))
    assert choose("auto", dataclasses.replace(H200, q_len=4096, kv_len=8192),
                  ir("causal & window(64)")).backend == "flash"
    # FA4 returns the log-sum-exp, where FLASH's disagreed with the reference
    assert choose("auto", dataclasses.replace(H200, lse=True), ir("causal")).backend == "fa4"


def test_auto_says_why_it_did_not_take_each_other_backend():
    # behind the chosen one: each backend's own refusal, or "ranked lower" for one that could run
    choice = choose("auto", H200, ir("causal & window(8)"))
    rejected = dict(choice.rejected)
    assert rejected["flex"] == "ranked lower for this call"
    assert rejected["sdpa"] == why_not("sdpa", H200, ir("causal & window(8)")) is not None
    assert rejected["reference"] == "ranked lower for this call"  # never ranked on CUDA


def test_auto_on_a_gpu_without_fa4_takes_cudnn_for_causal_and_flex_otherwise():
    no_fa4 = dataclasses.replace(H200, facts=((INSTALLED, False),))
    assert choose("auto", no_fa4, ir("causal")).backend == "sdpa"
    assert choose("auto", no_fa4, ir("full + scale(0.5)")).backend == "sdpa"
    choice = choose("auto", no_fa4, ir("causal & window(1024)"))
    assert choice.backend == "flex"
    assert "flash_attn.cute" in dict(choice.rejected)["flash"]
    assert "flash_attn.cute" in dict(choice.rejected)["fa4"]


def test_small_problems_skip_flash():
    small = dataclasses.replace(H200, batch=1, heads=4, q_len=1024, kv_len=1024)
    assert small.dense_flops < FLASH_MIN_FLOPS
    assert choose("auto", small, ir("causal")).backend == "sdpa"
    choice = choose("auto", small, ir("causal & window(128)"))
    assert choice.backend == "flex"
    assert "fixed cost per call" in dict(choice.rejected)["flash"]
    assert "fixed cost per call" in dict(choice.rejected)["fa4"]
    # asked for explicitly, FLASH and FA4 still run
    assert choose("flash", small, ir("causal & window(128)")).backend == "flash"
    assert choose("fa4", small, ir("causal & window(128)")).backend == "fa4"


@pytest.mark.parametrize("change, reason", [
    ({"dtype": torch.float32}, "float16 or bfloat16"),
    ({"head_dim": 256, "v_head_dim": 256}, "head dimensions 64 and 128"),
    ({"capability": (8, 0)}, "Hopper or Blackwell GPU (compute capability 9.x or 10.x), this one "
                             "is 8.0"),
    ({"table_grads": True, "grads": True}, "gradients of tensors the score reads"),
    ({"block_size": (64, 64)}, "multiples of 128"),
    ({"device_type": "cpu", "capability": None}, "CUDA GPUs only"),
])
def test_flash_refusals_say_why(change, reason):
    request = dataclasses.replace(H200, **change)
    assert reason in why_not("flash", request, ir("causal"))
    with pytest.raises(BackendError, match="backend 'flash' cannot run this call: .*" +
                       reason.split("(")[0].strip()):
        choose("flash", request, ir("causal"))
    assert choose("auto", request, ir("causal")).backend != "flash"


def test_learnable_gradients_on_a_gpu_take_flex():
    request = dataclasses.replace(H200, grads=True, table_grads=True)
    assert choose("auto", request, ir("causal + rel_bias")).backend == "flex"


def test_gradients_on_a_gpu_keep_fa4():
    # FLASH's backward beat cuDNN and Triton on the H200 (6.7 vs 7.05 vs 10.0 ms, causal), and
    # FA4's own kernels beat FLASH (6.47 ms)
    training = dataclasses.replace(H200, grads=True)
    assert choose("auto", training, ir("causal")).backend == "fa4"
    assert choose("auto", training, ir("causal & chunked(64)")).backend == "flash"


def test_flash_backward_is_not_used_for_scores_that_read_tensors_under_gqa():
    # FLASH's backward gave wrong gradients for ALiBi with GQA on the H200 (right without GQA)
    request = dataclasses.replace(H200, grads=True, score_tensors=True, kv_heads=H200.heads // 2)
    choice = choose("auto", request, ir("causal + alibi"))
    assert choice.backend == "flex"
    assert "grouped-query attention" in dict(choice.rejected)["flash"]
    without_gqa = dataclasses.replace(request, kv_heads=H200.heads)
    assert choose("auto", without_gqa, ir("causal + alibi")).backend == "flash"
    forward = dataclasses.replace(request, grads=False)
    assert choose("auto", forward, ir("causal + alibi")).backend == "flash"


def test_flash_refuses_lookups_at_a_constant_index():
    """CuTeDSL cannot compile a load at a constant index (flexspec.workarounds:
    flash-constant-index): a broadcast binding (doc_ids[0, q]) takes Triton, and the reason says
    how to fix it."""
    from flexspec import ir as nodes
    ids = nodes.Tensor("doc_ids", (nodes.Const(1), nodes.Var("KV_LEN")), "int")
    spec = nodes.AttentionIR(nodes.Binary("==", nodes.Lookup(ids, (nodes.Const(0), nodes.Var("q"))),
                                          nodes.Lookup(ids, (nodes.Const(0), nodes.Var("kv")))),
                             nodes.SCORE)
    request = H200
    reason = why_not("flash", request, spec)
    assert "constant index ('doc_ids[0, q]'" in reason and "full B and H" in reason
    # FA4's own kernels read documents as sequence lengths, broadcast or not
    assert choose("auto", request, spec).backend == "fa4"
    other = dataclasses.replace(spec, mask=dataclasses.replace(spec.mask, op="<="))
    assert choose("auto", request, other).backend == "flex"
    # a given scale is read per batch row (scale[b]), which FLASH can
    assert why_not("flash", dataclasses.replace(H200, scale=0.5), ir("causal")) is None


# ---- auto on the CPU and elsewhere -------------------------------------------------------------


def test_auto_on_the_cpu():
    assert choose("auto", CPU, ir("causal")).backend == "sdpa"
    assert choose("auto", CPU, ir("causal & window(256)")).backend == "flex"
    short = dataclasses.replace(CPU, q_len=40, kv_len=40)
    assert choose("auto", short, ir("causal & window(8)")).backend == "reference"
    assert choose("auto", short, ir("causal")).backend == "sdpa"
    causal_cross = dataclasses.replace(CPU, kv_len=5000)
    assert choose("auto", causal_cross, ir("causal")).backend == "flex"


def test_gradients_on_the_cpu():
    grads = dataclasses.replace(CPU, grads=True)
    assert choose("auto", grads, ir("causal")).backend == "sdpa"
    assert choose("auto", grads, ir("causal & window(8)")).backend == "reference"
    with pytest.raises(BackendError, match="no backward pass on cpu"):
        choose("flex", grads, ir("causal & window(8)"))
    huge = dataclasses.replace(grads, reference_fits=False)
    with pytest.raises(BackendError, match="no backend can run this call .*memory budget"):
        choose("auto", huge, ir("causal & window(8)"))


def test_xpu_gradients_take_flex_which_has_a_backward_there():
    xpu = dataclasses.replace(CPU, device_type="xpu", grads=True)
    assert choose("auto", xpu, ir("causal & window(8)")).backend == "flex"
    assert choose("auto", dataclasses.replace(xpu, device_type="mps"),
                  ir("causal & window(8)")).backend == "reference"


def test_mps_without_gradients_takes_sdpa_or_flex():
    mps = dataclasses.replace(CPU, device_type="mps")
    assert choose("auto", mps, ir("causal")).backend == "sdpa"
    assert choose("auto", mps, ir("causal & window(8)")).backend == "flex"


def test_explicit_backends_and_their_errors():
    assert choose("flex", CPU, ir("causal")).reason == "backend='flex' was asked for"
    with pytest.raises(BackendError, match="SDPA runs only full attention .* mask "
                                           "`q >= kv & abs"):
        choose("sdpa", CPU, ir("causal & window(8)"))
    with pytest.raises(BackendError, match="Q_LEN == KV_LEN, got 4096 and 5000.*"
                                           "backend='auto' chooses one that can$"):
        choose("sdpa", dataclasses.replace(CPU, kv_len=5000), ir("causal"))
    with pytest.raises(BackendError, match="unknown backend 'flsh'. Did you mean 'flash'.* "
                                           "Backends: auto, fa4, flash, sdpa, flex, reference$"):
        why_not("flsh", CPU, ir("causal"))
    with pytest.raises(BackendError, match=r"^'auto' is not one backend .* use choose\(\)$"):
        why_not("auto", CPU, ir("causal"))


@given(device=st.sampled_from(["cpu", "cuda", "mps"]), grads=st.booleans(),
       table_grads=st.booleans(), fa4=st.booleans(), length=st.sampled_from([16, 100, 8192]),
       text=st.sampled_from(["full", "causal", "causal & window(8)", "causal + rel_bias"]))
@settings(max_examples=200, deadline=None)
def test_auto_always_chooses_a_backend_that_can_run(device, grads, table_grads, fa4, length,
                                                      text):
    request = dataclasses.replace(
        H200, device_type=device, capability=(9, 0) if device == "cuda" else None,
        grads=grads or table_grads, table_grads=table_grads, facts=((INSTALLED, fa4),),
        q_len=length, kv_len=length)
    choice = choose("auto", request, ir(text))
    assert why_not(choice.backend, request, ir(text)) is None
    assert {name for name, _ in choice.rejected} | {choice.backend} == \
        {"fa4", "flash", "sdpa", "flex", "reference"}


def test_flops_count_the_backward_as_two_and_a_half_forwards():
    assert attention_flops(10, 64, 32, backward=False) == 2 * 10 * (64 + 32)
    assert attention_flops(10, 64, 64, backward=True) == 3.5 * 2 * 10 * 128


def test_triton_backward_needs_blocks_of_128_on_cuda():
    small = dataclasses.replace(H200, block_size=(64, 128))
    assert choose("flex", small, ir("causal & window(8)")).backend == "flex"
    training = dataclasses.replace(small, grads=True)
    with pytest.raises(BackendError, match="no kernel for blocks of 64x128.* use "
                                           "block_size=128 for training"):
        choose("flex", training, ir("causal & window(8)"))
    # auto says why nothing runs, FLASH included; SDPA ignores block sizes
    with pytest.raises(BackendError, match="flash: FLASH needs block sizes .* flex: "):
        choose("auto", training, ir("causal & chunked(8)"))
    # FA4's own kernels need no block mask
    assert choose("auto", training, ir("causal & window(8)")).backend == "fa4"
    assert choose("auto", dataclasses.replace(training, block_size=(256, 128)),
                  ir("causal & chunked(8)")).backend == "flash"


@given(q_block=st.integers(1, 24).map(lambda n: 16 * n),
       kv_block=st.integers(1, 24).map(lambda n: 16 * n), table_grads=st.booleans())
def test_triton_tiles_divide_the_blocks(q_block, kv_block, table_grads):
    request = dataclasses.replace(H200, block_size=(q_block, kv_block), grads=table_grads,
                                  table_grads=table_grads)
    options = REGISTRY["flex"].kernel_options(request) or {}
    if q_block % 128 == 0 and kv_block % 128 == 0:
        # torch's own tiles divide these: nothing is overridden but the table-gradient stages
        assert not any("BLOCK" in key for key in options)
    else:
        tiles_q = [options[k] for k in ("fwd_BLOCK_M", "bwd_BLOCK_M1", "bwd_BLOCK_M2")]
        tiles_kv = [options[k] for k in ("fwd_BLOCK_N", "bwd_BLOCK_N1", "bwd_BLOCK_N2")]
        assert all(16 <= t <= 64 and q_block % t == 0 for t in tiles_q)
        assert all(16 <= t <= 64 and kv_block % t == 0 for t in tiles_kv)
        # the backward kernels need matching tiles on both sides
        assert options["bwd_BLOCK_N1"] % options["bwd_BLOCK_M1"] == 0
        assert options["bwd_BLOCK_M2"] % options["bwd_BLOCK_N2"] == 0
    assert (options.get("num_stages") == 1) == table_grads
    assert REGISTRY["flash"].kernel_options(request) == {"BACKEND": "FLASH"}


# ---- the runtime on the CPU --------------------------------------------------------------------


@given(text=st.sampled_from(["full", "causal", "causal + scale(0.5)", "full + scale(3.0)"]),
       shape=st.builds(Shape, B=st.integers(1, 2), Hq=st.just(4), Hkv=st.sampled_from([1, 2, 4]),
                       Q_LEN=st.integers(1, 90), KV_LEN=st.integers(1, 90), D=st.just(8)),
       scale=st.sampled_from([None, 0.3]))
@settings(max_examples=25, deadline=None)
def test_sdpa_backend_equals_the_reference(text, shape, scale):
    if text.startswith("causal"):
        shape = shape._replace(KV_LEN=shape.Q_LEN)
    attn = flexspec.compile(text, backend="sdpa")
    q, k, v = shape.qkv(seed=1)
    torch.testing.assert_close(attn(q, k, v, scale=scale), attn.reference(q, k, v, scale=scale),
                               atol=1e-5, rtol=1e-5)


def test_sdpa_gradients_equal_the_reference():
    attn = flexspec.compile("causal + scale(0.7)")
    q, k, v = Shape(1, 2, 2, 30, 30, 8).qkv(seed=2)
    grads = []
    for run in (attn, attn.reference):
        leaves = [t.clone().double().requires_grad_() for t in (q, k, v)]
        if run is attn:  # the kernel path takes float32
            leaves = [t.detach().float().requires_grad_() for t in leaves]
        out = run(*leaves)
        out.double().pow(2).sum().backward()
        grads.append([t.grad.double() for t in leaves])
    assert attn.explain(*(t.requires_grad_() for t in (q, k, v))).choice.backend == "sdpa"
    for mine, reference in zip(*grads):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-4)


def test_auto_uses_sdpa_for_causal_on_the_cpu():
    q, k, v = Shape(1, 2, 2, 100, 100, 8).qkv(seed=0)
    explanation = flexspec.compile("causal").explain(q, k, v)
    assert explanation.choice.backend == "sdpa"
    assert "SDPA beat compiled FlexAttention" in explanation.choice.reason


def test_sdpa_refusals_at_compile_and_call_time():
    with pytest.raises(BackendError, match="backend 'sdpa' cannot run 'causal & window\\(8\\)'"):
        flexspec.compile("causal & window(8)", backend="sdpa")
    q = torch.randn(1, 1, 12, 8)
    k = torch.randn(1, 1, 10, 8)
    with pytest.raises(BackendError, match="Q_LEN == KV_LEN, got 12 and 10"):
        flexspec.compile("causal", backend="sdpa")(q, k, k)
    # ten rows over twelve keys see none of the last two: the call reads keys 0..9 only, which
    # SDPA runs
    causal = flexspec.compile("causal", backend="sdpa")
    q, k = torch.randn(1, 1, 10, 8), torch.randn(1, 1, 12, 8)
    torch.testing.assert_close(causal(q, k, k), causal.reference(q, k, k))


def test_flash_on_the_cpu_says_why_not():
    q = torch.randn(1, 1, 100, 8)
    with pytest.raises(BackendError, match="FLASH runs on CUDA GPUs only, not on cpu"):
        flexspec.compile("causal", backend="flash")(q, q, q)


def test_explicit_flex_with_gradients_on_the_cpu_is_refused():
    q = torch.randn(1, 1, 100, 8, requires_grad=True)
    with pytest.raises(BackendError, match="no backward pass on cpu"):
        flexspec.compile("causal & window(8)", backend="flex")(q, q, q)


def test_scale_must_be_a_number():
    q = torch.randn(1, 1, 10, 8)
    with pytest.raises(flexspec.BindingError, match="scale must be a finite number"):
        flexspec.compile("causal")(q, q, q, scale="0.5")
    with pytest.raises(flexspec.BindingError, match="scale must be a finite number"):
        flexspec.compile("causal")(q, q, q, scale=math.nan)


# ---- explain ------------------------------------------------------------------------------------


def test_explain_counts_exactly():
    q, k, v = Shape(2, 4, 2, 200, 300, 16).qkv(seed=0)
    attn = flexspec.compile("causal & window(20)")
    explanation = attn.explain(q, k, v)
    rows = torch.arange(200).reshape(-1, 1)
    cols = torch.arange(300).reshape(1, -1)
    visible = int(((rows >= cols) & (rows - cols <= 20)).sum())
    assert explanation.density == visible / (200 * 300)
    assert explanation.flops == 2 * 2 * 4 * visible * (16 + 16)
    text = str(explanation)
    assert "B=2 H=4 (KV heads 2) Q_LEN=200 KV_LEN=300 D=16 float32 on cpu" in text
    assert "backend:  flex" in text and "not sdpa: SDPA runs only" in text
    # no row sees a key past 199: the call reads keys 0..199 only, and says so
    assert explanation.keys == (0, 200, 300) and "only 0:200 of the 300 keys are read" in text


def test_explain_with_batch_dependent_bindings_counts_every_row():
    attn = flexspec.compile("document")
    q, k, v = Shape(2, 1, 1, 100, 100, 8).qkv(seed=0)
    ids = torch.stack([torch.arange(100) // 50, torch.arange(100) // 25])  # 2 and 4 documents
    explanation = attn.explain(q, k, v, doc_ids=ids)
    dense = attn.dense_mask(100, 100, batch=2, doc_ids=ids)
    assert explanation.density == dense.float().mean().item() == (0.5 + 0.25) / 2


def test_the_plan_is_reused_and_fresh_bindings_still_count(monkeypatch):
    attn = flexspec.compile("causal & document")
    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=0)
    first = torch.arange(200) // 50
    assert attn.explain(q, k, v, doc_ids=first).choice.backend == "flex"
    attn(q, k, v, doc_ids=first)
    plans = []
    original = attn._calls.plan
    monkeypatch.setattr(attn._calls, "plan", lambda *a: plans.append(1) or original(*a))
    second = torch.arange(200) // 10
    out = attn(q, k, v, doc_ids=second)
    assert plans == []
    torch.testing.assert_close(out, attn.reference(q, k, v, doc_ids=second), atol=2e-5,
                               rtol=1e-5)
    second.fill_(0)  # in place: the version counter changes, so the block mask is rebuilt
    torch.testing.assert_close(attn(q, k, v, doc_ids=second),
                               attn.reference(q, k, v, doc_ids=second), atol=2e-5, rtol=1e-5)



def test_a_score_binding_is_read_at_every_call(eager_kernels):
    # the same compiled object with new slopes: a score_mod kept in the plan would keep the old
    # ones (found by mutation testing); new mask bindings and new score bindings together too
    attn = flexspec.compile("causal & document + alibi(slopes=s)")
    q, k, v = Shape(1, 2, 2, 130, 130, 8).qkv(seed=5)
    ids = torch.arange(130) // 40
    calls = [(ids, torch.tensor([0.5, 0.25])), (ids, torch.tensor([2.0, -1.0])),
             (torch.arange(130) // 70, torch.tensor([0.1, 3.0]))]
    for doc_ids, slopes in calls + calls[:1]:
        assert attn.explain(q, k, v, doc_ids=doc_ids, s=slopes).choice.backend == "flex"
        with torch.no_grad():
            out = attn(q, k, v, doc_ids=doc_ids, s=slopes)
        torch.testing.assert_close(out, attn.reference(q, k, v, doc_ids=doc_ids, s=slopes),
                                   atol=2e-5, rtol=1e-5)

def test_a_reused_plan_still_checks_value_dependent_indices():
    from flexspec.lang.library import load_text

    library = load_text("mask same_group(group: int[KV_LEN]) = group[group[q]] == group[kv]\n")
    attn = flexspec.compile("same_group", library=library, backend="reference")
    q = torch.randn(1, 1, 8, 4)
    attn(q, q, q, group=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(flexspec.BindingError, match="'group' is indexed by group\\[q\\]"):
        attn(q, q, q, group=torch.full((8,), 9, dtype=torch.int64))


def test_inputs_requiring_gradients_under_no_grad_run_the_kernel():
    attn = flexspec.compile("causal & window(8)")
    q, k, v = (t.requires_grad_() for t in Shape(1, 2, 2, 200, 200, 8).qkv(seed=0))
    with torch.no_grad():
        assert attn.explain(q, k, v).choice.backend == "flex"
        out = attn(q, k, v)
    torch.testing.assert_close(out, attn.reference(q, k, v).detach(), atol=2e-5, rtol=1e-5)


def test_auto_falls_back_to_flex_when_flash_cannot_compile(monkeypatch):
    """Simulated on the CPU: the plan is told to take FLASH until FLASH has failed, and its
    compile fails the way CuTeDSL's did for a clamped lookup. The plan is made anew without
    FLASH, once, and the failure is remembered."""
    from flexspec.runtime import compiled, notices, plan as planning
    from flexspec.runtime.backends import Choice, flash

    monkeypatch.setattr(planning, "FAILURES", planning.Failures())
    # the warning is given once per process: a second run in one process (mutmut runs the
    # tests twice) must see it again
    monkeypatch.setattr(notices, "_warned", set())
    real_choose = planning.choose
    monkeypatch.setattr(planning, "choose", lambda backend, request, spec, vetoes=True: (
        real_choose(backend, request, spec) if request.failure("flash")
        else Choice("flash", "test")))
    real = compiled.run_compiled

    def compile_or_fail(entry, *args):
        if args[-3] == flash.OPTIONS:  # (..., kernel_options, lse, pinned)
            raise RuntimeError("backend='inductor' raised:\n=====\nCuteDSL template failed: "
                               "UNSUPPORTED CUTEDSL OPERATION: 'maximum'\nmore")
        return real(entry, *args)

    monkeypatch.setattr(compiled, "run_compiled", compile_or_fail)
    attn = flexspec.compile("causal & window(8)")
    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=0)
    with pytest.warns(UserWarning, match="backend 'flash' could not compile 'causal & "
                                         "window\\(8\\)' \\(CuteDSL template failed.*\\); "
                                         "running it on 'flex' instead"):
        out = attn(q, k, v)
    torch.testing.assert_close(out, attn.reference(q, k, v), atol=2e-5, rtol=1e-5)
    (plan,) = attn._calls.plans.values()
    assert plan.choice.backend == "flex" and plan.backend.name == "flex"
    assert "failed to compile this spec before" in dict(plan.choice.rejected)["flash"]
    assert "'maximum'" in dict(planning.FAILURES.of(plan.spec))["flash"]
    attn(q, k, v)  # the new plan is kept: no second failure, no second plan
    assert len(planning.FAILURES) == 1 and len(attn._calls.plans.values()) == 1
    # asked for explicitly, the same failure is an error that says so
    explicit = flexspec.compile("causal & window(9)", backend="flash")
    with pytest.raises(BackendError, match="backend 'flash' could not compile this spec: "
                                           "CuteDSL template failed"):
        explicit(q, k, v)


def test_a_compile_torch_gives_up_on_is_a_flexspec_error(monkeypatch):
    # no raw dynamo or inductor exception reaches the caller: simulated with the error dynamo
    # raised for a NaN compared with a symbolic length (before the simplifier folded it)
    from torch._dynamo.exc import TorchRuntimeError
    from flexspec.runtime import compiled, plan as planning

    def fail(entry, *args):
        raise TorchRuntimeError("RuntimeError when making fake tensor call\n  Explanation: "
                                "Invalid NaN comparison")
    monkeypatch.setattr(compiled, "run_compiled", fail)
    monkeypatch.setattr(planning, "FAILURES", planning.Failures())  # this test's alone
    attn = flexspec.compile("causal & window(8)", backend="flex")
    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=0)
    with pytest.raises(BackendError, match=r"backend 'flex' could not compile this spec: "
                                           r"torch.compile failed \(RuntimeError when making "
                                           r"fake tensor call Explanation: Invalid NaN") as info:
        attn(q, k, v)
    assert "backend='reference' computes it" in str(info.value)
    # under auto, the call runs on the next backend that can, and says so
    auto = flexspec.compile("causal & window(10)")
    with pytest.warns(UserWarning, match=r"backend 'flex' could not compile 'causal & "
                                         r"window\(10\)' \(torch.compile failed \(RuntimeError "
                                         r"when making fake tensor call.*\); running it on "):
        out = auto(q, k, v)
    torch.testing.assert_close(out, auto.reference(q, k, v), atol=2e-5, rtol=1e-5)
    (plan,) = auto._calls.plans.values()
    assert plan.backend.name != "flex"
    assert "failed to compile this spec before" in dict(plan.choice.rejected)["flex"]
    # other errors pass through as they are
    monkeypatch.setattr(compiled, "run_compiled", lambda entry, *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        flexspec.compile("causal & window(9)")(q, k, v)


def test_a_remembered_flash_failure_is_a_reason():
    request = dataclasses.replace(H200, failed=(("flash", "CuteDSL template failed: 'maximum'"),))
    choice = choose("auto", request, ir("causal & chunked(8)"))
    assert choice.backend == "flex"
    assert dict(choice.rejected)["flash"] == ("it failed to compile this spec before: CuteDSL "
                                              "template failed: 'maximum'")
    with pytest.raises(BackendError, match="backend 'flash' cannot run this call: it failed"):
        choose("flash", request, ir("causal & chunked(8)"))


def test_the_same_binding_object_reuses_its_block_mask(monkeypatch):
    attn = flexspec.compile("causal & document")
    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=0)
    ids = torch.arange(200) // 50
    attn(q, k, v, doc_ids=ids)
    builds = []
    original = attn._calls.masks.get
    monkeypatch.setattr(attn._calls.masks, "get", lambda *a: builds.append(1) or original(*a))
    attn(q, k, v, doc_ids=ids)
    assert builds == []  # same tensor, same version: no lookup at all
    ids[:100] = 0  # in place: the version counter moves on
    out = attn(q, k, v, doc_ids=ids)
    assert builds == [1]
    torch.testing.assert_close(out, attn.reference(q, k, v, doc_ids=ids), atol=2e-5, rtol=1e-5)


def test_runtime_errors_are_exported_at_the_top_level():
    assert flexspec.BackendError is flexspec.runtime.BackendError
    assert issubclass(flexspec.BackendError, flexspec.SpecError)
    assert issubclass(flexspec.CompileLimitError, flexspec.SpecError)
    with pytest.raises(flexspec.BackendError):
        flexspec.compile("causal & window(3)", backend="sdpa")


@pytest.mark.parametrize("text, scale", [("causal", 0.0), ("causal", 1e-300),
                                         ("causal", -1e-45), ("causal + scale(1e-40)", None)])
def test_a_scale_that_rounds_to_zero_is_finite(text, scale):
    """Red-team finding: causal with scale=0.0 (and causal + scale(1e-300)) ran on SDPA and gave
    NaN; every key then weighs the same, as the reference says. (scale(1e-300) itself is now a
    check error: beyond float32.)"""
    attn = flexspec.compile(text)
    q, k, v = Shape(1, 2, 2, 200, 200, 16).qkv(0)
    with torch.no_grad():
        out = attn(q, k, v, scale=scale)
    assert attn.explain(q, k, v, scale=scale).choice.backend != "sdpa"
    torch.testing.assert_close(out, attn.reference(q, k, v, scale=scale), rtol=1e-4, atol=1e-4)


def test_sdpa_decoding_steps_leave_cudnn_out(monkeypatch):
    """cuDNN builds a plan for every new key length (about 60 ms a step on the H200): calls of
    at most DECODING_ROWS query rows on CUDA run SDPA inside sdpa_kernel without it. Checked on
    the CPU by recording what the backend asks torch for."""
    from flexspec.runtime.backends import sdpa

    asked = []
    monkeypatch.setattr(sdpa, "sdpa_kernel", lambda kernels: asked.append(kernels) or
                        __import__("contextlib").nullcontext())

    class FakeCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    attn = flexspec.compile("full", backend="sdpa")
    q, k, v = Shape(1, 2, 2, 1, 50, 16).qkv(0)
    with torch.no_grad():
        out = attn(q.as_subclass(FakeCuda), k, v)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), attn.reference(q, k, v))
    assert asked and torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in asked[0]


@pytest.mark.parametrize("batch, kv_heads, calls", [(20, 8, [16, 4]), (16, 8, [16]),
                                                    (5, 32, [4, 1]), (3, 256, [1, 1, 1])])
def test_sdpa_decoding_runs_in_runs_of_batch_rows(monkeypatch, batch, kv_heads, calls):
    """On the H200 one SDPA decoding call (no cuDNN) over more than 128 (batch row, KV head)
    pairs ran up to 1.8x slower than the same rows in runs of 128 pairs: a decoding call on
    CUDA runs as one SDPA call per run. Checked on the CPU with a tensor that says it is on
    CUDA, against the reference."""
    from flexspec.runtime.backends import sdpa

    seen = []
    attend = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention",
                        lambda q, *args, **kwargs: seen.append(q.shape[0]) or attend(
                            q, *args, **kwargs))

    class FakeCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    attn = flexspec.compile("full", backend="sdpa")
    q, k, v = Shape(batch, 2 * kv_heads, kv_heads, 1, 20, 8).qkv(0)
    with torch.no_grad():
        out = attn(q.as_subclass(FakeCuda), k, v)
    assert seen == calls
    torch.testing.assert_close(out.as_subclass(torch.Tensor), attn.reference(q, k, v))


def test_return_lse_on_the_cpu_runs_on_the_reference():
    """Red-team 2026-12-02, item 4: at 128+ positions auto picked flex, whose CPU kernel has no
    log-sum-exp (a BackendError wrapping torch's 'return_lse is not supported yet')."""
    attn = flexspec.compile("causal & window(30) + alibi")
    q, k, v = Shape(1, 2, 2, 200, 200, 8).qkv(seed=2)
    explanation = attn.explain(q, k, v, return_lse=True)
    assert explanation.choice.backend == "reference"
    assert "log-sum-exp" in dict(explanation.choice.rejected)["flex"]
    out, lse = attn(q, k, v, return_lse=True)
    want, want_lse = attn.reference(q, k, v, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    assert attn.explain(q, k, v).choice.backend == "flex"  # without the lse, the kernel
    with pytest.raises(BackendError, match="does not return the log-sum-exp"):
        flexspec.compile("causal & window(30)", backend="flex")(q, k, v, return_lse=True)


@pytest.mark.parametrize("q_len, kv_len", [(40, 200), (200, 40), (127, 500)])
def test_the_short_cpu_rule_holds_when_one_length_is_short(q_len, kv_len):
    """Blind spot: the rule was tested with both lengths short."""
    request = dataclasses.replace(CPU, q_len=q_len, kv_len=kv_len)
    assert "shorter than one block" in why_not("flex", request, ir("causal & window(8)"))
    assert choose("auto", request, ir("causal & window(8)")).backend == "reference"
    assert why_not("flex", dataclasses.replace(CPU, q_len=128, kv_len=500),
                   ir("causal & window(8)")) is None


def test_explain_counts_every_pair_for_a_dense_backend():
    """First-hour review: explain --grad reported sparse work while choosing the dense
    reference, which computes every pair."""
    attn = flexspec.compile("causal & window(8)")
    q, k, v = (t.requires_grad_() for t in Shape(1, 2, 2, 200, 200, 8).qkv(seed=0))
    sparse = attn.explain(q.detach(), k.detach(), v.detach())
    dense = attn.explain(q, k, v)
    assert (sparse.choice.backend, dense.choice.backend) == ("flex", "reference")
    assert sparse.density == dense.density  # what is visible does not change
    assert sparse.flops == attention_flops(sparse.density * 2 * 200 * 200, 8, 8, backward=False)
    assert dense.flops == attention_flops(2 * 200 * 200, 8, 8, backward=False)
    assert "every pair computed" in str(dense) and "tiles computed" in str(sparse)


# ---- the choice's other backends ----------------------------------------------------------------


def test_a_backend_asked_for_lists_the_others_auto_would_take_best_first():
    # on Hopper with FA4, auto's order is fa4, flash, sdpa, flex; sdpa cannot run a window
    choice = choose("flex", H200, ir("causal & window(1024)"))
    assert (choice.backend, choice.reason) == ("flex", "backend='flex' was asked for")
    assert [name for name, _ in choice.viable] == ["fa4", "flash"]
    assert choice.viable[0][1].startswith("FA4's own kernels ran this structure")
    assert choice.viable[1][1].startswith("FlashAttention-4 was the fastest kernel")
    # on the CPU (sdpa, flex, reference): every one that can run causal, but itself
    assert [name for name, _ in choose("reference", CPU, ir("causal")).viable] == ["sdpa", "flex"]
    assert [name for name, _ in choose("sdpa", CPU, ir("causal")).viable] == ["flex", "reference"]
    # a backend auto passes over as slower is not among them
    small = dataclasses.replace(H200, batch=1, heads=4, q_len=1024, kv_len=1024)
    assert [name for name, _ in choose("flex", small, ir("causal")).viable] == ["sdpa"]


def test_a_backend_auto_passes_over_after_the_chosen_one_says_why(monkeypatch):
    from flexspec.runtime import order
    # an order where fa4 comes after flex: at this small size fa4 is vetoed as slower, and
    # the choice says so rather than "ranked lower"
    rows = (order.Row(("cuda",), "any", "flex", "flex first"),
            order.Row(("cuda",), "any", "fa4", "fa4 second"))
    monkeypatch.setattr(order, "ORDER", rows)
    small = dataclasses.replace(H200, batch=1, heads=4, q_len=1024, kv_len=1024)
    choice = choose("auto", small, ir("causal"))
    assert choice.backend == "flex"
    rejected = dict(choice.rejected)
    assert rejected["fa4"].startswith("the problem is small")
    assert "fixed cost per call outweighs its speed" in rejected["fa4"]
    assert rejected["reference"] == "ranked lower for this call"


def test_explain_says_which_kernel_a_decode_call_runs_on_a_gpu():
    """Planned on the CPU for a CUDA GPU: a decoded token runs on FlexAttention's decoding
    kernel (explain names it and its options), a call with gradients on its main kernel (and
    says why), a call of 128 rows names no kernel."""
    attn = flexspec.compile("causal & (window(100) | sink(4)) + alibi")
    q = torch.randn(2, 8, 1, 64)
    k = torch.randn(2, 2, 3000, 64)
    text = str(attn.explain(q, k, k, q_offset=2999, target="cuda", capability=(9, 0)))
    assert "backend:  flex" in text
    assert ("kernel:   FlexAttention's decoding kernel (split-KV: the keys of each row are shared "
            "among the kernel's programs), 3 pipeline stages, full tiles listed as partial") in text
    grads = str(attn.explain(q.requires_grad_(), k, k, q_offset=2999, target="cuda",
                             capability=(9, 0)))
    assert "kernel:   FlexAttention's main kernel, though the call has fewer than 128 rows: the " \
           "call needs gradients" in grads
    assert "kernel:" not in str(attn.explain(torch.randn(2, 8, 128, 64), k, k, q_offset=2872,
                                             target="cuda", capability=(9, 0)))
    assert "kernel:" not in str(attn.explain(q.detach(), k, k, q_offset=2999))  # on the CPU


# ---- mutation testing of runtime/backends/sdpa --------------------------------------------------


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the launch's device test, without a GPU."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("rows, restricted", [(1, True), (16, True), (17, False)])
def test_sdpa_leaves_cudnn_out_for_calls_of_up_to_sixteen_rows_on_cuda_only(rows, restricted,
                                                                            monkeypatch):
    """Up to DECODING_ROWS (16) query rows on CUDA, SDPA runs inside sdpa_kernel without cuDNN,
    with the call's causal flag, scale and grouped heads; more rows, or the CPU, run it as is."""
    from flexspec.runtime.backends import sdpa

    assert sdpa.DECODING_ROWS == 16
    asked = []
    monkeypatch.setattr(sdpa, "sdpa_kernel", lambda kernels: asked.append(kernels) or
                        __import__("contextlib").nullcontext())
    attn = flexspec.compile("causal + scale(0.5)", backend="sdpa")
    q, k, v = Shape(2, 4, 2, rows, rows, 16).qkv(seed=3)
    want = attn.reference(q, k, v, scale=0.3)
    with torch.no_grad():
        out = attn(q.as_subclass(FakeCuda), k, v, scale=0.3)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), want, rtol=1e-5, atol=1e-5)
    SDPBackend = torch.nn.attention.SDPBackend
    assert asked == ([[SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH]] if restricted else [])
    asked.clear()
    with torch.no_grad():  # on the CPU, never
        torch.testing.assert_close(attn(q, k, v, scale=0.3), want, rtol=1e-5, atol=1e-5)
    assert asked == []


def test_sdpa_refuses_a_scale_below_the_smallest_normal_float32_saying_it_whole():
    from flexspec.runtime.backends.sdpa import SMALLEST_SCALE

    sdpa = REGISTRY["sdpa"]
    assert SMALLEST_SCALE == 2.0 ** -126
    causal = ir("causal")
    assert sdpa.why_not(dataclasses.replace(CPU, scale=SMALLEST_SCALE), causal) is None
    below = math.nextafter(SMALLEST_SCALE, 0.0)
    assert sdpa.why_not(dataclasses.replace(CPU, scale=below), causal) == \
        f"SDPA returns NaN for a scale that rounds to zero in float32 ({below!r})"
    # without a scale, 1 / sqrt(D) times the spec's factor: 6e-38 / 8 at D = 64 is below,
    # 6e-38 / 4 at D = 16 is not
    tiny = ir("causal + scale(6e-38)")
    assert CPU.head_dim == 64 and CPU.scale is None
    assert sdpa.why_not(CPU, tiny) == \
        "SDPA returns NaN for a scale that rounds to zero in float32 (7.5e-39)"
    assert sdpa.why_not(dataclasses.replace(CPU, head_dim=16, v_head_dim=16), tiny) is None


def test_sdpa_says_in_full_that_it_returns_no_log_sum_exp():
    assert REGISTRY["sdpa"].why_not(dataclasses.replace(CPU, lse=True), ir("causal")) == \
        "SDPA does not return the log-sum-exp that return_lse=True asks for"


# ---- mutation testing of runtime/backends/flex --------------------------------------------------


def test_flex_says_why_it_cannot_run_each_call_in_full():
    flex, window = REGISTRY["flex"], ir("causal & window(8)")
    for device in ("cpu", "mps"):
        request = dataclasses.replace(CPU, device_type=device, grads=True)
        assert flex.why_not(request, window) == f"FlexAttention has no backward pass on {device}"
    training = dataclasses.replace(H200, block_size=(64, 128), grads=True)
    assert flex.why_not(training, window) == (
        "FlexAttention's Triton backward finds no kernel for blocks of 64x128: use "
        "block_size=128 for training, or call without gradients")
    assert flex.why_not(dataclasses.replace(CPU, lse=True), window) == (
        "torch's compiled CPU FlexAttention does not return the log-sum-exp "
        "(flexspec.workarounds: cpu-flex-lse): return_lse=True runs on the dense reference on "
        "the CPU")
    assert flex.why_not(dataclasses.replace(CPU, q_len=127), window) == (
        "torch's compiled CPU FlexAttention is wrong for sequences shorter than one block (128 "
        "positions; flexspec.workarounds: cpu-short-sequences), so flexspec does not run it "
        "there")
    # the others run it: gradients on CUDA and XPU, the log-sum-exp on CUDA, short on CUDA
    for request in (dataclasses.replace(H200, grads=True), dataclasses.replace(H200, lse=True),
                    dataclasses.replace(CPU, device_type="xpu", grads=True),
                    dataclasses.replace(H200, q_len=1, kv_len=1)):
        assert flex.why_not(request, window) is None


def test_flex_computes_positions_in_int32_on_cuda_only():
    flex = REGISTRY["flex"]
    assert flex.index_dtype("cuda") == "int32"
    assert flex.index_dtype("cpu") == flex.index_dtype("xpu") == "int64"


def test_flex_forces_the_main_kernel_for_few_rows_over_keys_indexed_in_int64():
    """FlexAttention's decoding kernel (fewer than 128 query rows) does not compile where
    inductor indexes the keys in int64 (2**31 elements or more: flexspec.workarounds,
    flex-decoding-wide-indices): such calls get FORCE_USE_FLEX_ATTENTION on CUDA."""
    flex = REGISTRY["flex"]
    # 4 rows x 16 heads x 2**18 keys x 128 = 2**31 elements; one key fewer per row is not wide
    wide = dataclasses.replace(H200, q_len=1, kv_len=2**18)
    narrow = dataclasses.replace(wide, kv_len=2**18 - 1)
    assert 4 * 16 * 2**18 * 128 == 2**31
    assert flex.kernel_options(wide) == {"FORCE_USE_FLEX_ATTENTION": True}
    assert flex.kernel_options(dataclasses.replace(wide, q_len=127)) == \
        {"FORCE_USE_FLEX_ATTENTION": True}
    assert flex.kernel_options(dataclasses.replace(wide, q_len=128)) is None
    assert flex.kernel_options(narrow) is None
    assert flex.kernel_options(dataclasses.replace(narrow, q_len=8192)) is None
    for device in ("cpu", "xpu"):
        assert flex.kernel_options(dataclasses.replace(wide, device_type=device)) is None


def test_a_decode_call_over_keys_too_wide_runs_as_runs_of_batch_rows():
    """The batch rows of a decode call whose keys would be indexed in int64 are cut into runs
    whose keys are not (the decoding kernel compiles for those): as few runs as that takes, of
    equal length but the last, and none for other calls."""
    from flexspec.runtime.flexattention import WIDE_INDEX_ELEMENTS, wide_decode_chunks

    def meta(batch, q_len=1, kv_len=2**18, heads=16, dim=128, v_dim=128, grad=False):
        q = torch.empty(batch, heads, q_len, dim, device="meta", requires_grad=grad)
        k = torch.empty(batch, heads, kv_len, dim, device="meta")
        return q, k, torch.empty(batch, heads, kv_len, v_dim, device="meta")
    assert 4 * 16 * 2**18 * 128 == WIDE_INDEX_ELEMENTS  # 4 rows: wide; 3 rows: not
    assert wide_decode_chunks(*meta(4)) == [(0, 2), (2, 4)]
    assert wide_decode_chunks(*meta(3)) is None
    assert wide_decode_chunks(*meta(7)) == [(0, 3), (3, 6), (6, 7)]
    assert wide_decode_chunks(*meta(64, kv_len=2**15, heads=8)) == [(0, 32), (32, 64)]
    assert wide_decode_chunks(*meta(2, v_dim=256)) == [(0, 1), (1, 2)]  # the wider head size
    assert wide_decode_chunks(*meta(4, q_len=128)) is None  # the main kernel's rows
    assert wide_decode_chunks(*meta(4, grad=True)) is None  # a backward
    assert wide_decode_chunks(*meta(1, kv_len=2**22)) is None  # one row is wide: no cut


@pytest.mark.parametrize("text", ["causal & doc", "causal + alibi", "sliding_window(7)"])
def test_decode_calls_cut_into_runs_of_rows_equal_the_reference(monkeypatch, text):
    """With the width at which keys count as too wide lowered to two batch rows' keys, a decode
    call of five rows runs as three calls (rows 0-1, 2-3, 4), each with its rows' offsets,
    lengths and doc_ids: the outputs and log-sum-exps equal the float64 reference of the whole
    call."""
    from flexspec.runtime import flexattention
    batch, heads, kv_heads, kv_len, dim = 5, 4, 2, 40, 8
    monkeypatch.setattr(flexattention, "WIDE_INDEX_ELEMENTS", 3 * kv_heads * kv_len * dim)
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(batch, heads, 2, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, kv_len, dim, generator=generator) for _ in range(2))
    lengths = torch.tensor([40, 33, 20, 38, 9])
    offsets = lengths - 2
    extra = {}
    if "doc" in text:
        extra["doc_ids"] = torch.randint(0, 3, (batch, kv_len), generator=generator).sort().values
    attn = flexspec.compile(text)
    seen = []
    call = attn._calls._call

    def spy(q, *args, **kwargs):
        seen.append(q.shape[0])
        return call(q, *args, **kwargs)
    monkeypatch.setattr(attn._calls, "_call", spy)
    out, lse = attn(q, k, v, q_offset=offsets, kv_lengths=lengths, return_lse=True, **extra)
    assert seen == [2, 2, 1]
    want, want_lse = attn.reference(q.double(), k.double(), v.double(), q_offset=offsets,
                                    kv_lengths=lengths, return_lse=True, **extra)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    # explain says so, and explains the first run's call
    explained = attn.explain(q, k, v, q_offset=offsets, kv_lengths=lengths, **extra)
    assert explained.runs == (5, 3, 2) and explained.sizes["B"] == 2
    assert "runs:     the call's 5 batch rows run as 3 calls of up to 2 rows" in str(explained)


def test_flex_gives_xpu_small_tiles_and_table_gradients_one_stage_above_64_dimensions():
    flex = REGISTRY["flex"]
    small = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 32, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32,
             "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 32}
    for device in ("cuda", "xpu"):
        request = dataclasses.replace(H200, device_type=device, block_size=(64, 96))
        assert flex.kernel_options(request) == small
    assert flex.kernel_options(dataclasses.replace(CPU, block_size=(64, 96))) is None
    # the Triton backward of a score reading a tensor that requires gradients: one stage on
    # CUDA at head dimensions above 64 (flexspec.workarounds: triton-table-grad-stages)
    tables = dataclasses.replace(H200, grads=True, table_grads=True)
    for head_dim, options in ((128, {"num_stages": 1}), (65, {"num_stages": 1}), (64, None)):
        assert flex.kernel_options(dataclasses.replace(tables, head_dim=head_dim,
                                                       v_head_dim=head_dim)) == options
    assert flex.kernel_options(dataclasses.replace(tables, device_type="xpu")) is None


def test_a_compile_torch_gives_up_on_says_so_in_full():
    from torch._dynamo.exc import TorchRuntimeError

    flex = REGISTRY["flex"]
    with pytest.raises(BackendError) as info:
        flex.compile_failed(None, TorchRuntimeError("Invalid NaN comparison"))
    assert str(info.value) == (
        "backend 'flex' could not compile this spec: torch.compile failed (Invalid NaN "
        "comparison). This is a limit of the compiled path (torch's compiler, or flexspec's "
        "lowering for it), not an error in the spec: please report it; backend='reference' "
        "computes it densely (float64 math, memory growing as Q_LEN x KV_LEN)")
    assert isinstance(info.value.__cause__, TorchRuntimeError)
