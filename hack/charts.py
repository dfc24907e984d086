#!/usr/bin/env python3
"""Draws the benchmark page's two charts from their data files, standard library only.

  docs/img/cost-curve.tsv   -> docs/img/cost-curve.svg    the reconcile bench at N = 1,000 / 3,000
                                                          / 10,000: memory, lag, apply -> Ready
  docs/img/side-by-side.tsv -> docs/img/side-by-side.svg  Settle and NACK at 1,000, measure by measure

Each TSV starts with `# command:` (the bench that produced its figures) and `# machine:` lines,
which the chart's caption repeats, then a header row and one row per N (or per measure). The SVGs
depend on nothing but the TSVs: no timestamps, fixed number formats, so the same TSV gives a
byte-identical SVG, and `--check` can tell whether the committed SVGs are the ones the TSVs make.

usage:
  hack/charts.py                      write both SVGs from the TSVs
  hack/charts.py --from-bench FILE    first replace (or add) the cost-curve.tsv row of every
                                      `bench-row<TAB>cost-curve<TAB>n=...` line in FILE (saved
                                      output of `cargo bench -p settle-operator --bench reconcile
                                      -- N 0`; FILE may be given more than once), then write both
  hack/charts.py --check              write nothing; exit 1 if an SVG differs from what its TSV
                                      makes (or is missing), naming it
"""

import argparse
import math
import textwrap
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"

WIDTH = 800
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
INK = "#1a202c"
MUTED = "#4a5568"
GRID = "#e2e8f0"
AXIS = "#718096"
SETTLE = "#2b6cb0"
NACK = "#c05621"
NACK_RANGE = "#f6ad55"
LAG = {"max": "#c53030", "p95": "#2b6cb0", "p50": "#718096"}

COST_COLUMNS = [
    "n", "rss_rest_mib", "rss_per_sub_kib", "lag_p50_s", "lag_p95_s", "lag_max_s",
    "api_per_sub", "all_ready_s", "cpu_rest_s_per_min",
]
SIDE_COLUMNS = ["measure", "unit", "settle", "nack_min", "nack_max"]


# ---------------------------------------------------------------- data files

class Table:
    """A TSV: its leading `# key: value` comments (kept in order), a header, rows of strings."""

    def __init__(self, path: Path, columns: list[str]):
        self.path = path
        self.comments: list[str] = []
        self.meta: dict[str, str] = {}
        self.rows: list[dict[str, str]] = []
        lines = path.read_text(encoding="utf-8").splitlines()
        body = []
        for line in lines:
            if line.startswith("#") and not body:
                self.comments.append(line)
                key, sep, value = line[1:].strip().partition(":")
                if sep:
                    self.meta.setdefault(key.strip(), value.strip())
            elif line.strip():
                body.append(line)
        if not body:
            fail(f"{path}: no header row")
        self.header = body[0].split("\t")
        if self.header != columns:
            fail(f"{path}: header {self.header}, expected {columns}")
        for i, line in enumerate(body[1:], start=2):
            cells = line.split("\t")
            if len(cells) != len(columns):
                fail(f"{path}: data row {i - 1} has {len(cells)} cells, expected {len(columns)}")
            self.rows.append(dict(zip(columns, cells)))
        if "command" not in self.meta:
            fail(f"{path}: no `# command:` line at the top")

    def text(self) -> str:
        out = list(self.comments) + ["\t".join(self.header)]
        out += ["\t".join(row[c] for c in self.header) for row in self.rows]
        return "\n".join(out) + "\n"


def fail(message: str) -> None:
    print(f"charts.py: {message}", file=sys.stderr)
    sys.exit(2)


def num(table: Table, row: dict[str, str], column: str) -> float:
    try:
        value = float(row[column])
    except ValueError:
        fail(f"{table.path}: {column}={row[column]!r} is not a number")
    if not math.isfinite(value):
        fail(f"{table.path}: {column}={row[column]!r} is not finite")
    return value


def merge_bench(table: Table, files: list[Path]) -> int:
    """Replaces or adds the cost-curve row of each `bench-row\tcost-curve\t...` line; returns how
    many lines were taken."""
    taken = 0
    for file in files:
        for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
            cells = line.rstrip("\r").split("\t")
            if cells[:2] != ["bench-row", "cost-curve"]:
                continue
            fields = {}
            for cell in cells[2:]:
                key, sep, value = cell.partition("=")
                if not sep:
                    fail(f"{file}: bench-row field {cell!r} is not key=value")
                fields[key] = value
            missing = [c for c in COST_COLUMNS if c not in fields]
            if missing:
                fail(f"{file}: bench-row without {', '.join(missing)}: {line}")
            row = {c: fields[c] for c in COST_COLUMNS}
            n = row["n"]
            if not n.isdigit() or int(n) < 1:
                fail(f"{file}: bench-row n={n!r} is not a positive whole number")
            for c in COST_COLUMNS[1:]:
                num(table, row, c)
            table.rows = [r for r in table.rows if int(r["n"]) != int(n)] + [row]
            taken += 1
    table.rows.sort(key=lambda r: int(r["n"]))
    return taken


# ---------------------------------------------------------------- SVG pieces

def esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def f1(v: float) -> str:
    s = f"{v:.1f}"
    return "0.0" if s == "-0.0" else s


def text(x, y, s, size=11, anchor="start", fill=INK, weight=None, extra=""):
    w = f' font-weight="{weight}"' if weight else ""
    return (f'<text x="{f1(x)}" y="{f1(y)}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}"{w}{extra}>{esc(s)}</text>')


def line(x1, y1, x2, y2, stroke=AXIS, width=1, dash=None):
    d = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{f1(x1)}" y1="{f1(y1)}" x2="{f1(x2)}" y2="{f1(y2)}" '
            f'stroke="{stroke}" stroke-width="{width}"{d}/>')


def rect(x, y, w, h, fill, extra=""):
    return f'<rect x="{f1(x)}" y="{f1(y)}" width="{f1(w)}" height="{f1(h)}" fill="{fill}"{extra}/>'


def polyline(points, stroke, width=2, dash=None):
    d = f' stroke-dasharray="{dash}"' if dash else ""
    pts = " ".join(f"{f1(x)},{f1(y)}" for x, y in points)
    return (f'<polyline points="{pts}" fill="none" stroke="{stroke}" stroke-width="{width}" '
            f'stroke-linejoin="round"{d}/>')


def dot(x, y, fill, r=3.5):
    return f'<circle cx="{f1(x)}" cy="{f1(y)}" r="{r}" fill="{fill}" stroke="#ffffff" stroke-width="1"/>'


def document(height: int, title: str, body: list[str]) -> str:
    head = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="{FONT}" role="img">',
        f"<title>{esc(title)}</title>",
        "<!-- generated by hack/charts.py from the .tsv beside this file; do not edit -->",
        rect(0, 0, WIDTH, height, "#ffffff"),
    ]
    return "\n".join(head + body + ["</svg>"]) + "\n"


def caption(body: list[str], x: float, y: float, paragraphs: list[str]) -> int:
    """Appends the caption's lines, wrapped to the width; returns the height below them."""
    for paragraph in paragraphs:
        for i, part in enumerate(textwrap.wrap(paragraph, 128, break_on_hyphens=False)):
            body.append(text(x + (12 if i else 0), y, part, size=11, fill=MUTED))
            y += 17
    return int(y)


def nice_step(span: float, target: int) -> float:
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw - 1e-12:
            return m * mag
    return 10 * mag


def tick_label(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    if step < 1 and round(step * 10 ** decimals) % 1:
        decimals += 1
    return f"{v:,.{decimals}f}"


def thousands(n: int) -> str:
    return f"{n:,}"


# ---------------------------------------------------------------- cost curve

class Panel:
    """One small multiple: a log x-axis of N shared by all, a linear or log y-axis of its own."""

    TOP, BOTTOM = 104, 310

    def __init__(self, x0, width, ns, right_pad):
        self.left = x0 + 48
        self.right = x0 + width - right_pad
        self.ns = ns
        self.out: list[str] = []
        lo, hi = math.log10(ns[0]), math.log10(ns[-1])
        inner = 18
        if hi == lo:
            self.x = lambda n: (self.left + self.right) / 2
        else:
            self.x = lambda n: (self.left + inner + (math.log10(n) - lo) / (hi - lo)
                                * (self.right - self.left - 2 * inner))

    def y_linear(self, vmax):
        step = nice_step(max(vmax, 1e-9) * 1.12, 5)
        top = step * math.ceil(max(vmax, 1e-9) * 1.12 / step)
        self.y = lambda v: self.BOTTOM - v / top * (self.BOTTOM - self.TOP)
        ticks = [i * step for i in range(int(round(top / step)) + 1)]
        for t in ticks:
            self.grid(t, tick_label(t, step))

    def y_log(self, vmin, vmax):
        lo = math.floor(math.log10(vmin))
        hi = max(math.ceil(math.log10(vmax)), lo + 1)
        span = hi - lo
        self.y = lambda v: self.BOTTOM - (math.log10(v) - lo) / span * (self.BOTTOM - self.TOP)
        for d in range(lo, hi + 1):
            v = 10.0 ** d
            self.grid(v, f"{v:g}")
            if d < hi:
                for m in range(2, 10):
                    y = self.y(m * v)
                    self.out.append(line(self.left, y, self.right, y, stroke=GRID, width=0.5))

    def grid(self, v, label):
        y = self.y(v)
        self.out.append(line(self.left, y, self.right, y, stroke=GRID))
        self.out.append(text(self.left - 6, y + 4, label, size=11, anchor="end", fill=MUTED))

    def frame(self, title, unit):
        x0 = self.left - 48
        self.out.insert(0, text(x0, 84, title, size=13, weight="bold"))
        self.out.insert(1, text(self.left - 6, self.TOP - 8, unit, size=11, anchor="end", fill=MUTED))
        self.out.append(line(self.left, self.BOTTOM, self.right, self.BOTTOM, stroke=AXIS))
        self.out.append(line(self.left, self.TOP, self.left, self.BOTTOM, stroke=AXIS))
        for n in self.ns:
            x = self.x(n)
            self.out.append(line(x, self.BOTTOM, x, self.BOTTOM + 4, stroke=AXIS))
            self.out.append(text(x, self.BOTTOM + 17, thousands(n), size=11, anchor="middle", fill=MUTED))
        self.out.append(text((self.left + self.right) / 2, self.BOTTOM + 52,
                             "Subscriptions N (log scale)", size=11, anchor="middle", fill=MUTED))

    def series(self, values, labels, color, place="above", dash=None):
        pts = [(self.x(n), self.y(v)) for n, v in zip(self.ns, values)]
        self.out.append(polyline(pts, color, dash=dash))
        for i, ((x, y), label) in enumerate(zip(pts, labels)):
            self.out.append(dot(x, y, color))
            if place == "rising" and i > 0:
                # up and to the left, away from a line that rises to the right
                self.out.append(text(x - 6, y - 6, label, size=10, anchor="end", fill=color))
            else:
                dy = 15 if place == "below" else -8
                self.out.append(text(x, y + dy, label, size=10, anchor="middle", fill=color))
        return pts


def cost_curve(table: Table) -> str:
    rows = table.rows
    if not rows:
        fail(f"{table.path}: no data rows")
    ns = [int(r["n"]) for r in rows]
    if ns != sorted(set(ns)):
        fail(f"{table.path}: N not increasing and unique: {ns}")
    col = {c: [num(table, r, c) for r in rows] for c in COST_COLUMNS[1:]}
    raw = {c: [r[c] for r in rows] for c in COST_COLUMNS[1:]}
    margin, gap = 16, 22
    width = (WIDTH - 2 * margin - 2 * gap) / 3
    xs = [margin + i * (width + gap) for i in range(3)]
    body = [
        text(margin, 30, "Settle's cost curve: N Subscriptions created at once", size=18, weight="bold"),
        text(margin, 52, "One server-side apply of N Subscriptions (chunks of 250, 4 at a time), "
             "1,000 per stream; the operator as a process", size=12, fill=MUTED),
    ]

    # 1. memory at rest, and the growth per Subscription under the N axis
    p = Panel(xs[0], width, ns, 14)
    p.y_linear(max(col["rss_rest_mib"]))
    p.series(col["rss_rest_mib"], raw["rss_rest_mib"], SETTLE, "rising")
    p.frame("Memory (RSS) at rest", "MiB")
    p.out.append(text(p.left - 6, p.BOTTOM + 33, "per Sub.", size=10, anchor="end", fill=MUTED))
    for n, v in zip(ns, raw["rss_per_sub_kib"]):
        p.out.append(text(p.x(n), p.BOTTOM + 33, f"{v} KiB", size=10, anchor="middle", fill=SETTLE))
    body += p.out

    # 2. lag from creation to Ready: p50, p95, max on a log axis
    p = Panel(xs[1], width, ns, 34)
    lags = col["lag_p50_s"] + col["lag_p95_s"] + col["lag_max_s"]
    if min(lags) <= 0:
        fail(f"{table.path}: a lag of 0 or less cannot go on the log axis")
    p.y_log(min(lags), max(lags))
    for name, place in (("max", "above"), ("p95", "above"), ("p50", "below")):
        pts = p.series(col[f"lag_{name}_s"], raw[f"lag_{name}_s"], LAG[name], place)
        x, y = pts[-1]
        p.out.append(text(x + 9, y + 4, name, size=11, fill=LAG[name], weight="bold"))
    p.frame("Lag create → Ready", "s (log)")
    body += p.out

    # 3. from the apply's start until all are Ready, beside a line proportional to N
    p = Panel(xs[2], width, ns, 14)
    ready = col["all_ready_s"]
    p.y_linear(max(ready + [ready[0] * ns[-1] / ns[0]]))
    if len(ns) > 1:
        steps = 24
        lo, hi = math.log10(ns[0]), math.log10(ns[-1])
        ref = [(p.x(10 ** (lo + (hi - lo) * i / steps)),
                p.y(ready[0] * 10 ** (lo + (hi - lo) * i / steps) / ns[0])) for i in range(steps + 1)]
        p.out.append(polyline(ref, AXIS, width=1.5, dash="5 4"))
        lx, ly = p.left + 10, p.TOP + 12
        p.out.append(line(lx, ly, lx + 22, ly, stroke=AXIS, width=1.5, dash="5 4"))
        p.out.append(text(lx + 28, ly + 4, f"∝ N from {thousands(ns[0])}", size=10, fill=MUTED))
    p.series(ready, raw["all_ready_s"], SETTLE, "rising")
    p.frame("Apply → all Ready", "s")
    body += p.out

    per_n = " / ".join(thousands(n) for n in ns)
    y = caption(body, margin, 392, [
        f"Command: {table.meta['command']}; machine: {table.meta.get('machine', '?')}.",
        "Per Sub.: (RSS at rest − RSS before the apply) / N. Lag: each Subscription's creation to its "
        "Ready, seen by one watch.",
        f"At N = {per_n}: {' / '.join(raw['api_per_sub'])} API requests per Subscription; "
        f"{' / '.join(raw['cpu_rest_s_per_min'])} CPU s a minute at rest.",
    ])
    return document(y, "Settle's cost curve: memory, lag and time to Ready against N", body)


# ---------------------------------------------------------------- side by side

def with_unit(value: str, unit: str) -> str:
    if not unit:
        return value
    if unit in ("×", "x", "%"):
        return value + unit
    return f"{value} {unit}"


def side_by_side(table: Table) -> str:
    rows = table.rows
    if not rows:
        fail(f"{table.path}: no data rows")
    margin = 16
    label_w = 118
    bar_x = margin + label_w
    bar_w = 520
    bar_h = 22
    group_h = 92
    top = 96
    body = [
        text(margin, 30, "Settle beside NATS NACK at 1,000 Subscriptions (NACK: Consumers)",
             size=18, weight="bold"),
        text(margin, 52, "Each measure on its own scale, from zero; lower is better in every row",
             size=12, fill=MUTED),
    ]
    lx = bar_x
    body += [rect(lx, 64, 14, 12, SETTLE), text(lx + 20, 75, "Settle", size=12)]
    lx += 90
    body += [rect(lx, 64, 14, 12, NACK), text(lx + 20, 75, "NACK v0.22.4", size=12)]
    lx += 130
    body += [rect(lx, 64, 14, 12, NACK_RANGE), text(lx + 20, 75, "NACK: the range measured", size=12)]

    for i, row in enumerate(rows):
        y0 = top + i * group_h
        settle = num(table, row, "settle")
        lo, hi = num(table, row, "nack_min"), num(table, row, "nack_max")
        if lo > hi:
            fail(f"{table.path}: {row['measure']}: nack_min above nack_max")
        if min(settle, lo) < 0:
            fail(f"{table.path}: {row['measure']}: a negative figure cannot be a bar from zero")
        scale = bar_w / max(settle, hi, 1e-9)
        unit = row["unit"]
        body.append(text(margin, y0 + 14, row["measure"], size=13, weight="bold"))
        body.append(line(bar_x, y0 + 22, bar_x, y0 + 28 + 2 * bar_h + 6, stroke=AXIS))
        # Settle
        y = y0 + 24
        body.append(text(bar_x - 8, y + 15, "Settle", size=12, anchor="end"))
        body.append(rect(bar_x, y, settle * scale, bar_h, SETTLE))
        body.append(text(bar_x + settle * scale + 6, y + 15, with_unit(row["settle"], unit),
                         size=12, weight="bold"))
        # NACK: solid to its lowest run, lighter to its highest
        y += bar_h + 6
        body.append(text(bar_x - 8, y + 15, "NACK", size=12, anchor="end"))
        body.append(rect(bar_x, y, lo * scale, bar_h, NACK))
        if hi > lo:
            body.append(rect(bar_x + lo * scale, y, (hi - lo) * scale, bar_h, NACK_RANGE))
            label = with_unit(f"{row['nack_min']}–{row['nack_max']}", unit)
        else:
            label = with_unit(row["nack_min"], unit)
        body.append(text(bar_x + hi * scale + 6, y + 15, label, size=12, weight="bold"))

    y = caption(body, margin, top + len(rows) * group_h + 8, [
        f"Settle: {table.meta['command']}. NACK: {table.meta.get('nack', '?')}.",
        f"Machine: {table.meta.get('machine', '?')}.",
    ])
    return document(y, "Settle beside NATS NACK at 1,000 Subscriptions", body)


# ---------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-bench", action="append", type=Path, default=[], metavar="FILE",
                    help="saved bench output whose bench-row lines update cost-curve.tsv")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the SVGs are not what the TSVs make; write nothing")
    ap.add_argument("--img-dir", type=Path, default=IMG, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.check and args.from_bench:
        fail("--check and --from-bench do not go together")

    cost = Table(args.img_dir / "cost-curve.tsv", COST_COLUMNS)
    side = Table(args.img_dir / "side-by-side.tsv", SIDE_COLUMNS)
    if args.from_bench:
        taken = merge_bench(cost, args.from_bench)
        if not taken:
            fail("no `bench-row<TAB>cost-curve` line in " + ", ".join(map(str, args.from_bench)))
        cost.path.write_text(cost.text(), encoding="utf-8")
        print(f"charts.py: {taken} bench row(s) into {cost.path.relative_to(ROOT) if cost.path.is_relative_to(ROOT) else cost.path}")

    made = {
        args.img_dir / "cost-curve.svg": cost_curve(cost),
        args.img_dir / "side-by-side.svg": side_by_side(side),
    }
    stale = []
    for path, svg in made.items():
        if args.check:
            if not path.exists() or path.read_bytes() != svg.encode("utf-8"):
                stale.append(path)
        else:
            path.write_bytes(svg.encode("utf-8"))
    if stale:
        for path in stale:
            print(f"charts.py: {path} is not what {path.with_suffix('.tsv').name} makes; "
                  "run hack/charts.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
