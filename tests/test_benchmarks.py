"""The GPU suite's hand-written options, run small on the CPU: every one must match the float64
reference (the suite's own check), so a wrong hand-written definition or a broken option is
caught here rather than on the lent GPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_suite():
    spec = importlib.util.spec_from_file_location("benchmark_gpu", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark_gpu"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_suite_options_match_the_reference_on_the_cpu(tmp_path, capsys):
    suite = _load_suite()
    out = tmp_path / "table.md"
    specs = "causal;causal & doc;causal + alibi;causal & window(256) + rel_bias"
    assert suite.main(["--device", "cpu", "--shapes", "2x4x384x32", "--specs", specs,
                       "--modes", "fwd", "--dtype", "float32", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    header = [cell.strip() for cell in next(l for l in lines if l.startswith("| spec")).split("|")]
    rows = [[cell.strip() for cell in line.split("|")] for line in lines
            if line.startswith("| causal")]
    assert len(rows) == 4
    for row in rows:
        assert not any("wrong" in cell or "fails" in cell for cell in row), row
        # flexspec / best: a number, so every cell ran
        assert float(row[header.index("flexspec / best")]) > 0
        if row[0] == "causal & doc":  # the documents given as boundaries to a Step as well
            assert float(row[header.index(f"{suite.STEP} / best")]) > 0
    torch._dynamo.reset()


def test_decode_benchmark_hand_masks_match_flexspec():
    """benchmarks/decode.py writes each spec's mask by hand: at a short cache it must equal
    flexspec's reference mask for the newest token (the bandwidth floor's key counts too)."""
    spec = importlib.util.spec_from_file_location("benchmark_decode", ROOT / "benchmarks" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    import flexspec

    length, batch = 9000, 2
    ids = (torch.arange(length) * decode.DOCUMENTS // length).expand(batch, length).contiguous()
    kv = torch.arange(length).view(1, -1)
    rows = torch.arange(batch).view(-1, 1)
    for text in decode.SPECS:
        bindings = {"doc_ids": ids} if "doc" in text else {}
        want = flexspec.compile(text).dense_mask(1, length, batch=batch, q_offset=length - 1,
                                                 **bindings).expand(batch, 1, 1, length)
        got = decode.hand_mask(text, length - 1, ids)(rows, 0, torch.zeros(1, 1, dtype=torch.long),
                                                      kv)
        assert torch.equal(got.expand(batch, length).reshape(batch, 1, 1, length), want), text
        assert decode.visible_keys(text, length, ids) == want.sum(-1).float().mean().item(), text


def test_decode_benchmark_hand_scores_match_flexspec(monkeypatch):
    """The hand-written score_mods (and SDPA's alibi bias) of benchmarks/decode.py compute what
    flexspec's reference computes for the newest token."""
    import sys
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    spec = importlib.util.spec_from_file_location("benchmark_decode", ROOT / "benchmarks" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "benchmark_decode", decode)  # dynamo traces its mods
    spec.loader.exec_module(decode)
    import flexspec

    length = 300
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, decode.HEADS, 1, 16, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, decode.HEADS, length, 16, generator=generator, dtype=torch.float64)
            for _ in range(2))
    for text in [t for t in decode.SPECS if "+" in t]:
        want = flexspec.compile(text).reference(q, k, v, q_offset=length - 1)
        mask = create_block_mask(decode.hand_mask(text, length - 1, None), None, None, 1, length,
                                 device="cpu")
        got = flex_attention(q, k, v, score_mod=decode.hand_score(text, length - 1, "cpu"),
                             block_mask=mask)
        torch.testing.assert_close(got, want, msg=text)
        bias = decode.sdpa_bias(text, length - 1, length, "cpu")
        if bias is not None:
            sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.double())
            torch.testing.assert_close(sdpa, want, rtol=1e-2, atol=1e-2, msg=text)  # bf16 bias


@pytest.mark.slow
def test_the_training_step_mode_runs_on_the_cpu(capsys):
    """`gpu.py --training-step` hands over to benchmarks/training_step.py; on the CPU (no FA4,
    no backward) flexspec's step must agree with the hand-written one."""
    suite = _load_suite()
    assert suite.main(["--training-step", "--device", "cpu", "--shapes", "1x2x256x16"]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    header, row = table[-3], table[-1]
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|"))))
    assert cells["shape"] == "1x2x256x16"
    assert float(cells["rel. error"]) < 1e-5
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_block_mask_host_benchmark_runs_on_the_cpu(monkeypatch, capsys):
    """benchmarks/block_mask_host.py reaches into flexspec's internals (the input plans, the
    mask's program): a rename there must fail here, not on the lent GPU."""
    spec = importlib.util.spec_from_file_location("benchmark_block_mask_host",
                                                  ROOT / "benchmarks" / "block_mask_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from flexspec.runtime import masks
    monkeypatch.setattr(masks, "FUSED_DEVICES", masks.FUSED_DEVICES)  # main widens it
    assert module.main(["2x256", "--device", "cpu", "--calls", "3"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()[-3::2]
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|"))))
    assert cells["shape"] == "2x256"
    assert all(float(cells[name]) > 0 for name in ("block_mask", "program", "flexspec path"))
    torch._dynamo.reset()


def _small_generate(monkeypatch):
    """benchmarks/generate.py as a module, its models and prompts shrunk for the CPU, float32."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("benchmark_generate",
                                                  ROOT / "benchmarks" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    from flexspec.integrations import transformers as integration
    integration.register("flexspec")
    monkeypatch.setattr(generate, "SHAPE", dict(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=8,
                                                max_position_embeddings=128))
    monkeypatch.setattr(generate, "BATCH", 2)
    monkeypatch.setattr(generate, "SHORTEST", 9)
    monkeypatch.setattr(generate, "LONGEST", 20)
    monkeypatch.setattr(generate, "REPEATS", 1)
    real_model = generate.model
    monkeypatch.setattr(generate, "model", lambda *args: real_model(*args).float())
    return generate


def test_generate_benchmark_runs_its_models_small_on_the_cpu(monkeypatch):
    """benchmarks/generate.py, shrunk: every attention and mode it times generates tokens,
    flexspec's float32 tokens equal sdpa's, and each timed call starts with no plan kept (as a
    new batch of prompts would)."""
    generate = _small_generate(monkeypatch)
    from flexspec.integrations import transformers as integration
    device = torch.device("cpu")
    ids, mask = generate.prompts(device)
    assert (mask.sum(-1) >= 9).all() and (mask[:, -1] == 1).all()  # left padding
    kept_at_start = []
    real_generate = generate.generate

    def generate_counting_plans(*args):
        kept_at_start.append(sum(len(attn._calls.plans.values()) for attn in
                                 integration._REGISTERED["flexspec"]._compiled.values()))
        return real_generate(*args)
    monkeypatch.setattr(generate, "generate", generate_counting_plans)
    for kind in ("llama", "mistral"):
        for mode in ("dynamic", "static"):
            rows = {name: generate.measure(kind, name, mode, ids, mask, 4, device)
                    for name in ("sdpa", "flexspec")}
            for row in rows.values():
                assert isinstance(row["ms/token"], float), row["ms/token"]
                assert row["tokens"].shape == (2, 4)
            assert torch.equal(rows["flexspec"]["tokens"], rows["sdpa"]["tokens"]), (kind, mode)
            # flexspec's four calls: a warm one of each length, then the two timed ones
            assert kept_at_start[-2:] == [0, 0] and kept_at_start[-4] == 0 < kept_at_start[-3]


def test_generate_benchmark_times_the_stages_of_a_token_and_puts_everything_back(monkeypatch):
    """``--stages``: per token, the model's attention layers (two) and flexspec's calls (two)
    are counted and timed, the pieces each call passes through are counted, and every clocked
    function is the original again afterwards (a later row is not timed twice)."""
    generate = _small_generate(monkeypatch)
    from flexspec.runtime import calls
    device = torch.device("cpu")
    ids, mask = generate.prompts(device)
    points = generate._stage_points(generate.model("llama", "flexspec", device))
    before = [generate._attribute(owner, name) for _, owner, name in points]
    rows = {name: generate.measure("llama", name, "dynamic", ids, mask, 4, device, staged=True)
            for name in ("sdpa", "flexspec")}
    after = [generate._attribute(owner, name) for _, owner, name in points]
    assert all(a is b for a, b in zip(before, after))
    assert calls.Calls.__call__ is before[1]

    def table(row):
        found = {}
        for line in row["stages"][1:]:
            micros, per_token, label = line.split(None, 2)
            found[label.strip()] = (float(micros), float(per_token))
        return found
    ours, theirs = table(rows["flexspec"]), table(rows["sdpa"])
    layer = "attention layer (the model's forward)"
    assert ours[layer][1] == theirs[layer][1] == 2 and theirs[layer][0] > 0
    assert ours["flexspec call"][1] == 2 and 0 < ours["flexspec call"][0] <= ours[layer][0]
    assert theirs["flexspec call"] == (0.0, 0.0)
    assert ours["plan: lookup, or made"][1] >= 1  # a layer of the step may reuse its launch


def test_generate_benchmark_traces_a_token_s_operators(monkeypatch):
    """``--trace N``: torch.profiler over one generate(), the N operators with the most own host
    time per token, each with its calls per token (the CUDA runtime's list is empty on the
    CPU)."""
    generate = _small_generate(monkeypatch)
    device = torch.device("cpu")
    ids, mask = generate.prompts(device)
    row = generate.measure("llama", "flexspec", "dynamic", ids, mask, 4, device, traced=5)
    lines = row["trace"]
    start = lines.index(next(line for line in lines if "operators by own host time" in line))
    operators = [line.split(None, 2) for line in lines[start + 1:]]
    assert len(operators) == 5 and all(float(own) >= 0 and float(calls) > 0
                                       for own, calls, _ in operators)
    assert any(name.startswith("aten::") for _, _, name in operators)


@pytest.mark.slow
def test_paged_benchmark_reads_the_pool_in_place_right_on_the_cpu(capsys):
    """benchmarks/paged.py run small on the CPU: the pool read in place through the mapped
    block mask gives the contiguous call's output (a wrong one is a 'wrong' cell), every cell
    ran, for a mask, a binding and a score that reads positions."""
    torch._dynamo.reset()  # flex_attention compiled by earlier tests, at other shapes
    spec = importlib.util.spec_from_file_location("benchmark_paged",
                                                  ROOT / "benchmarks" / "paged.py")
    paged = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paged)
    assert paged.main(["--device", "cpu", "--caches", "300", "--batches", "2", "--pages", "32",
                       "--heads", "4", "--kv-heads", "2", "--dim", "16", "--dtype", "float32",
                       "--repeats", "1", "--specs", "sliding_window(100);causal & doc;causal + alibi"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines
            if line.startswith("| causal") or line.startswith("| sliding")]
    assert len(rows) == 3
    for cells in rows:
        assert not any("wrong" in cell or "fails" in cell for cell in cells), cells
        assert all(float(cell) > 0 for cell in cells[4:]), cells
    torch._dynamo.reset()


@pytest.mark.slow
def test_context_parallel_benchmark_runs_its_rows_on_one_cpu_process(monkeypatch, capsys):
    """benchmarks/context_parallel.py with gloo and one process: every row runs (torch's own
    rows refuse a length that is not a multiple of 128), and every implementation's output
    equals flexspec's single call."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    torch._dynamo.reset()
    spec = importlib.util.spec_from_file_location("benchmark_context_parallel",
                                                  ROOT / "benchmarks" / "context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["context_parallel.py", "--device", "cpu", "--lengths",
                                      "512", "500", "--heads", "1", "--dim", "16",
                                      "--repeats", "1"])
    module.main()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| 5")]
    assert len(rows) == 14  # per length: 2 on one device, 3 flexspec CP, 2 torch CP
    for cells in rows:
        if cells[3] == "not supported":
            assert cells[0] == "500" and cells[1] == "torch CP", cells
        elif cells[7] != "-":
            assert float(cells[7]) < 1e-5, cells  # the output's error against one device
    torch._dynamo.reset()


def test_context_parallel_benchmark_runs_each_rank_in_turn_on_one_device(monkeypatch, capsys):
    """benchmarks/context_parallel.py --one-device: no process group; each balancer's ranks
    run in turn, their rows equal to the single call's, and a length that head-tail cannot
    split is skipped with the reason."""
    spec = importlib.util.spec_from_file_location("benchmark_context_parallel_one",
                                                  ROOT / "benchmarks" / "context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["context_parallel.py", "--device", "cpu", "--one-device",
                                      "2", "--lengths", "1024", "1000", "--heads", "1",
                                      "--dim", "16", "--repeats", "1"])
    module.main()
    out = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in out.splitlines() if line.startswith("| 1024 |")]
    assert [cells[1] for cells in rows] == ["1 device", "flexspec", "head_tail", "none"]
    for cells in rows[1:]:
        assert float(cells[6]) < 1e-5, cells  # each rank's rows against the single call
        assert float(cells[2]) >= float(cells[3]) > 0, cells
    assert float(rows[1][5]) <= float(rows[3][5])  # flexspec's balance beats contiguous
    assert "| 1000 | not a multiple of 2 x 2 ranks x 128: skipped" in out


def test_the_step_replay_benchmark_runs_on_the_cpu(monkeypatch, capsys):
    """benchmarks/step_replay.py reaches into flexspec's internals (the replay and the checked
    runs it turns off): a rename there must fail here, not on the lent GPU. All of its ways
    must equal the reference (the script's own check), the replayed way must have replayed, and
    the checked runs must be back on after it."""
    spec = importlib.util.spec_from_file_location("benchmark_step_replay",
                                                  ROOT / "benchmarks" / "step_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from flexspec.runtime import flexattention
    replayed = []
    real = flexattention.Replay.run
    monkeypatch.setattr(flexattention.Replay, "run",
                        lambda self, args: replayed.append(1) or real(self, args))
    assert module.main(["--device", "cpu", "--rounds", "1", "--calls", "40",
                        "--specs", "causal + softcap(30)"]) == 0
    assert replayed
    from flexspec.kernels import generations, replay
    assert generations.run_cached is replay.run_cached
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| `causal + softcap(30)` |") and len(row.split("|")) == 6
    torch._dynamo.reset()


def test_the_planning_benchmark_times_every_piece_on_the_cpu(capsys):
    """benchmarks/planning.py wraps pieces of runtime.plan.make_plan by name: a rename there
    must fail here, not on the lent GPU; every piece must have been timed, and restored."""
    spec = importlib.util.spec_from_file_location("benchmark_planning",
                                                  ROOT / "benchmarks" / "planning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = [getattr(owner, name) for owner, name, _ in module.PIECES]
    assert module.main(["--device", "cpu", "--cache", "300", "--plans", "5",
                        "--specs", "causal & sliding_window(4095) & key_padding"]) == 0
    assert [getattr(owner, name) for owner, name, _ in module.PIECES] == before
    row = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[0] == "`causal & sliding_window(4095) & key_padding`"
    assert all(float(cell) > 0 for cell in cells[2:])


def test_the_compiled_calls_benchmark_runs_on_the_cpu(capsys):
    """benchmarks/compiled_calls.py turns flexspec's cached runs off by name
    (kernels.generations.run_cached): a rename there must fail here, not on the lent GPU; both
    ways must equal the reference (the script's own check), and the switch must be restored."""
    from flexspec.kernels import generations, replay
    spec = importlib.util.spec_from_file_location("benchmark_compiled_calls",
                                                  ROOT / "benchmarks" / "compiled_calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real, exact = generations.run_cached, replay.ExactReplays.call
    assert module.main(["--device", "cpu", "--rounds", "1", "--calls", "10", "--layers", "2",
                        "--specs", "causal + softcap(30)", "--mask-compiler", "eager"]) == 0
    assert generations.run_cached is real
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[-4:]] == [
        "growing step of 2 layers, `causal + softcap(30)`", "mask program, `causal & key_padding`",
        "mask program, same shapes, `causal & key_padding`",
        "mask program, decoding's form, `causal & key_padding`"]
    assert replay.ExactReplays.call is exact
    torch._dynamo.reset()


def _script_commands(text: str) -> list:
    """``(script, flags)`` of each ``python3 benchmarks/NAME.py ...`` command of a shell
    script, its continuation lines joined."""
    joined = text.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        words = line.split()
        for at, word in enumerate(words):
            if word.startswith("benchmarks/") and word.endswith(".py"):
                flags = [w for w in words[at + 1:] if w.startswith("--")]
                commands.append((word, flags))
    return commands


def test_the_gpu_session_script_calls_benchmarks_with_flags_they_take():
    """benchmarks/inference.sh is what a session with a GPU runs in one device call: a flag a
    benchmark no longer takes would cost that call, so each must be one its parser declares."""
    commands = _script_commands((ROOT / "benchmarks" / "inference.sh").read_text())
    assert len(commands) >= 8, commands
    for script, flags in commands:
        source = (ROOT / script).read_text()
        for flag in flags:
            assert f'"{flag}"' in source, f"{script} declares no {flag}"
