"""Draw loss and throughput curves of training runs to a PNG, from log files or TensorBoard directories.

    python tools/plot_logs.py runs/demo/train.log --output curves.png
    python tools/plot_logs.py runs/a/tensorboard runs/b/tensorboard --output compare.png

Each input is one run: a text log holding Megatron log lines (``iteration N/ M | ... | lm loss: X |
throughput (tokens/s): Y | ...`` and ``validation loss at iteration N | lm loss value: X |``) or a
``--tensorboard-dir`` (scalars ``lm loss``, ``throughput``, ``lm loss validation``). The figure has
two panels: training loss with validation points, and throughput. Rendered with Pillow (which
TensorBoard already installs), so no plotting library is needed.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import QuietArgumentParser  # noqa: E402

TRAIN = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.eE+-]+|nan|inf) \|")
THROUGHPUT = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| throughput \(tokens/s\): ([0-9.eE+-]+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.eE+-]+|nan|inf) \|")
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]


@dataclass
class Run:
    """The curves of one run: ``(iteration, value)`` pairs by name."""

    name: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def read_log(path: str) -> Run:
    """Parse the Megatron log lines of a text log (anything else in the file is ignored)."""
    run = Run(os.path.basename(path.rstrip("/")))
    with open(path, errors="replace") as f:
        text = f.read()
    for name, pattern in (("train loss", TRAIN), ("throughput", THROUGHPUT), ("validation loss", VALID)):
        run.series[name] = sorted({int(i): float(v) for i, v in pattern.findall(text)}.items())
    return run


def read_tensorboard(path: str) -> Run:
    """Read the scalars the trainer writes from a TensorBoard directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(path, size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = set(accumulator.Tags().get("scalars", []))
    run = Run(os.path.basename(path.rstrip("/")))
    tags_by_name = {"train loss": "lm loss", "throughput": "throughput", "validation loss": "lm loss validation"}
    for name, tag in tags_by_name.items():
        events = accumulator.Scalars(tag) if tag in tags else []
        run.series[name] = sorted({e.step: e.value for e in events}.items())
    return run


def read_run(path: str) -> Run:
    """A log file or a TensorBoard directory (any directory is read as TensorBoard events)."""
    run = read_tensorboard(path) if os.path.isdir(path) else read_log(path)
    if not any(run.series.values()):
        raise SystemExit(f"error: {path} holds no training log lines or TensorBoard scalars")
    return run


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round numbers (1, 2 or 5 times a power of ten apart) covering ``[lo, hi]``."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int(math.ceil((hi - start) / step)) + 1)]


def format_tick(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.1e}"
    return f"{value:g}"


class Panel:
    """One chart: axes with ticks inside ``box`` of the image, lines in data coordinates."""

    def __init__(self, draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], title: str,
                 curves: list[tuple[str, list[tuple[int, float]], tuple[int, int, int], bool]]) -> None:
        self.draw, self.font = draw, ImageFont.load_default()
        left, top, right, bottom = box
        self.plot = (left + 70, top + 30, right - 20, bottom - 40)
        points = [(x, y) for _, data, _, _ in curves for x, y in data if math.isfinite(y)]
        xs, ys = [p[0] for p in points] or [0, 1], [p[1] for p in points] or [0, 1]
        self.xticks = nice_ticks(min(xs), max(xs))
        self.yticks = nice_ticks(min(ys), max(ys))
        draw.text((left + 70, top + 8), title, fill="black", font=self.font)
        self._axes()
        for i, (label, data, color, markers) in enumerate(curves):
            self._curve(data, color, markers)
            y = self.plot[1] + 6 + 14 * i
            draw.line([(self.plot[2] - 150, y + 6), (self.plot[2] - 130, y + 6)], fill=color, width=3)
            draw.text((self.plot[2] - 125, y), label, fill="black", font=self.font)

    def to_pixel(self, x: float, y: float) -> tuple[float, float]:
        (x0, y0, x1, y1), xt, yt = self.plot, self.xticks, self.yticks
        px = x0 + (x - xt[0]) / (xt[-1] - xt[0]) * (x1 - x0)
        py = y1 - (y - yt[0]) / (yt[-1] - yt[0]) * (y1 - y0)
        return px, py

    def _axes(self) -> None:
        x0, y0, x1, y1 = self.plot
        for x in self.xticks:
            px, _ = self.to_pixel(x, self.yticks[0])
            self.draw.line([(px, y0), (px, y1)], fill=(225, 225, 225))
            self.draw.text((px - 10, y1 + 6), format_tick(x), fill="black", font=self.font)
        for y in self.yticks:
            _, py = self.to_pixel(self.xticks[0], y)
            self.draw.line([(x0, py), (x1, py)], fill=(225, 225, 225))
            self.draw.text((x0 - 62, py - 6), format_tick(y), fill="black", font=self.font)
        self.draw.rectangle(self.plot, outline="black")
        self.draw.text(((x0 + x1) // 2 - 20, y1 + 22), "iteration", fill="black", font=self.font)

    def _curve(self, data: list[tuple[int, float]], color: tuple[int, int, int], markers: bool) -> None:
        pixels = [self.to_pixel(x, y) for x, y in data if math.isfinite(y)]
        if len(pixels) > 1 and not markers:
            self.draw.line(pixels, fill=color, width=2)
        if markers or len(pixels) == 1:
            for px, py in pixels:
                self.draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=color)


def plot(runs: list[Run], output: str, width: int = 900, height: int = 700) -> None:
    """Write the loss panel (train lines, validation dots) above the throughput panel to ``output``."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    loss_curves, speed_curves = [], []
    for i, run in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        loss_curves.append((f"{prefix}train", run.series.get("train loss", []), color, False))
        if run.series.get("validation loss"):
            faded = tuple((c + 255) // 2 for c in color)
            loss_curves.append((f"{prefix}validation", run.series["validation loss"], faded, True))
        speed_curves.append((f"{prefix}tokens/s", run.series.get("throughput", []), color, False))
    Panel(draw, (0, 0, width, height * 6 // 10), "lm loss", loss_curves)
    Panel(draw, (0, height * 6 // 10, width, height), "throughput (tokens/s)", speed_curves)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    image.save(output)


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="training log files or TensorBoard directories (one per run)")
    parser.add_argument("--output", default="training_curves.png", help="PNG to write")
    parser.add_argument("--width", type=int, default=900)
    parser.add_argument("--height", type=int, default=700)
    args = parser.parse_args(argv)
    runs = [read_run(path) for path in args.inputs]
    plot(runs, args.output, args.width, args.height)
    for run in runs:
        counts = ", ".join(f"{len(v)} {k} points" for k, v in run.series.items())
        print(f"{run.name}: {counts}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
