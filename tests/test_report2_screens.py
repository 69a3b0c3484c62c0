"""Issue 31: the report of a 5-row job, a 2,000-row job and a resumed job, each plot checked from
the figures the page draws (data of 2 points or more, labelled axes with units) and the page
rendered in headless Chromium (the screenshot is not blank). Chromium comes from
`apt-get install chromium` (.ci/run installs it); without it the screenshot check skips."""

import shutil
import subprocess

import numpy as np
import pytest
from helpers import prompts, run_cli, run_job, write_parquet
from matplotlib.collections import PathCollection
from matplotlib.patches import StepPatch
from PIL import Image

from batchgen.data.layout import REPORT_FILE
from batchgen.report import charts, plots
from batchgen.report.load import load

UNIT = ("(", "/ s", "rows")  # a unit in brackets, a rate, or a count of rows


@pytest.fixture(scope="module")
def outputs(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("report2")
    src = write_parquet(root / "in.parquet", {"prompt": prompts(2000)})
    five, big, resumed = root / "five", root / "big", root / "resumed"
    run_job(src, five, model, "--max-new-tokens", 4, "--limit", 5)
    run_job(src, big, model, "--max-new-tokens", 2)
    run_job(src, resumed, model, "--max-new-tokens", 3, "--limit", 4)
    run_job(src, resumed, model, "--max-new-tokens", 3, "--limit", 12)
    return {"five": five, "big": big, "resumed": resumed}


def _points(ax) -> int:
    """The most data points of one line, scatter or histogram on ax."""
    n = [int(np.isfinite(np.asarray(line.get_ydata(), float)).sum()) for line in ax.lines]
    n += [len(c.get_offsets()) for c in ax.collections if isinstance(c, PathCollection)]
    n += [len(p.get_data().values) for p in ax.patches if isinstance(p, StepPatch)]
    return max(n, default=0)


def _check_axes(fig, name):
    for ax in fig.axes:
        labels = [ax.get_ylabel()] + ([ax.get_xlabel()] if ax.get_xlabel() else [])
        assert ax.get_ylabel(), f"{name}: an axis without a y label"
        for label in labels:
            assert any(u in label for u in UNIT), f"{name}: no unit in {label!r}"
    primary = [ax for ax in fig.axes if ax.get_xlabel()]
    assert primary and all(_points(ax) >= 2 for ax in primary), name


@pytest.mark.parametrize("which", ["five", "big", "resumed"])
def test_every_plot_has_data_axes_and_units(outputs, which):
    data = load(outputs[which])
    assert data.steps is not None and len(data.steps["t_s"]) >= 1
    for name, fig in (
        ("throughput", plots.throughput(data.steps, data.stats)),
        ("occupancy", plots.occupancy(data.steps)),
        ("distributions", plots.distributions(data.stats)),
        ("roofline", plots.roofline(data.steps, data.stats)),
        ("rows", charts.rows_over_time(data.stats)),
    ):
        _check_axes(fig, f"{which} {name}")
    if which == "big":  # bins of time, not of 8 steps: far more than 4 points
        rates = plots.throughput(data.steps, data.stats).axes[0].lines[0]
        assert len(rates.get_xdata()) >= 60


@pytest.mark.parametrize("which", ["five", "big", "resumed"])
def test_the_page_says_how_fast_why_and_where(outputs, which):
    run_cli("report", outputs[which])
    page = (outputs[which] / REPORT_FILE).read_text()
    for words in ("rows / s", "started", "ended", "Where the time went", "How the rows ended"):
        assert words in page, words
    assert "batchgen run" in page and "--max-new-tokens" in page  # the job's command, options
    assert "target" not in page  # no online-serving targets
    if which == "resumed":
        assert "this output was resumed" in page


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (apt-get install chromium): no screenshot")
    return found


@pytest.mark.parametrize("which", ["five", "big", "resumed"])
def test_the_page_renders_in_chromium(outputs, which, tmp_path):
    browser = _chromium()
    run_cli("report", outputs[which])
    png = tmp_path / f"{which}.png"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    cmd = [browser, *flags, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}"]
    cmd += ["--window-size=1200,3000", (outputs[which] / REPORT_FILE).as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert png.exists(), "chromium wrote no screenshot"
    pixels = np.asarray(Image.open(png).convert("L"), dtype=np.float64)
    assert pixels.shape == (3000, 1200)
    assert pixels.std() > 20  # not blank: text and plots on white
    # the plots reach far down the page: its lower half is not empty either
    assert pixels[1500:].std() > 20


def test_phases_have_their_own_colours_and_a_figure_one_clock(outputs):
    """Warm-up and "other" were one colour in the time bar; the throughput figure put job
    time above time since the rows were queued, two origins on one page column."""
    every = {key: 1.0 for key, _, _ in charts.PHASES}
    parts = charts.phases({**every, "total_wall_s": 10.0})
    assert parts[-1][0].startswith("other") and len({c for _, _, c in parts}) == len(parts)
    data = load(outputs["five"])
    for fig in (plots.throughput(data.steps, data.stats), plots.occupancy(data.steps)):
        clocks = {ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()}
        assert clocks == {"seconds since the job started (s)"}, clocks
