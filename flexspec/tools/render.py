"""Pictures of a spec: its mask, and the bias its score pipeline adds, as text or PNG.

:func:`render_text` draws the mask of one ``(batch, head)`` with Unicode half blocks, two query
rows per text line (``▀`` upper row visible, ``▄`` lower, ``█`` both, blank neither), so a
picture is about as wide as it is tall. Rows are queries (``q`` downwards), columns keys (``kv``
rightwards). A spec with a score modifier also gets a "heat" picture: the score pipeline applied
to a zero logit (for ``alibi`` that is ``-slope[h] * abs(q - kv)``), quantised to ``░▒▓█`` from
its minimum to its maximum over the visible pairs, two characters and one line per pair (so it is
square too). The mask is followed by the density, the fraction of visible ``(q, kv)`` pairs.
A mask wider than ``width_limit`` characters (a heat wider than a quarter of it in pairs) is
downsampled by square blocks: a mask cell is drawn when any pair in it is visible, a heat cell
shows the mean over its visible pairs.

:func:`render_png` draws the same with matplotlib (the optional extra ``flexspec[plot]``).

Everything is computed by the dense reference (:mod:`flexspec.kernels.reference`), the definition of what
a spec means, never by the FlexAttention lowering. Runtime bindings are passed by name like
``Attention.dense_mask``; :func:`demo_bindings` makes example values for the command line.

The command line, the catalogue and ``flexspec.render`` (on first use) import this module.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import torch

from flexspec import ir
from flexspec.errors import SpecError
from flexspec.kernels.evaluate import evaluate, index_grid
from flexspec.kernels.tensors import prepare
from flexspec.limits import check_dense
from flexspec.tools.values import DEFAULT_HEADS, attention_of, demo_bindings

# Widest mask picture, in characters (= kv columns), before blocks are downsampled.
DEFAULT_WIDTH = 128
# The shades of the heat picture, lowest value first.
SHADES = "░▒▓█"
# 256-colour ANSI foregrounds for the shades when colour is asked for (dark blue to yellow).
_ANSI = (25, 37, 149, 226)
_UPPER, _LOWER, _BOTH, _NONE = "▀", "▄", "█", " "
_NOT_FINITE = "×"


@dataclass(frozen=True)
class Picture:
    """What a picture shows, for one ``(batch, head)``: the mask (bool ``[Q_LEN, KV_LEN]``) and,
    when the spec has a score modifier, the score pipeline at a zero logit (float64, same shape,
    every position, masked or not)."""

    spec: str
    batch: int
    head: int
    heads: int
    mask: torch.Tensor
    scores: torch.Tensor | None = None
    reads_heads: bool = field(default=False)

    @property
    def q_len(self) -> int:
        return self.mask.shape[0]

    @property
    def kv_len(self) -> int:
        return self.mask.shape[1]

    @property
    def visible(self) -> int:
        return int(self.mask.sum())

    @property
    def density(self) -> float:
        return self.visible / self.mask.numel()


# ---------------------------------------------------------------------------------------------
# Computing what to draw


def _reads_heads(spec: ir.AttentionIR) -> bool:
    return bool({"h", "H"} & (ir.free_vars(spec.mask) | ir.free_vars(spec.score)))


def _check_index(name: str, value, limit: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SpecError(f"{name} must be an int >= 0, got {value!r}")
    if limit is not None and value >= limit:
        raise SpecError(f"{name} {value} does not exist: there are {limit}")
    return value


def _check_length(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"{name} must be a positive int, got {value!r}")
    return value


def _infer_size(attn, bindings: dict, size: str) -> int | None:
    """The size of a given binding's dimension declared ``size`` (``B`` or ``H``), if over 1."""
    for tensor in attn.ir.tensors():
        value = bindings.get(tensor.name)
        if value is None:
            continue
        value = torch.as_tensor(value)
        offset = len(tensor.shape) - value.dim()
        for dim, expr in enumerate(tensor.shape):
            if isinstance(expr, ir.Var) and expr.name == size and dim >= offset:
                if value.shape[dim - offset] > 1:
                    return int(value.shape[dim - offset])
    return None


def resolve_heads(attn_or_spec, head: int = 0, heads: int | None = None,
                  bindings: dict | None = None) -> int:
    """The ``H`` a picture uses: ``heads`` when given; else the size of the ``H`` dimension of a
    given binding (a ``bias`` of 4 values for a ``float[H]`` gives 4); else
    :data:`DEFAULT_HEADS` when the spec reads ``h`` or ``H`` (alibi's slopes depend on ``H``);
    else ``head + 1``."""
    if heads is not None:
        return heads
    attn = attention_of(attn_or_spec)
    inferred = _infer_size(attn, bindings or {}, "H")
    if inferred is not None:
        return inferred
    return max(DEFAULT_HEADS, head + 1) if _reads_heads(attn.ir) else head + 1


def picture(attn_or_spec, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0,
            heads: int | None = None, **bindings) -> Picture:
    """The mask and zero-logit scores of ``(batch, head)``, computed by the dense reference.

    ``attn_or_spec`` is an :class:`~flexspec.runtime.Attention`, a :class:`~flexspec.Spec` or
    spec text. The spec sees ``H = heads`` (default: :func:`resolve_heads`) and ``B = batch + 1``,
    or the batch size of a binding with a ``B`` dimension when that is larger. Bindings are
    checked as ``Attention.dense_mask`` checks them; a learnable tensor that is not bound is
    drawn at its initial value.
    """
    attn = attention_of(attn_or_spec)
    q_len = _check_length("q_len", q_len)
    kv_len = _check_length("kv_len", kv_len)
    batch = _check_index("batch", batch)
    head = _check_index("head", head)
    reads_heads = _reads_heads(attn.ir)
    heads = _check_length("heads", resolve_heads(attn, head, heads, bindings))
    _check_index("head", head, heads)
    batches = max(batch + 1, _infer_size(attn, bindings, "B") or 1)
    sizes = {"B": batches, "H": heads, "Q_LEN": q_len, "KV_LEN": kv_len}
    check_dense(1, 1, q_len, kv_len)

    # The runtime checks the bindings (names, dtypes, shapes, indices in range) on the way.
    dense = attn.dense_mask(q_len, kv_len, batch=sizes["B"], heads=heads, **bindings)
    mask = dense[min(batch, dense.shape[0] - 1), min(head, dense.shape[1] - 1)]

    scores = None
    if attn.ir.has_score:
        learnable = {t.name for t in attn.ir.tensors() if t.origin == "learnable"}
        values = prepare(attn.ir, sizes, bindings, learnables={
            name: torch.as_tensor(value) for name, value in bindings.items() if name in learnable})
        grid = index_grid(1, 1, q_len, kv_len)
        grid.update(b=torch.full((1, 1, 1, 1), batch), h=torch.full((1, 1, 1, 1), head),
                    B=sizes["B"], H=heads)
        grid[ir.SCORE_VAR] = torch.zeros(1, 1, q_len, kv_len, dtype=torch.float64)
        result = evaluate(attn.ir.score, grid, values)
        if result.dtype == torch.bool:
            raise SpecError(f"the score pipeline '{ir.to_text(attn.ir.score)}' is not numeric")
        scores = result.to(torch.float64).expand(1, 1, q_len, kv_len)[0, 0]
    return Picture(str(attn.spec), batch, head, heads, mask.cpu(), scores, reads_heads)


# ---------------------------------------------------------------------------------------------
# Text


def _factor(q_len: int, kv_len: int, limit: int) -> int:
    return max(1, math.ceil(max(q_len, kv_len) / max(1, limit)))


def _pool_any(mask: torch.Tensor, f: int) -> torch.Tensor:
    """``mask`` (bool ``[Q, KV]``) in ``f x f`` blocks: True where any pair of a block is."""
    if f == 1:
        return mask
    rows, cols = math.ceil(mask.shape[0] / f), math.ceil(mask.shape[1] / f)
    padded = torch.zeros(rows * f, cols * f, dtype=torch.bool)
    padded[: mask.shape[0], : mask.shape[1]] = mask
    return padded.reshape(rows, f, cols, f).any(dim=3).any(dim=1)


def _pool_mean(values: torch.Tensor, mask: torch.Tensor, f: int) -> torch.Tensor:
    """The mean of ``values`` over the visible pairs of each ``f x f`` block (NaN where none)."""
    rows, cols = math.ceil(mask.shape[0] / f), math.ceil(mask.shape[1] / f)
    total = torch.zeros(rows * f, cols * f, dtype=torch.float64)
    count = torch.zeros(rows * f, cols * f, dtype=torch.float64)
    total[: mask.shape[0], : mask.shape[1]] = torch.where(mask, values, 0.0)
    count[: mask.shape[0], : mask.shape[1]] = mask.to(torch.float64)
    total = total.reshape(rows, f, cols, f).sum(dim=(1, 3))
    count = count.reshape(rows, f, cols, f).sum(dim=(1, 3))
    return torch.where(count > 0, total / count.clamp(min=1), math.nan)


def _tick(cells: int) -> int:
    return 4 if cells <= 16 else 8 if cells <= 64 else 16


def _column_labels(cells: int, tick: int, f: int, cell_width: int, gutter: int) -> str:
    line = ""
    for c in range(0, cells, tick):
        at = gutter + 1 + c * cell_width
        label = str(c * f)
        if at < len(line) + 1 and line:
            continue
        line = line.ljust(at) + label
    return line


def _frame(rows: list[str], labels: list[str], gutter: int, inner: int) -> list[str]:
    lines = [" " * gutter + "┌" + "─" * inner + "┐"]
    for label, row in zip(labels, rows):
        lines.append(label.rjust(gutter - 1) + " │" + row + "│")
    lines.append(" " * gutter + "└" + "─" * inner + "┘")
    return lines


def mask_lines(mask: torch.Tensor, f: int = 1) -> list[str]:
    """The mask's picture rows (no frame): one character per kv cell, two q cells per line."""
    cells = _pool_any(mask, f)
    rows, cols = cells.shape
    if rows % 2:
        cells = torch.cat([cells, torch.zeros(1, cols, dtype=torch.bool)])
    glyphs = (_NONE, _LOWER, _UPPER, _BOTH)  # index: 2 * upper + lower
    codes = (cells[0::2].to(torch.int64) * 2 + cells[1::2].to(torch.int64)).tolist()
    return ["".join(glyphs[c] for c in line) for line in codes]


def heat_lines(scores: torch.Tensor, mask: torch.Tensor, f: int = 1, *,
               color: bool = False) -> tuple[list[str], float, float]:
    """The heat's picture rows (no frame): two characters per cell, one line per q cell; masked
    cells are blank. Also returns the minimum and maximum over the visible pairs."""
    values = scores if f == 1 else _pool_mean(scores, mask, f)
    shown = mask if f == 1 else _pool_any(mask, f)
    finite = scores[mask & torch.isfinite(scores)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 0.0)
    span = hi - lo
    lines = []
    for row_values, row_shown in zip(values.tolist(), shown.tolist()):
        line = []
        for value, visible in zip(row_values, row_shown):
            if not visible:
                line.append("  ")
                continue
            if not math.isfinite(value):
                line.append(_NOT_FINITE * 2)
                continue
            level = 0 if span <= 0 else min(len(SHADES) - 1,
                                            int((value - lo) / span * len(SHADES)))
            glyph = SHADES[level] * 2
            line.append(f"\x1b[38;5;{_ANSI[level]}m{glyph}\x1b[0m" if color else glyph)
        lines.append("".join(line))
    return lines, lo, hi


def _number(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.4g}"


def render_text(attn_or_spec, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0,
                heads: int | None = None, width_limit: int | None = None, color: bool = False,
                **bindings) -> str:
    """The mask of ``(batch, head)`` drawn in Unicode blocks, the score heat when the spec has a
    score modifier, and the density; see the module docstring. ``width_limit`` is the widest
    mask in characters (default :data:`DEFAULT_WIDTH`); ``color`` adds ANSI colours to the heat
    (for terminals only). Other keywords are the spec's runtime bindings."""
    pic = picture(attn_or_spec, q_len, kv_len, batch=batch, head=head, heads=heads, **bindings)
    return format_picture(pic, width_limit=width_limit, color=color)


def format_picture(pic: Picture, *, width_limit: int | None = None, color: bool = False) -> str:
    """The text of :func:`render_text` for an already computed :class:`Picture`."""
    limit = DEFAULT_WIDTH if width_limit is None else width_limit
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 2:
        raise SpecError(f"width_limit must be an int >= 2, got {width_limit!r}")
    q_len, kv_len = pic.q_len, pic.kv_len
    where = []
    if pic.batch:
        where.append(f"batch {pic.batch}")
    if pic.reads_heads or pic.head:
        where.append(f"head {pic.head} of H={pic.heads}")
    out = [f"{pic.spec}    Q_LEN={q_len} KV_LEN={kv_len}" + (f", {', '.join(where)}" if where
                                                             else "")]

    # the mask
    f = _factor(q_len, kv_len, limit)
    rows = mask_lines(pic.mask, f)
    cells_q, cells_kv = math.ceil(q_len / f), math.ceil(kv_len / f)
    tick_q, tick_kv = _tick(cells_q), _tick(cells_kv)
    gutter = len(str((cells_q - 1) * f)) + 2
    labels = [str(2 * i * f) if (2 * i) % tick_q == 0 else "" for i in range(len(rows))]
    out.append("mask: q rows downwards (two per line: ▀ upper, ▄ lower, █ both), "
               "kv columns rightwards")
    out.append(_column_labels(cells_kv, tick_kv, f, 1, gutter))
    out += _frame(rows, labels, gutter, cells_kv)
    out.append(f"density {pic.density:.3f} ({pic.visible}/{pic.mask.numel()} visible)")
    if f > 1:
        out.append(f"downsampled: one cell is {f}x{f} (q x kv) pairs, drawn if any pair in it is "
                   "visible")

    # the heat
    if pic.scores is not None:
        out.append("")
        out += _heat_text(pic, limit, color)
    return "\n".join(out) + "\n"


def _heat_text(pic: Picture, limit: int, color: bool) -> list[str]:
    q_len, kv_len = pic.q_len, pic.kv_len
    title = "score at a zero logit"
    if not pic.mask.any():
        return [f"{title}: no visible pair"]
    f = _factor(q_len, kv_len, max(1, limit // 4))
    rows, lo, hi = heat_lines(pic.scores, pic.mask, f, color=color)
    visible = pic.scores[pic.mask]
    if bool(torch.isfinite(visible).all()) and lo == hi:
        return [f"{title}: {_number(lo)} at every visible pair (constant: no heat to draw)"]
    out = [f"{title}: min {_number(lo)}, max {_number(hi)} over the visible pairs"]
    step = (hi - lo) / len(SHADES)
    legend = []
    for i, shade in enumerate(SHADES):
        glyph = f"\x1b[38;5;{_ANSI[i]}m{shade}\x1b[0m" if color else shade
        legend.append(f"{glyph} {_number(lo + i * step)}..{_number(lo + (i + 1) * step)}")
    out.append("  ".join(legend) + "   (blank: masked)")
    cells_q, cells_kv = math.ceil(q_len / f), math.ceil(kv_len / f)
    tick_q, tick_kv = _tick(cells_q), _tick(cells_kv)
    gutter = len(str((cells_q - 1) * f)) + 2
    labels = [str(i * f) if i % tick_q == 0 else "" for i in range(len(rows))]
    out.append(_column_labels(cells_kv, tick_kv, f, 2, gutter))
    out += _frame(rows, labels, gutter, 2 * cells_kv)
    if not bool(torch.isfinite(visible).all()):
        out.append(f"{_NOT_FINITE * 2} not finite")
    if f > 1:
        out.append(f"downsampled: one cell is {f}x{f} (q x kv) pairs, the mean over its "
                   "visible ones")
    return out


def render_example(spec, size: int = 16) -> str:
    """A small picture of ``spec`` (``size x size``) with demo values for every tensor it reads
    (:func:`demo_bindings`, listed under the picture): what ``flexspec show`` and the catalogue
    print for a pattern's example."""
    attn = attention_of(spec)
    heads = resolve_heads(attn)
    values, notes = demo_bindings(attn, size, size, heads=heads)
    text = render_text(attn, size, size, heads=heads, **values)
    return text + "".join(f"{note}\n" for note in notes)

# ---------------------------------------------------------------------------------------------
# PNG

PNG_MAX_CELLS = 1024


def render_png(attn_or_spec, path, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0,
               heads: int | None = None, **bindings):
    """Write the mask (and the score heat, as a second panel, when the spec has a score
    modifier) to a PNG at ``path``; returns ``path``. Needs matplotlib:
    ``pip install 'flexspec[plot]'``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SpecError("render_png needs matplotlib: pip install 'flexspec[plot]'") from None
    pic = picture(attn_or_spec, q_len, kv_len, batch=batch, head=head, heads=heads, **bindings)
    f = _factor(pic.q_len, pic.kv_len, PNG_MAX_CELLS)
    panels = 1 if pic.scores is None else 2
    figure = Figure(figsize=(5.2 * panels, 5.0), layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    extent = (-0.5, pic.kv_len - 0.5, pic.q_len - 0.5, -0.5)
    cells = _pool_any(pic.mask, f)
    # the padding of the last block lies outside the drawn extent
    extent_cells = (-0.5, cells.shape[1] * f - 0.5, cells.shape[0] * f - 0.5, -0.5) \
        if f > 1 else extent
    ax = axes[0]
    ax.imshow(cells.numpy(), cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest",
              extent=extent_cells)
    ax.set_xlim(extent[0], extent[1])
    ax.set_ylim(extent[2], extent[3])
    title = f"mask, density {pic.density:.3f}"
    if f > 1:
        title += f"\n(blocks of {f}x{f}: drawn if any pair is visible)"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("kv")
    ax.set_ylabel("q")
    if pic.scores is not None:
        ax = axes[1]
        values = pic.scores if f == 1 else _pool_mean(pic.scores, pic.mask, f)
        shown = pic.mask if f == 1 else cells
        heat = torch.where(shown, values, math.nan).numpy()
        image = ax.imshow(heat, cmap="viridis", interpolation="nearest", extent=extent_cells)
        ax.set_xlim(extent[0], extent[1])
        ax.set_ylim(extent[2], extent[3])
        ax.set_title("score at a zero logit (masked: blank)", fontsize=10)
        ax.set_xlabel("kv")
        ax.set_ylabel("q")
        figure.colorbar(image, ax=ax, shrink=0.8)
    where = f"Q_LEN={pic.q_len} KV_LEN={pic.kv_len}"
    if pic.batch:
        where += f", batch {pic.batch}"
    if pic.reads_heads or pic.head:
        where += f", head {pic.head} of H={pic.heads}"
    figure.suptitle(f"{pic.spec}    {where}", fontsize=11)
    try:
        figure.savefig(path, dpi=110)
    except OSError as err:
        raise SpecError(f"cannot write {path}: {err.strerror or err}") from None
    return path


_PICTURE_OPTIONS = ("batch", "head", "heads", "width_limit", "color")


def rendering(attn_or_spec, q_len: int, kv_len: int | None = None, **options) -> "Rendering":
    """What ``flexspec.render`` returns (see there): the picture, with demo values for the
    tensors ``options`` do not bind (as ``flexspec render`` gives them)."""
    attn = attention_of(attn_or_spec)
    kv_len = q_len if kv_len is None else kv_len
    bindings = {key: value for key, value in options.items() if key not in _PICTURE_OPTIONS}
    chosen = {key: value for key, value in options.items() if key in _PICTURE_OPTIONS}
    heads = resolve_heads(attn, chosen.get("head", 0), chosen.get("heads"), bindings)
    demo, notes = demo_bindings(attn, q_len, kv_len, batch=chosen.get("batch", 0), heads=heads,
                                given=bindings)
    return Rendering(attn, q_len, kv_len, notes, **chosen, **demo, **bindings)


class Rendering:
    """A spec's picture for scripts and notebooks (what ``flexspec.render`` returns): ``str()``
    and ``print()`` give the text picture; a notebook shows the PNG where matplotlib is installed
    (``pip install 'flexspec[plot]'``) and the text otherwise; :meth:`save` writes the PNG."""

    def __init__(self, attn, q_len: int, kv_len: int, notes=(), **options):
        self._args, self._options = (attn, q_len, kv_len), options
        # checks every argument now
        self.text = render_text(*self._args, **options) + "".join(f"{note}\n" for note in notes)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    def save(self, path):
        """Write the PNG to ``path`` (a path or a binary file); needs matplotlib."""
        options = {key: value for key, value in self._options.items()
                   if key not in ("width_limit", "color")}
        return render_png(self._args[0], path, *self._args[1:], **options)

    def _repr_png_(self) -> bytes | None:
        """The PNG for a notebook, or None (the text is shown) without matplotlib."""
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return None
        buffer = io.BytesIO()
        self.save(buffer)
        return buffer.getvalue()


__all__ = ["DEFAULT_HEADS", "DEFAULT_WIDTH", "Picture", "Rendering", "SHADES", "demo_bindings",
           "format_picture", "heat_lines", "mask_lines", "picture", "render_example",
           "render_png", "render_text", "resolve_heads"]
