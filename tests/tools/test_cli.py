"""The command line, run in-process through ``main([...])`` (plus one real subprocess)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flexspec
from flexspec.tools.cli import main
from flexspec.lang.fmt import format_attn
from flexspec.lang.parser import parse_file

MODEL = """\
# model.attn: layer attention
mask local(n: int = 1024) = causal & window(n)
score cap(c: float = 50.0) = c * tanh(score / c)
spec even_layers = local(4096) + cap
spec odd_layers = causal + cap
"""

MESSY = """\


# header comment

# about local
mask local(n:int=1024)=causal&window(n)   # trailing
score cap(c: float = 50.0) =
    c*tanh(score/c)  # after cap



spec even_layers = local(4096)+cap
spec odd_layers  = (causal) +  # inside
   cap
# end of file   
"""

MESSY_FORMATTED = """\
# header comment

# about local
mask local(n: int = 1024) = causal & window(n)  # trailing
score cap(c: float = 50.0) = c * tanh(score / c)  # after cap

spec even_layers = local(4096) + cap
# inside
spec odd_layers = causal + cap
# end of file
"""


def kinds(table: str) -> list[str]:
    """The KIND column of a `list` table (names may hold spaces: `document (doc)`)."""
    header, *rows = table.splitlines()
    column = header.index("KIND")
    return [row[column:].split()[0] for row in rows]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def write(tmp_path):
    def write(name, text):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path
    return write


# ---- usage -------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["list", "--help"], ["show", "--help"],
                                  ["check", "--help"], ["fmt", "--help"], ["explain", "--help"]])
def test_help(capsys, argv):
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "usage: flexspec" in out


@pytest.mark.parametrize("argv", [[], ["bogus"], ["list", "--kind", "both"], ["check"], ["show"]])
def test_usage_errors_exit_2(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert "usage:" in err and out == ""


# ---- list --------------------------------------------------------------------------------------


def test_list_shows_every_pattern(capsys):
    code, out, err = run(capsys, "list")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "SIGNATURE", "SUMMARY"]
    names = {line.split()[0] for line in lines[1:]}
    assert names == {p.name for p in flexspec.patterns()}
    window = next(line for line in lines if line.startswith("window "))
    assert "window(n: int)" in window and "mask" in window
    # columns line up: every row's kind starts where the header's does
    assert set(kinds(out)) <= {"mask", "score"}


@pytest.mark.parametrize("columns", [80, 250])
def test_list_gives_signatures_the_terminal_s_width(capsys, monkeypatch, columns):
    """Signatures were cut at about 50 characters even on a wide terminal; they now get what
    the terminal has beyond the names, the kinds and 40 characters of summary (at least 48)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    _, out, _ = run(capsys, "list")
    lines = out.splitlines()
    start, end = lines[0].index("SIGNATURE"), lines[0].index("SUMMARY")
    room = max(48, columns - start - 2 - 40)  # 2: the space before the summary
    for pattern in flexspec.patterns():
        [line] = [row for row in lines if row.split()[0] == pattern.name]
        signature = line[start:end].rstrip()
        full = pattern.signature()
        assert signature == (full if len(full) <= room else full[:room - 1] + "\u2026")
    longest = max(len(p.signature()) for p in flexspec.patterns())
    assert longest > 48  # natten's: cut at 80 columns, whole at 250
    cut = sum(row[start:end].rstrip().endswith("\u2026") for row in lines)
    assert (cut > 0) == (columns == 80)


def test_list_shows_aliases(capsys):
    aliased = [p for p in flexspec.patterns() if p.aliases]
    if not aliased:
        pytest.skip("no pattern has an alias")
    _, out, _ = run(capsys, "list")
    p = aliased[0]
    assert f"{p.name} ({', '.join(p.aliases)})" in out


def test_list_kind_filter(capsys):
    code, out, _ = run(capsys, "list", "--kind", "mask")
    assert code == 0
    assert kinds(out) and set(kinds(out)) == {"mask"}
    assert any(row.startswith("causal ") for row in out.splitlines())


def test_list_tag_filter(capsys):
    code, out, _ = run(capsys, "list", "--tag", "causal")
    assert code == 0
    names = {row.split()[0] for row in out.splitlines()[1:]}
    assert names == {p.name for p in flexspec.patterns() if "causal" in p.tags}
    assert "causal" in names and "full" not in names


def test_list_unknown_tag(capsys):
    code, out, err = run(capsys, "list", "--tag", "causl")
    assert code == 1 and out == ""
    assert "no pattern has tag 'causl'" in err
    assert "Did you mean 'causal'" in err and "Tags: " in err


# ---- show --------------------------------------------------------------------------------------


def test_show_pattern(capsys):
    code, out, err = run(capsys, "show", "window")
    assert code == 0 and err == ""
    p = flexspec.pattern("window")
    assert out.startswith("window (mask)")
    for text in ("window(n: int)", p.summary, p.definition.strip(), "parameters:", "  n: type int",
                 "references:", p.references[0].url, "example:", p.example):
        assert text in out


def test_show_alias(capsys):
    try:
        target = flexspec.pattern("doc")
    except flexspec.RegistryError:
        pytest.skip("no alias 'doc' in the registry")
    code, out, _ = run(capsys, "show", "doc")
    assert code == 0
    assert out.startswith(f"{target.name} ({target.kind})")
    assert f"doc is an alias of {target.name}" in out


def test_show_unknown_suggests(capsys):
    code, out, err = run(capsys, "show", "windw")
    assert code == 1 and out == ""
    assert "no pattern named 'windw'" in err and "Did you mean 'window'" in err
    assert "Traceback" not in err


def test_show_prints_picture_hook(capsys, monkeypatch):
    from flexspec.tools import cli
    monkeypatch.setattr(cli, "_picture", lambda pattern: "PICTURE OF " + pattern.name)
    _, out, _ = run(capsys, "show", "causal")
    assert "PICTURE OF causal" in out


# ---- check -------------------------------------------------------------------------------------


def test_check_clean(capsys, write):
    path = write("model.attn", MODEL)
    code, out, err = run(capsys, "check", str(path))
    assert code == 0 and err == ""
    assert out == f"{path}: ok (2 specs, 2 definitions)\n"


def test_check_broken(capsys, write):
    good = write("good.attn", MODEL)
    bad = write("bad.attn", "mask m = causal\nspec s = causal & windw(3)\nspec t = m & zz\n")
    code, out, err = run(capsys, "check", str(good), str(bad))
    assert code == 1
    assert out == f"{good}: ok (2 specs, 2 definitions)\n"
    assert f"{bad}:2:19: unknown pattern 'windw'. Did you mean 'window'?" in err
    assert "    spec s = causal & windw(3)\n                      ^^^^^^^^" in err
    assert f"{bad}:3:" in err  # every error is reported, not only the first
    assert "Traceback" not in err


def test_check_syntax_error(capsys, write):
    bad = write("syntax.attn", "mask m = q >=\n")
    code, _, err = run(capsys, "check", str(bad))
    assert code == 1
    assert f"{bad}:1:14: unexpected end of input" in err
    assert "^" in err


SEVEN_ERRORS = """\
# seven mistakes, each on its own line
mask a = q < kv < 3
mask b = q >= kv && q < 3
spec c = window(64 * 2)
mask e = q >= kv
score f(w: float[H]) = score + w[q]
spec g = e & windw(3)
spec h = a & e
mask i = q >
score cap(c: float = 50.0) =
    c * tanh(score / c)
spec k = cap + unknown_thing
"""


def test_check_reports_every_error_of_a_file_syntax_errors_included(capsys, write):
    """A file with seven mistakes, four of them syntax errors, reported one (the first)."""
    bad = write("seven.attn", SEVEN_ERRORS)
    code, out, err = run(capsys, "check", str(bad))
    assert code == 1 and out == ""
    heads = [line for line in err.splitlines() if not line.startswith("    ")]
    assert [head.split(": ", 1)[0] for head in heads] == [
        f"{bad}:{line}" for line in ("2:17", "3:18", "4:20", "6:34", "7:14", "9:13", "12:16")]
    # `spec h = a & e` uses the broken `a`: not checked (its errors would follow from a's)
    assert f"{bad}:8:" not in err


def test_check_of_a_folder_checks_every_attn_file_under_it(capsys, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "model.attn").write_text(MODEL, encoding="utf-8")
    (tmp_path / "sub" / "bad.attn").write_text("spec s = windw(3)\n", encoding="utf-8")
    (tmp_path / "sub" / "notes.txt").write_text("spec s = windw(3)\n", encoding="utf-8")
    (tmp_path / ".hidden" / "bad.attn").write_text("spec s = windw(3)\n", encoding="utf-8")
    code, out, err = run(capsys, "check", str(tmp_path))
    assert code == 1
    assert out == f"{tmp_path / 'model.attn'}: ok (2 specs, 2 definitions)\n"
    assert err.startswith(f"{tmp_path / 'sub' / 'bad.attn'}:1:10: unknown pattern 'windw'")
    assert ".hidden" not in err and "notes.txt" not in err
    code, out, err = run(capsys, "check", str(tmp_path / "empty"))
    assert code == 1 and err == f"{tmp_path / 'empty'}: no .attn file in this folder or below it\n"


def test_check_reads_the_standard_input_for_a_dash(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(MODEL))
    code, out, err = run(capsys, "check", "-")
    assert (code, out, err) == (0, "<stdin>: ok (2 specs, 2 definitions)\n", "")
    monkeypatch.setattr(sys, "stdin", io.StringIO("mask m = q >= kv\nspec s = m & windw(2)\n"))
    code, out, err = run(capsys, "check", "-")
    assert code == 1 and err.startswith("<stdin>:2:14: unknown pattern 'windw'")


def test_check_of_a_file_with_carriage_returns_points_at_each_line(capsys, tmp_path):
    path = tmp_path / "cr.attn"
    path.write_bytes(b"mask ok = q >= kv\rspec s = ok & windw(3)\r")
    code, _, err = run(capsys, "check", str(path))
    assert code == 1 and err.startswith(f"{path}:2:15: unknown pattern 'windw'")


def test_check_missing_file(capsys, write, tmp_path):
    good = write("good.attn", MODEL)
    missing = tmp_path / "missing.attn"
    code, out, err = run(capsys, "check", str(missing), str(good))
    assert code == 1
    assert f"cannot read {missing}" in err and "Traceback" not in err
    assert f"{good}: ok" in out  # later files are still checked


# ---- fmt ---------------------------------------------------------------------------------------


def test_format_attn_keeps_comments_and_meaning():
    formatted = format_attn(MESSY, "messy.attn")
    assert formatted == MESSY_FORMATTED
    assert parse_file(formatted) == parse_file(MESSY)
    assert format_attn(formatted) == formatted


@pytest.mark.parametrize("text", [
    "", "\n\n", "# only a comment", "spec a = causal spec b = full # both on one line\n",
    "spec a = causal\r\n\r\n\r\n# crlf\r\nspec b = (causal)\r\n",
    "mask m(n: int,) = # a\n  q >= kv # b\n  & abs(q-kv)<=n  # c\n\n# tail",
    "mask m = (q >= kv)\nscore s = score - -(1)\nspec x = ~~causal & ~(full | causal) + scale(-2.5)",
    MODEL,
])
def test_format_attn_idempotent_and_faithful(text):
    formatted = format_attn(text)
    assert format_attn(formatted) == formatted
    assert parse_file(formatted) == parse_file(text)
    comments = [line.strip() for line in text.splitlines() if "#" in line]
    assert all(c[c.index("#"):].rstrip() in formatted for c in comments)


def test_fmt_rewrites_in_place(capsys, write):
    messy = write("messy.attn", MESSY)
    clean = write("clean.attn", MESSY_FORMATTED)
    code, out, err = run(capsys, "fmt", str(messy), str(clean))
    assert code == 0 and err == ""
    assert out == f"reformatted {messy}\n"  # unchanged files are not listed
    assert messy.read_text() == MESSY_FORMATTED
    assert clean.read_text() == MESSY_FORMATTED
    code, out, _ = run(capsys, "fmt", str(messy))  # idempotent
    assert code == 0 and out == ""


def test_fmt_check_writes_nothing(capsys, write):
    messy = write("messy.attn", MESSY)
    clean = write("clean.attn", MESSY_FORMATTED)
    code, out, err = run(capsys, "fmt", "--check", str(messy), str(clean))
    assert code == 1 and out == ""
    assert f"would reformat {messy}" in err and str(clean) not in err
    assert messy.read_text() == MESSY
    code, _, err = run(capsys, "fmt", "--check", str(clean))
    assert code == 0 and err == ""


def test_fmt_syntax_error_leaves_file(capsys, write):
    bad = write("bad.attn", "spec  a =  causal &\n")
    code, out, err = run(capsys, "fmt", str(bad))
    assert code == 1 and out == ""
    assert f"{bad}:1:20: unexpected end of input" in err and "^" in err
    assert bad.read_text() == "spec  a =  causal &\n"


# ---- explain -----------------------------------------------------------------------------------


def test_explain(capsys):
    code, out, err = run(capsys, "explain", "causal")
    assert code == 0 and err == ""
    assert "spec:  causal" in out and "mask:  q >= kv" in out


def test_explain_with_file(capsys, write):
    model = write("model.attn", MODEL)
    code, out, _ = run(capsys, "explain", "odd_layers", "--file", str(model))
    assert code == 0
    assert "spec:  causal + cap" in out and "q >= kv" in out and "tanh" in out
    code, out, _ = run(capsys, "explain", "local(8) + cap(30.0)", "--file", str(model))
    assert code == 0
    assert "abs(q - kv) <= 8" in out and "30.0" in out


def test_explain_of_lengths_beyond_any_block_mask_is_refused_up_front(capsys):
    """Red-team finding: `explain "causal & doc" --q-len 100000000` tried to allocate 610 GB of
    tile tables (a raw allocator error). The tables' size is checked before building."""
    code, out, err = run(capsys, "explain", "causal & doc", "--q-len", "100000000")
    assert code == 1 and out == "" and "Traceback" not in err
    assert "781250 x 781250 tiles" in err and "use a larger block_size" in err


def test_explain_errors(capsys, write, tmp_path):
    code, out, err = run(capsys, "explain", "causal & windw(3)")
    assert code == 1 and out == ""
    assert "<spec>:1:10: unknown pattern 'windw'" in err and "^^^^" in err
    code, _, err = run(capsys, "explain", "causal", "--file", str(tmp_path / "missing.attn"))
    assert code == 1 and "cannot read" in err and "Traceback" not in err
    bad = write("bad.attn", "spec s = causal &\n")
    code, _, err = run(capsys, "explain", "s", "--file", str(bad))
    assert code == 1 and f"{bad}:1:" in err


def test_explain_a_call(capsys):
    code, out, err = run(capsys, "explain", "causal & window(64)", "--q-len", "1000",
                         "--heads", "4", "--head-dim", "64", "--dtype", "float32")
    assert code == 0 and err == ""
    assert "call:     B=1 H=4 Q_LEN=1000 KV_LEN=1000 D=64 float32 on cpu" in out
    visible = sum(min(q, 64) + 1 for q in range(1000))
    assert f"density:  {visible / 1000 ** 2:.2%} of (q, kv) pairs visible" in out
    assert "backend:  flex: " in out and "not sdpa: SDPA runs only" in out


def test_explain_a_call_with_gradients_and_bindings(capsys):
    code, out, _ = run(capsys, "explain", "causal & doc", "--q-len", "12", "--grad",
                       "--bind", "doc_ids=0*6,1*6")
    assert code == 0
    assert "density:  " + f"{2 * 21 / 144:.2%}" in out  # two causal 6x6 triangles
    assert "forward+backward" in out and "backend:  reference: " in out
    assert "demo values" not in out
    code, out, _ = run(capsys, "explain", "causal & doc", "--q-len", "12")
    assert "doc_ids: demo value, 3 equal documents" in out


@pytest.mark.parametrize("argv, message", [
    (["causal", "--device", "cuda"], "--device describes a call: give --q-len too"),
    (["causal", "--grad", "--kv-len", "5"], "--kv-len, --grad describe a call"),
    (["causal & window(3)", "--q-len", "10", "--backend", "sdpa"],
     "backend 'sdpa' cannot run 'causal & window(3)'"),
    (["causal", "--q-len", "100", "--backend", "flash"], "FLASH runs on CUDA GPUs only"),
    (["causal", "--q-len", "100", "--backend", "flsh"], "Did you mean 'flash'"),
    (["causal", "--q-len", "0"], "--q-len must be at least 1"),
    (["causal", "--q-len", "10", "--device", "nodevice"], "cannot use device 'nodevice'"),
])
def test_explain_call_errors(capsys, argv, message):
    code, out, err = run(capsys, "explain", *argv)
    assert code == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("option, value", [
    ("--heads", "0"), ("--heads", "16"), ("--batch", "1"), ("--head-dim", "64"),
    ("--dtype", "bfloat16"), ("--block-size", "128"), ("--kv-heads", "2"), ("--device", "cpu"),
    ("--backend", "auto"), ("--kv-len", "8"), ("--bind", "doc_ids=0"),
])
def test_explain_refuses_every_call_option_without_q_len(capsys, option, value):
    """Red-team finding: `explain causal --heads 0` exited 0 and ignored --heads; an option
    given with its default value counts as given too."""
    code, out, err = run(capsys, "explain", "causal", option, value)
    expected = ("--heads must be at least 1, got 0" if value == "0" else
                f"{option} describes a call: give --q-len too")
    assert (code, out, err) == (1, "", expected + "\n")


@pytest.mark.parametrize("option", ["--q-len", "--kv-len", "--batch", "--heads", "--kv-heads",
                                    "--head-dim"])
def test_explain_refuses_a_size_below_one_with_or_without_q_len(capsys, option):
    for argv in ([option, "0"], ["--q-len", "8", option, "0"] if option != "--q-len" else []):
        if argv:
            code, _, err = run(capsys, "explain", "causal", *argv)
            assert (code, err) == (1, f"{option} must be at least 1, got 0\n")
    code, _, err = run(capsys, "explain", "causal", "--q-len", "8", "--block-size", "24")
    assert (code, err) == (1, "--block-size must be a positive multiple of 16, got 24\n")


# ---- render and the picture in show -------------------------------------------------------------


def picture_rows(out: str) -> list[str]:
    """The rows of the first framed picture of an output."""
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if "┌" in line)
    bottom = next(i for i, line in enumerate(lines) if "└" in line and i > top)
    return [line[line.index("│") + 1: line.rindex("│")] for line in lines[top + 1: bottom]]


def test_render_help(capsys):
    code, out, _ = run(capsys, "render", "--help")
    assert code == 0 and "usage: flexspec render" in out and "--bind NAME=VALUES" in out


def test_render(capsys):
    code, out, err = run(capsys, "render", "causal & window(3)", "--q", "12", "--kv", "12")
    assert code == 0 and err == ""
    assert out.startswith("causal & window(3)    Q_LEN=12 KV_LEN=12\n")
    assert picture_rows(out) == ["█▄          ", "███▄        ", " ▀███▄      ", "   ▀███▄    ",
                                 "     ▀███▄  ", "       ▀███▄"]
    assert "density 0.292 (42/144 visible)" in out
    assert "score at a zero logit" not in out and "demo" not in out and "\x1b[" not in out


def test_render_kv_defaults_to_q_and_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "alibi.png"
    code, out, err = run(capsys, "render", "alibi", "--q", "8", "--png", str(png))
    assert code == 0 and err == ""
    assert "Q_LEN=8 KV_LEN=8, head 0 of H=8" in out
    assert "score at a zero logit: min -3.5, max 0" in out
    assert out.rstrip().endswith(f"wrote {png}")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_render_demo_and_given_bindings(capsys):
    code, out, _ = run(capsys, "render", "causal & document", "--q", "6")
    assert code == 0
    assert "not given with --bind, so drawn with demo values:" in out
    assert "doc_ids: demo value, 3 equal documents (0 0 1 1 2 2)" in out
    code, out, _ = run(capsys, "render", "causal & document", "--q", "6",
                       "--bind", "doc_ids=0*2,1*4")
    assert code == 0 and "demo" not in out
    assert picture_rows(out) == ["█▄    ", "  █▄  ", "  ███▄"]
    assert "density 0.361 (13/36 visible)" in out  # 3 + 10
    code, out, _ = run(capsys, "render", "causal + head_bias", "--q", "4", "--head", "1",
                       "--bind", "bias=0.5,-2")
    assert code == 0 and "head 1 of H=2" in out and "-2 at every visible pair" in out


@pytest.mark.parametrize("argv, message", [
    (["causal", "--q", "0"], "--q must be at least 1, got 0"),
    (["causal", "--kv", "-2"], "--kv must be at least 1, got -2"),
    (["causal", "--head", "4", "--heads", "4"], "--head 4 does not exist with --heads 4"),
    (["causal & windw(3)"], "<spec>:1:10: unknown pattern 'windw'. Did you mean 'window'?"),
    (["causal & document", "--q", "4", "--bind", "doc_ids=0,1"],
     "--bind doc_ids: 2 values given, but int[B, KV_LEN] = [1, 4] needs 4 (or 1 to fill it)"),
    (["causal & document", "--bind", "doc_id=1"], "Did you mean 'doc_ids'?"),
    (["causal & document", "--bind", "doc_ids=0,x"], "'x' is not a valid value"),
    (["causal & document", "--bind", "doc_ids"], "--bind expects NAME=VALUES"),
    (["causal", "--bind", "doc_ids=1"], "this spec reads no runtime tensors"),
    (["causal & document", "--q", "8", "--kv", "4"], "'doc_ids' is indexed by q"),
    (["causal", "--q", "100000"], "the dense reference would need"),
])
def test_render_errors(capsys, argv, message):
    code, out, err = run(capsys, "render", *argv)
    assert code == 1 and out == ""
    assert message in err and "Traceback" not in err


def test_render_png_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, out, err = run(capsys, "render", "causal", "--q", "4", "--png", str(tmp_path / "x.png"))
    assert code == 1 and "density" in out
    assert "pip install 'flexspec[plot]'" in err and "Traceback" not in err


def test_render_usage_error(capsys):
    code, _, err = run(capsys, "render")
    assert code == 2 and "usage:" in err


def test_show_draws_the_example(capsys):
    code, out, _ = run(capsys, "show", "sliding_window")
    assert code == 0
    assert "picture of the example:" in out
    assert "sliding_window(3)    Q_LEN=16 KV_LEN=16" in out
    rows = picture_rows(out)
    assert len(rows) == 8 and all(len(row) == 16 for row in rows)
    assert rows[0] == "█▄" + " " * 14
    code, out, _ = run(capsys, "show", "document")
    assert "doc_ids: demo value, 3 equal documents" in out
    code, out, _ = run(capsys, "show", "sliding_window", "--no-picture")
    assert code == 0 and "picture" not in out and "┌" not in out


# ---- the installed entry point -----------------------------------------------------------------


def test_python_m_flexspec():
    result = subprocess.run([sys.executable, "-m", "flexspec", "list", "--kind", "mask"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("NAME")
    assert "\ncausal " in result.stdout


@pytest.mark.parametrize("command", ["check", "fmt"])
def test_endless_files_are_refused_not_read_forever(capsys, command):
    code, _, err = run(capsys, command, "/dev/zero")
    assert code == 1 and "longer than" in err and "/dev/zero" in err


@pytest.mark.parametrize("bind, message", [
    ("doc_ids=0*99999999999", "more than 16777216 values"),
    ("doc_ids=" + "9" * 30, "does not fit in a 64-bit int"),
])
def test_bind_values_beyond_what_a_tensor_holds(capsys, bind, message):
    code, _, err = run(capsys, "render", "causal & document", "--q", "4", "--bind", bind)
    assert code == 1 and message in err


@pytest.mark.parametrize("bind", ["bias=1e39", "bias=inf", "bias=nan"])
def test_bind_floats_must_be_finite_float32(capsys, bind):
    code, _, err = run(capsys, "render", "causal + head_bias", "--q", "4", "--bind", bind)
    assert code == 1 and "is not a finite float32 value" in err


@pytest.mark.parametrize("encoding", ["cp1252", "ascii"])
def test_render_to_a_narrow_encoding_does_not_crash(encoding):
    env = {**__import__("os").environ, "PYTHONIOENCODING": encoding}
    result = subprocess.run([sys.executable, "-m", "flexspec", "render", "causal", "--q", "8"],
                            capture_output=True, text=True, timeout=120, env=env,
                            encoding=encoding, errors="replace")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "density" in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="plans without a GPU")
def test_explain_plans_for_a_gpu_from_a_machine_without_one(capsys):
    """First-hour review: `explain --device cuda` needed a GPU although nothing is allocated."""
    args = ("explain", "causal & window(1024)", "--q-len", "8192", "--batch", "4",
            "--device", "cuda")
    code, out, _ = run(capsys, *args)
    assert code == 0 and "on cuda (planned on cpu)" in out
    assert "backend:  flex: " in out and "FlashAttention-4 not installed" in out
    code, out, _ = run(capsys, *args, "--fa4")
    assert "backend:  fa4: " in out and "FlashAttention-4 installed" in out
    code, out, _ = run(capsys, *args, "--fa4", "--capability", "8.0")
    assert "backend:  flex: " in out and "this one is 8.0" in out
    code, _, err = run(capsys, *args, "--capability", "nine")
    assert code == 1 and "--capability takes a compute capability such as 9.0" in err
    code, _, err = run(capsys, "explain", "causal", "--q-len", "8", "--fa4")
    assert code == 1 and "describe a GPU this machine does not have" in err
