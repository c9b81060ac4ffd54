"""transformers ``generate()`` on a GPU: milliseconds per new token with flexspec against
transformers' own ``sdpa`` and ``flex_attention``.

Two randomly initialised 2-layer models (bf16, hidden 2048, 16 heads, 8 KV heads, head_dim 128,
no download): Llama-shaped, and Mistral-shaped with a 4096-token sliding window. The batch is 8
prompts of random lengths between 2K and 4K tokens, left-padded; greedy decoding of 64 new
tokens (no end-of-sequence stop). Three ways of running it:

* ``dynamic``: transformers' default cache, growing by one key per step;
* ``static``: ``cache_implementation="static"`` with transformers' automatic compile turned off
  (``disable_compile=True``): fixed shapes, eager;
* ``static+compiled``: the static cache with the forward compiled as transformers does by itself
  on CUDA (``torch.compile(..., mode="reduce-overhead")``: CUDA graphs).

The time per token is ``(t(64 tokens) - t(1 token)) / 63``, each ``t`` the median of three timed
``generate()`` calls after a warm one, so the prompt's prefill cancels. Before each timed call
flexspec forgets its plans, as a new batch of prompts would find none for its lengths (every
step of a growing cache is a new key length; the warm call made plans for exactly the lengths
the timed calls repeat). Tables before the twenty-first session reused them. ``same as sdpa`` counts the
rows whose tokens equal sdpa's (bf16: a row may differ where two logits nearly tie). ``graphs
recorded`` counts the CUDA graphs that CUDA graph trees recorded during the timed long calls,
per call (``static+compiled`` only): one a step means the graph takes an int that moves every
step, and each call records again what a replay would run. The last lines printed are the
table (markdown).

``--profile N`` then runs cProfile over one more timed ``generate()`` of each flexspec row and
prints the N functions with the most time of their own, in microseconds per new token (the
profiler's own cost inflates every Python call: read the shares, not the sums), then the N of
flexspec's own functions with the most cumulative time, and the same for sdpa's row where it
was run, so the two host paths can be compared.

``--layers N`` builds the models with N layers instead of 2 (the issue's shape): a real model's
16 to 80 layers weigh what each layer's call costs (its compiled kernel's launch) against what
a step pays once (a growing cache's new plan), which two layers hide.

``--stages`` times one more ``generate()`` of each sdpa and flexspec row with a clock around
the model's attention layers and around the pieces of flexspec's call path (plans, block
masks, the first call of a plan, the compiled-code lookups and the code they find as it runs,
the calls through dynamo), and prints microseconds and calls per new token, each piece
including what it calls. Unlike cProfile it costs about a microsecond per timed call and
times nothing else; on a GPU the times are the host's (kernels are queued, not waited for),
so a piece that waits for the GPU shows as long.

``--trace N`` runs torch.profiler over one more ``generate()`` of each sdpa and flexspec row and
prints, per new token, the CUDA runtime calls (kernel launches, stream synchronisations,
copies, allocations: a host read shows here) and the N operators with the most host time of
their own (compiled graphs' wrappers and Triton launches included). cProfile charges dynamo's
compiled code to the Python function that ran before it (``Replay.of`` showed milliseconds it
does not take), so ``--stages`` and ``--trace`` are the ones to read for the compiled paths.

    python benchmarks/generate.py
    python benchmarks/generate.py --models mistral --modes dynamic --tokens 16
    python benchmarks/generate.py --models mistral --modes dynamic --tokens 32 --stages
    python benchmarks/generate.py --models llama --modes dynamic --tokens 32 --layers 16
    python benchmarks/generate.py --models mistral --modes dynamic --tokens 32 --profile 30
    python benchmarks/generate.py --models mistral --modes dynamic --tokens 32 --trace 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexspec.integrations import transformers as integration  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=8192)
MODES = ["dynamic", "static", "static+compiled"]
IMPLEMENTATIONS = ["sdpa", "flex_attention", "flexspec"]
BATCH, SHORTEST, LONGEST = 8, 2048, 4096
REPEATS = 3


def model(kind: str, implementation: str, device, layers: int = SHAPE["num_hidden_layers"]):
    import transformers
    shape = {**SHAPE, "num_hidden_layers": layers}
    if kind == "llama":
        config = transformers.LlamaConfig(**shape)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.MistralConfig(sliding_window=4096, **shape)
        cls = transformers.MistralForCausalLM
    torch.manual_seed(0)  # the same weights for every implementation
    built = cls(config).to(device, torch.bfloat16).eval()
    built.set_attn_implementation(implementation)
    return built


def prompts(device):
    """``BATCH`` left-padded prompts of random lengths in [SHORTEST, LONGEST]."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (BATCH,), generator=generator)
    ids = torch.randint(1, SHAPE["vocab_size"], (BATCH, int(lengths.max())), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths.tolist()):
        mask[row, ids.shape[1] - length:] = 1
    ids = ids * mask  # padding holds token 0
    return ids.to(device), mask.to(device)


def configure(built, mode: str) -> None:
    config = built.generation_config
    config.eos_token_id, config.pad_token_id, config.do_sample = None, 0, False
    if mode.startswith("static"):
        config.cache_implementation = "static"
        config.disable_compile = mode == "static"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def generate(built, ids, mask, tokens: int) -> tuple:
    _sync(ids.device)
    started = time.perf_counter()
    with torch.no_grad():
        out = built.generate(ids, attention_mask=mask, max_new_tokens=tokens,
                             min_new_tokens=tokens)
    _sync(ids.device)
    return (time.perf_counter() - started) * 1e3, out


class Recordings:
    """Counts the graphs CUDA graph trees record while it is entered."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        from torch._inductor import cudagraph_trees
        self._manager = cudagraph_trees.CUDAGraphTreeManager
        self._record = record = self._manager.record_function

        def counted(manager, *args, **kwargs):
            self.count += 1
            return record(manager, *args, **kwargs)
        self._manager.record_function = counted
        return self

    def __exit__(self, *exc):
        self._manager.record_function = self._record


def fresh(run, *args):
    """``run(*args)`` after flexspec's attention forgot its plans (a private reach into the
    registered layers: a benchmark's diagnostic, not an API)."""
    for attn in integration._REGISTERED["flexspec"]._compiled.values():
        attn._calls.forget_plans()
    return run(*args)


def _stage_points(built) -> list:
    """``(label, owner, attribute)`` of what ``--stages`` times: the model's attention layer,
    then flexspec's call path, outermost first."""
    from flexspec.kernels import fused_blocks, replay
    from flexspec.runtime import bindings, calls, compiled, flexattention, masks, plan
    return [
        ("attention layer (the model's forward)", type(built.model.layers[0].self_attn),
         "forward"),
        ("flexspec call", calls.Calls, "__call__"),
        ("  placed (the step's positions, made by its first layer)", calls.Calls, "_placed"),
        ("  plan: lookup, or made", calls.Calls, "_plan_for"),
        ("    the plan's key", calls, "call_key"),
        ("    made (make_plan)", calls, "make_plan"),
        ("      bindings gathered", bindings.Tensors, "gather"),
        ("      lookups' check made", plan, "LookupCheck"),
        ("      backend chosen", plan, "choose"),
        ("      ranges checked", plan, "check_ranges"),
        ("      block-mask handle bound", masks.MaskCache, "bind"),
        ("      backend's state prepared", flexattention.FlexAttentionBackend, "prepare"),
        ("  block mask: cached, or built", masks.MaskCache, "get"),
        ("    built", masks.MaskCache, "_build"),
        ("      by the compiled program", fused_blocks, "fused_block_mask"),
        ("        keys padded to whole tiles", fused_blocks, "_whole_tiles"),
        ("        the program run (replayed, or through dynamo)", replay.ExactReplays, "call"),
        ("        the BlockMask made of its tables", fused_blocks, "from_tables"),
        ("  a plan's call (FlexAttention backend)", flexattention.FlexAttentionBackend, "run"),
        ("    compiled code looked up (Replay.of)", replay.Replay, "of"),
        ("    through dynamo (run_compiled)", compiled, "run_compiled"),
        ("    a warm plan's call (warm_call)", flexattention, "warm_call"),
        ("    lengths marked dynamic", compiled, "mark_lengths_dynamic"),
        ("    batch marked static", compiled, "mark_batch_static"),
        ("  a step's later layer: launch made", flexattention.FlexAttentionBackend,
         "launcher"),
        ("the compiled call code found, run (any layer)", replay, "cached_code"),
    ]


def _attribute(owner, name: str):
    """What ``owner`` holds under ``name`` as stored (a class's own ``classmethod`` object, not
    the bound method), so that it can be put back as it was."""
    return vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)


def _clocked(function, slot: list):
    if getattr(function, "__name__", "") == "cached_code":
        # what is timed is the compiled code it finds, at each run (the lookup is Replay.of)
        def found(*args, **kwargs):
            code = function(*args, **kwargs)
            return None if code is None else _clocked(code, slot)
        return found

    def clocked(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            slot[0] += time.perf_counter() - started
            slot[1] += 1
    return clocked


def stages(built, ids, mask, tokens: int) -> list:
    """Lines of microseconds and calls per new token of each point of :func:`_stage_points`
    over one ``generate()`` of ``tokens`` new tokens (see the module docstring)."""
    points, slots, saved = _stage_points(built), [], []
    for _, owner, name in points:
        raw = _attribute(owner, name)
        slot = [0.0, 0]
        if isinstance(raw, classmethod):
            replaced = classmethod(_clocked(raw.__func__, slot))
        else:
            replaced = _clocked(raw, slot)
        saved.append((owner, name, raw))
        slots.append(slot)
        setattr(owner, name, replaced)
    try:
        fresh(generate, built, ids, mask, tokens)
    finally:
        for owner, name, raw in reversed(saved):
            setattr(owner, name, raw)
    lines = ["  us/token  calls/token  stage"]
    for (label, _, _), (seconds, calls) in zip(points, slots):
        lines.append(f"  {seconds / tokens * 1e6:8.1f}  {calls / tokens:11.1f}  {label}")
    return lines


def trace(built, ids, mask, tokens: int, top: int) -> list:
    """torch.profiler over one ``generate()`` of ``tokens`` new tokens: the CUDA runtime calls
    (launches, synchronisations, copies, allocations) and then the ``top`` operators by their
    own host time, as lines of microseconds and calls per new token. A synchronisation that
    waits shows here with its wait; the stage clocks cannot tell a wait from work."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiled
    activities = [ProfilerActivity.CPU]
    if ids.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profiled(activities=activities) as prof:
        fresh(generate, built, ids, mask, tokens)
    events = prof.key_averages()
    runtime = sorted((e for e in events if e.key.startswith(("cuda", "cu"))
                      and not e.key.startswith("cutlass")), key=lambda e: -e.self_cpu_time_total)
    by_own = sorted((e for e in events if not e.key.startswith(("cuda", "cu"))),
                    key=lambda e: -e.self_cpu_time_total)[:top]
    lines = []
    for title, ranked in (("CUDA runtime calls", runtime), ("operators by own host time",
                                                             by_own)):
        lines.append(f"  {title}\n  own us/token  calls/token  name")
        for event in ranked:
            lines.append(f"  {event.self_cpu_time_total / tokens:12.1f}  "
                         f"{event.count / tokens:11.1f}  {event.key[:90]}")
    return lines


def profile(built, ids, mask, tokens: int, top: int) -> list:
    """The ``top`` functions by own time over one ``generate()`` of ``tokens`` new tokens, then
    flexspec's ``top`` by cumulative time, as lines of microseconds per token (own,
    cumulative), calls per token and the function."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    fresh(generate, built, ids, mask, tokens)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    by_own = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    package = f"{Path(integration.__file__).resolve().parents[1]}/"  # flexspec's directory
    ours = [item for item in stats.items() if item[0][0].startswith(package)]
    by_cumulative = sorted(ours, key=lambda item: -item[1][3])[:top]
    lines = []
    for title, ranked in (("by own time", by_own), ("flexspec's, by cumulative time",
                                                      by_cumulative)):
        lines.append(f"  {title}\n  own us/token  cum us/token  calls/token  function")
        for (file, line, name), (_, calls, own, cumulative, _) in ranked:
            where = "/".join(Path(file).parts[-2:]) if file != "~" else ""
            lines.append(f"  {own / tokens * 1e6:12.1f}  {cumulative / tokens * 1e6:12.1f}  "
                         f"{calls / tokens:11.1f}  {where}:{line}({name})")
    return lines


def measure(kind, implementation, mode, ids, mask, tokens, device, top: int = 0,
            staged: bool = False, traced: int = 0, layers: int = SHAPE["num_hidden_layers"]
            ) -> dict:
    row = {"model": kind, "mode": mode, "attention": implementation}
    if mode == "static+compiled":  # a row that failed leaves its graphs half recorded
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        reset_cudagraph_trees()
    try:
        built = model(kind, implementation, device, layers)
        configure(built, mode)
        generate(built, ids, mask, tokens)  # compiles what it compiles
        generate(built, ids, mask, 1)
        with Recordings() as recorded:
            long = [fresh(generate, built, ids, mask, tokens) for _ in range(REPEATS)]
        row["graphs recorded"] = recorded.count / REPEATS
        short = [fresh(generate, built, ids, mask, 1)[0] for _ in range(REPEATS)]
        row["ms/token"] = (statistics.median(t for t, _ in long) - statistics.median(short)) \
            / (tokens - 1)
        row["tokens"] = long[0][1][:, ids.shape[1]:].cpu()
        if top:
            row["profile"] = profile(built, ids, mask, tokens, top)
        if staged:
            row["stages"] = stages(built, ids, mask, tokens)
        if traced:
            row["trace"] = trace(built, ids, mask, tokens, traced)
    except Exception as err:  # noqa: BLE001 - a failed run is a table cell
        first = (str(err).splitlines() or [""])[0]  # an AssertionError may have no message
        row["ms/token"] = f"fails: {type(err).__name__}: {first[:120]}"
        print(f"  {kind} {mode} {implementation}: {row['ms/token']}", flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "mistral"])
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--attention", nargs="+", default=IMPLEMENTATIONS)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                        help="layers of each model (2, the issue's shape, unless given)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile one more generate(): the N functions with the most own "
                             "time per token, and flexspec's N with the most cumulative time")
    parser.add_argument("--stages", action="store_true",
                        help="time one more generate() by stage: the attention layers and the "
                             "pieces of flexspec's call path, per token")
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="torch.profiler over one more generate(): CUDA runtime calls "
                             "(synchronisations, launches) and the N operators with the most "
                             "own host time, per token")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    if not torch.cuda.is_available():
        print("benchmarks/generate.py needs a CUDA GPU", file=sys.stderr)
        return 1
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name()}, {args.layers} layers", flush=True)
    integration.register("flexspec")
    device = torch.device("cuda")
    ids, mask = prompts(device)
    rows = []
    for kind in args.models:
        for mode in args.modes:
            for implementation in args.attention:
                ours = implementation in ("flexspec", "sdpa")
                rows.append(measure(kind, implementation, mode, ids, mask, args.tokens, device,
                                    args.profile if ours else 0, args.stages and ours,
                                    args.trace if ours else 0, args.layers))
                print({k: v for k, v in rows[-1].items()
                       if k not in ("tokens", "profile", "stages", "trace")}, flush=True)
                for part in ("profile", "stages", "trace"):
                    if part in rows[-1]:
                        print(f"{part}: {kind} {mode} {implementation}", *rows[-1][part],
                              sep="\n", flush=True)
    print("\n| model | mode | attention | ms/token | / sdpa | same as sdpa | graphs recorded |\n"
          "|---|---|---|---|---|---|---|")
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"] and r["mode"] == row["mode"]
                     and r["attention"] == "sdpa"), None)
        ms = row["ms/token"]
        ratio = same = "-"
        if isinstance(ms, float) and base is not None and isinstance(base["ms/token"], float):
            ratio = f"{ms / base['ms/token']:.2f}x"
            same = f"{int((row['tokens'] == base['tokens']).all(-1).sum())}/{BATCH}"
        cell = f"{ms:.3f}" if isinstance(ms, float) else ms
        graphs = (f"{row['graphs recorded']:.1f}" if row["mode"] == "static+compiled"
                  and "graphs recorded" in row else "-")
        print(f"| {row['model']} | {row['mode']} | {row['attention']} | {cell} | {ratio} | {same} "
              f"| {graphs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
