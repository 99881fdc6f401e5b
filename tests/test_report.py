"""The run report: a real 2-rank FSDP2 run (the demo's trainer and config on 2 CPU ranks, every
rank's timers) turned into one HTML page by ``distmetrics report``, opened in a real headless
Chromium, screenshotted, and checked: the page loads with no error, every image decodes and is
not blank. Then the reader on hand-written files (restarts, NaN, a line cut short) and a
synthetic file with every feature (tests/synthetic_run.py).

The browser is driven through its command line (``--dump-dom``, ``--screenshot``): a copy of the
page gets a small script that records errors and draws every image into a canvas (which forces
the decode) and counts its colours; the report itself holds no script. Chromium comes from the
Debian packages (``apt-get install -y chromium``; .ci/run installs it): without it the browser
tests skip, saying so, unless DISTMETRICS_REQUIRE_CHROMIUM is set (CI), where they fail.
"""

import base64
import html
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy", reason="the report extra is not installed: pip install numpy matplotlib")
pytest.importorskip("matplotlib", reason="the report extra is not installed: pip install numpy matplotlib")
Image = pytest.importorskip("PIL.Image", reason="Pillow (the dev extra) decodes the images")

from distmetrics.report import load_metrics, write_report  # noqa: E402
from distmetrics.report.store import StepGrid  # noqa: E402
from tests.dist_utils import free_port, run_python, run_ranks  # noqa: E402
from tests.synthetic_run import generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL = "apt-get install -y chromium"


def needs_chromium(test):
    """A browser test: run where Chromium is on PATH; else skipped, saying so, or where
    DISTMETRICS_REQUIRE_CHROMIUM is set (CI), failed without its fixtures: raising at import stopped
    the whole run at collection, every other test of the run unrun."""
    if CHROMIUM is not None:
        return test
    if not os.environ.get("DISTMETRICS_REQUIRE_CHROMIUM"):
        return pytest.mark.skip(reason=f"no chromium binary on PATH; install it: {INSTALL}")(test)

    def fail() -> None:
        pytest.fail(f"DISTMETRICS_REQUIRE_CHROMIUM is set but no chromium binary is on PATH ({INSTALL})")

    fail.__name__, fail.__qualname__, fail.__doc__ = test.__name__, test.__qualname__, test.__doc__
    return fail


PROBE = r"""
(function () {
  var errors = [];
  var original = console.error;
  console.error = function () {
    errors.push("console.error: " + Array.prototype.join.call(arguments, " "));
    return original.apply(console, arguments);
  };
  window.addEventListener("error", function (e) {
    if (e.target && e.target !== window && e.target.tagName) errors.push("resource: <" + e.target.tagName.toLowerCase() + ">");
    else errors.push("js: " + e.message);
  }, true);
  window.addEventListener("load", function () {
    var images = Array.prototype.slice.call(document.images).map(function (img) {
      var r = {w: img.naturalWidth, h: img.naturalHeight, complete: img.complete, colours: 0, error: null};
      if (!img.complete || !img.naturalWidth) return r;
      try {
        var c = document.createElement("canvas");
        c.width = img.naturalWidth; c.height = img.naturalHeight;
        var ctx = c.getContext("2d");
        ctx.drawImage(img, 0, 0);
        var d = ctx.getImageData(0, 0, c.width, c.height).data, seen = {}, n = 0;
        var stride = Math.max(4, 4 * Math.floor(d.length / 4 / 20000));
        for (var k = 0; k < d.length && n < 64; k += stride) {
          var key = d[k] + "," + d[k + 1] + "," + d[k + 2] + "," + d[k + 3];
          if (!seen[key]) { seen[key] = 1; n++; }
        }
        r.colours = n;
      } catch (e) { r.error = String(e); }
      return r;
    });
    var pre = document.createElement("pre");
    pre.id = "__check";
    pre.textContent = JSON.stringify({images: images, errors: errors});
    document.body.appendChild(pre);
  });
})();
"""


# --- helpers ------------------------------------------------------------------------------------

def _chromium(args: list, profile: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def browser_check(page: Path, tmp: Path) -> dict:
    """Open an instrumented copy of ``page``: {images: [{w, h, complete, colours, error}], errors: [...]}."""
    text = page.read_text(encoding="utf-8")
    probe = tmp / f"probe_{page.name}"
    probe.write_text(text.replace("<head>", f"<head><script>{PROBE}</script>", 1), encoding="utf-8")
    run = _chromium(["--virtual-time-budget=10000", "--dump-dom", probe.as_uri()], tmp / "profile-check")
    found = re.search(r'<pre id="__check">(.*?)</pre>', run.stdout, re.S)
    assert found, f"no check result in the DOM (exit {run.returncode}): {run.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def screenshot(page: Path, out: Path, tmp: Path, size: str = "1300,6000") -> subprocess.CompletedProcess:
    return _chromium([f"--window-size={size}", f"--screenshot={out}", page.as_uri()], tmp / "profile-shot")


def console_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def decode_png(data: bytes) -> "np.ndarray":
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGBA"))


def colours(pixels: "np.ndarray") -> int:
    """Distinct RGBA colours (each pixel read as one 32-bit number)."""
    return int(np.unique(np.ascontiguousarray(pixels, dtype=np.uint8).view(np.uint32)).size)


def embedded_pngs(page: str) -> list:
    return [base64.b64decode(m) for m in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def _report_cli(*args: str, code: str = "") -> subprocess.CompletedProcess:
    program = code + "import sys; from distmetrics.cli import main; sys.exit(main(sys.argv[1:]))"
    return run_python("-c", program, "report", *args, timeout=300)


# --- a real 2-rank run ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """The demo's trainer and config on 2 CPU ranks, every rank's timers kept (``all``)."""
    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", NPROC_PER_NODE="2",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    env.pop("SLURM_JOB_ID", None)
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), str(ROOT / "launch" / "train_fsdp.py"),
                          "--steps", "20", "--eval-every", "10", "--save-every", "0", "--config", "configs/demo.yaml",
                          "timing_log_option=all", "log_interval=2", "straggler_window=3", "straggler_report_every=2",
                          "console=false", "tensorboard=false", f"output_dir={out}"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def demo_report(demo_run) -> Path:
    made = _report_cli(str(demo_run))
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.strip() == f"report: {demo_run / 'report.html'}"
    return demo_run / "report.html"


def test_demo_report_is_one_self_contained_page(demo_report):
    page = demo_report.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    assert not re.search(r"https?://", page), "nothing outside the page"
    sources = re.findall(r'src="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    for heading in ("Loss and learning rate", "Gradients, updates and parameters", "Timers and stragglers",
                    "Throughput, MFU, SOL, ETA", "Memory, power, energy", "Alerts and health"):
        assert heading in page
    for figure in ("grad_norm/&lt;module&gt;", "update_norm/&lt;module&gt;", "param_norm/&lt;module&gt;",
                   "relative_update_norm/&lt;module&gt;", "timers/step: ranks x steps",
                   "timers/forward-backward: ranks x steps", "Straggler score of the slowest rank",
                   "The last <code>stragglers</code> record", "Eval gap", "(in model order)"):
        assert figure in page, figure


def test_demo_images_decode_and_are_not_blank(demo_report):
    pngs = embedded_pngs(demo_report.read_text(encoding="utf-8"))
    assert len(pngs) >= 10
    for data in pngs:
        pixels = decode_png(data)
        assert pixels.shape[0] > 50 and pixels.shape[1] > 50
        assert colours(pixels) > 16, "an image of (almost) one colour"


def test_module_rows_follow_the_model_not_the_alphabet(demo_run):
    from launch.common import GPT

    model = GPT(128, 64, 2, 4, 32)  # the trainer's defaults
    # every module with parameters anywhere below it has a (subtree) norm, in the model's order
    truth = ["model"] + [name for name, module in model.named_modules()
                         if name and any(True for _ in module.parameters())]
    data = load_metrics(demo_run)
    ordered = [data.modules[i] for i in data.module_rows]
    assert ordered == truth
    assert ordered != sorted(ordered)


@needs_chromium
def test_demo_report_in_chromium_loads_with_no_error_and_every_image_drawn(demo_report, tmp_path):
    result = browser_check(demo_report, tmp_path)
    assert result["errors"] == []
    images = result["images"]
    assert len(images) == len(embedded_pngs(demo_report.read_text(encoding="utf-8")))
    for image in images:
        assert image["complete"] and image["w"] > 0 and image["h"] > 0 and image["error"] is None, image
        assert image["colours"] > 1, f"a blank image: {image}"


@needs_chromium
def test_demo_report_screenshot(demo_report, tmp_path):
    folder = Path(os.environ.get("REPORT_SCREENSHOT_DIR", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    shot = folder / "report_demo.png"
    shot.unlink(missing_ok=True)
    run = screenshot(demo_report, shot, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert console_lines(run.stderr) == [], "the page wrote to the browser console"
    pixels = decode_png(shot.read_bytes())
    assert pixels.shape[:2] == (6000, 1300)
    assert colours(pixels) > 100
    top = pixels[:1500, :, :3].astype(int)
    assert (top.sum(axis=2) < 600).mean() > 0.01, "the top of the page has (almost) no ink"


def test_without_chromium_the_browser_tests_skip_saying_so_or_fail_where_it_is_required(tmp_path):
    """Without Chromium on PATH the browser tests skip with the install line; with
    DISTMETRICS_REQUIRE_CHROMIUM set (CI) they fail, and only they: the run's other tests still run (the
    check used to raise at import, which stopped the whole run at collection)."""
    chosen = ["-k", "browser_check_sees or test_a_missing_extra_is_named"]
    for required, said in (("", "1 passed, 1 skipped"), ("1", "1 failed, 1 passed")):
        env = {k: v for k, v in os.environ.items() if k != "DISTMETRICS_REQUIRE_CHROMIUM"}
        env.update(PATH=str(tmp_path), DISTMETRICS_REQUIRE_CHROMIUM=required)  # a PATH holding no browser
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                              "tests/test_report.py", *chosen], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=240)
        assert said in run.stdout, (required, run.stdout[-2000:])
        assert INSTALL in run.stdout, run.stdout[-2000:]


@needs_chromium
def test_the_browser_check_sees_broken_and_blank_images_and_errors(tmp_path):
    """The check can fail: a broken image, a blank image and console errors are all caught."""
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), "white").save(buffer, format="PNG")
    blank = base64.b64encode(buffer.getvalue()).decode()
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><head><title>x</title></head><body>"
                    '<img src="data:image/png;base64,AAAAbroken">'
                    f'<img src="data:image/png;base64,{blank}">'
                    "<script>console.error('boom'); missingFunction();</script></body></html>", encoding="utf-8")
    result = browser_check(page, tmp_path)
    broken, white = result["images"]
    assert broken["w"] == 0 and white["w"] == 40 and white["colours"] == 1
    assert any("boom" in e for e in result["errors"]) and any("missingFunction" in e for e in result["errors"])
    assert any(e.startswith("resource: <img>") for e in result["errors"])
    assert console_lines(screenshot(page, tmp_path / "bad.png", tmp_path, size="300,200").stderr)


# --- the command --------------------------------------------------------------------------------

def test_a_missing_extra_is_named_with_exit_status_2(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "train/loss": 1.0}\n')
    run = _report_cli(str(tmp_path), code="import sys; sys.modules['matplotlib'] = None; ")
    assert run.returncode == 2
    assert "pip install numpy matplotlib" in run.stderr
    assert not (tmp_path / "report.html").exists()


def test_no_metrics_file_or_not_a_metrics_file_is_exit_status_2(tmp_path):
    run = _report_cli(str(tmp_path))
    assert run.returncode == 2 and "is a folder without metrics.jsonl" in run.stderr
    run = _report_cli(str(ROOT / "README.md"), "--out", str(tmp_path / "r.html"))
    assert run.returncode == 2 and "README.md' is not a distmetrics metrics.jsonl" in run.stderr
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("text", ["", "\n\n", '{"step": 3, "x": 1}\n', '{"kind": "train", "step": 3.0}\n'],
                         ids=["empty", "blank lines", "no kind", "a float step"])
def test_summary_and_report_refuse_the_same_files(tmp_path, capsys, text):
    """An empty file, or records without a kind or with a float step: summary refused them
    (status 2), the report wrote a page. An empty file is a run that wrote nothing, said so, not a
    file that is no metrics.jsonl."""
    from distmetrics import cli
    from distmetrics.report import EmptyMetricsFile, NotAMetricsFile

    (tmp_path / "metrics.jsonl").write_text(text)
    assert cli.main(["summary", str(tmp_path)]) == 2
    refused, message = ((EmptyMetricsFile, "holds no record: ") if not text.strip() else
                        (NotAMetricsFile, "is not a distmetrics metrics.jsonl: none of its 1 non-blank line(s)"))
    with pytest.raises(refused, match=re.escape(message)) as raised:
        write_report(tmp_path)
    said = capsys.readouterr().err
    assert said == f"error: {raised.value}\n", (said, raised.value)
    assert ("a run that wrote nothing" in said) == (not text.strip()), said


def test_summary_and_report_read_odd_lines_by_one_rule(tmp_path, capsys):
    """A byte-order mark before the run record (summary: "records before any run record"), a line
    of spaces (unreadable to the report), a step of true (a step to summary), a run record without
    a step (a job to the report): the two commands read each line differently."""
    from distmetrics import cli

    lines = ['\ufeff{"kind": "run", "step": 0, "world_size": 1, "hosts": ["n0"]}',
             '{"kind": "train", "step": 1, "train/loss": 2.0}', "   \t  ",
             '{"kind": "train", "step": true, "train/loss": 9.0}',
             '{"kind": "run", "world_size": 1}',  # no step: no record, so no second job
             '{"kind": "train", "step": 2, "train/loss": 1.0}']
    (tmp_path / "metrics.jsonl").write_bytes("\n".join(lines).encode("utf-8") + b"\n")
    assert cli.main(["summary", str(tmp_path)]) == 0
    summary = capsys.readouterr().out
    assert "1 job(s), 2 unreadable line(s) skipped" in summary and "records before any run record" not in summary
    assert "job 1: started None, world size 1, hosts n0" in summary and "2 train, 0 eval" in summary, summary
    data = load_metrics(tmp_path)
    assert (data.lines, data.blank_lines, data.bad_lines, len(data.jobs)) == (6, 1, 2, 1)
    assert data.jobs[0]["world_size"] == 1 and data.scalars.series("train/loss")[2].tolist() == [2.0, 1.0]
    assert cli.main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "6 lines, 2 unreadable" in page and "2 metric records (train, eval, tensor_stats), 1 job(s)" in page


def test_a_report_the_disk_has_no_room_for_names_its_file_and_leaves_no_part(tmp_path):
    """On a full disk the report's write failed with `error: [Errno 28] No space left on device`, naming no
    file. Here a file size limit (ulimit -f: EFBIG) stands in for the full disk."""
    lines = ['{"kind": "run", "step": 0, "world_size": 1, "hosts": ["n0"]}', '{"kind": "train", "step": 1, "x": 2.0}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); ")
    done = _report_cli(str(tmp_path), code=code)
    assert done.returncode == 2 and done.stderr.startswith("error: [Errno 27] File too large: ")
    assert str(tmp_path / "report.html") in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_metric_named_with_dollar_signs_is_drawn_as_text(tmp_path):
    """matplotlib read a title holding "$...$" as mathtext: a name it could not parse ("u/$\\frac{a$") left the
    whole "Other metrics" figure undrawn (every other metric in it), and one it could was drawn as math."""
    import distmetrics as dm
    from distmetrics.report import write_report

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 4):
            monitor.record("u/$\\frac{a$", float(step))
            monitor.record("u/plain", 2.0 * step)
            monitor.step(step, loss=1.0)
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    assert "not drawn" not in page, re.findall(r"not drawn[^<]*", page)


def test_the_timer_tables_last_values_are_those_of_the_last_record(tmp_path):
    """Job 1 (2 ranks, minmax) then job 2 (1 rank, max) in one folder: the table paired job 2's last max with
    job 1's last min and slowest rank (rank 1, at a step job 2 never logged)."""
    from distmetrics import cli

    lines = [{"kind": "run", "step": 0, "world_size": 2, "hosts": ["n0", "n1"]},
             {"kind": "train", "step": 3, "timers/a": 2.0, "timers/a/min": 1.0, "timers/a/max_rank": 1,
              "stragglers/a/rank": 1},
             {"kind": "run", "step": 0, "world_size": 1, "hosts": ["n0"]},
             {"kind": "train", "step": 4, "timers/a": 1.5, "timers/a/max_rank": 0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli.main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    row = re.search(r"<tr><td>timers/a</td>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td>(.*?)</td>", row)[:4] == ["1.75", "1.5", "", "0"], row  # median, last max, min, rank


def test_the_report_says_how_many_per_rank_metrics_it_leaves_undrawn(tmp_path):
    """14 metrics reduced as `all`: 12 heatmaps were drawn and nothing said of the other two."""
    from distmetrics import cli

    record = {"kind": "train", "step": 1}
    for i in range(14):
        record.update({f"u/m{i:02d}/rank0": 1.0, f"u/m{i:02d}/rank1": 2.0, f"u/m{i:02d}/max": 2.0,
                       f"u/m{i:02d}/min": 1.0, f"u/m{i:02d}/mean": 1.5})
    lines = [{"kind": "run", "step": 0, "world_size": 2}, record, dict(record, step=2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli.main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "14 other per-rank metrics; the first 12 are drawn." in page
    assert page.count("(per rank)</h3>") == 12


def test_summary_and_report_read_a_file_saved_with_cr_line_endings_as_read_jsonl_does(tmp_path, capsys):
    """read_jsonl read a copy saved with \r line endings, while summary and report, splitting at \n
    only, refused it as holding no record (or read its first record alone)."""
    from distmetrics import cli

    lines = ['{"kind": "run", "step": 0, "world_size": 2, "hosts": ["n0"]}',
             '{"kind": "train", "step": 1, "train/loss": 2.0}', '{"kind": "train", "step": 2, "train/loss": 1.5}',
             '{"kind": "eval", "step": 2, "eval/loss": 1.75}']
    said = {}
    for ending in ("\n", "\r"):
        (tmp_path / "metrics.jsonl").write_bytes(ending.join(lines).encode() + ending.encode())
        assert cli.main(["summary", str(tmp_path)]) == 0
        data = load_metrics(tmp_path)
        said[ending] = (capsys.readouterr().out, data.lines, data.bad_lines,
                        data.scalars.series("train/loss")[2].tolist(), data.scalars.series("eval/loss")[2].tolist(),
                        data.jobs[0]["world_size"])
    assert said["\r"] == said["\n"] and said["\n"][1:] == (4, 0, [2.0, 1.5], [1.75], 2), said
    assert "2 train, 1 eval" in said["\n"][0], said


def test_a_run_that_cannot_be_read_is_said_and_the_others_are_reported(tmp_path):
    """a_good, b_crashed (0 bytes), c_good: the report wrote a_good's page without saying so,
    stopped at b_crashed with status 2 and never wrote c_good's."""
    runs = tmp_path / "runs"
    for name in ("a_good", "b_crashed", "c_good"):
        (runs / name).mkdir(parents=True)
        records = [] if name == "b_crashed" else [{"kind": "run", "step": 0, "world_size": 1},
                                                  {"kind": "train", "step": 1, "train/loss": 1.0}]
        _write(runs / name / "metrics.jsonl", records)
    made = _report_cli(str(runs))
    assert made.returncode == 1, made.stderr[-3000:]
    assert made.stdout.split() == ["report:", str(runs / "a_good" / "report.html"),
                                   "report:", str(runs / "c_good" / "report.html")]
    assert (runs / "a_good" / "report.html").is_file() and (runs / "c_good" / "report.html").is_file()
    assert sorted(p.name for p in (runs / "b_crashed").iterdir()) == ["metrics.jsonl"]
    assert f"error: {str(runs / 'b_crashed' / 'metrics.jsonl')!r} holds no record: it is empty" in made.stderr
    assert "1 of the 3 runs could not be read" in made.stderr and "Traceback" not in made.stderr


def test_out_naming_a_folder_is_refused_before_the_run_is_read(tmp_path, monkeypatch):
    """``--out EXISTING_FOLDER`` read the run, drew it, then failed renaming the page onto the
    folder: "[Errno 21] Is a directory"."""
    from distmetrics.report import read

    _write(tmp_path / "metrics.jsonl", [{"kind": "run", "step": 0, "world_size": 1},
                                        {"kind": "train", "step": 1, "train/loss": 1.0}])
    (tmp_path / "out").mkdir()
    made = _report_cli(str(tmp_path), "--out", str(tmp_path / "out"))
    assert made.returncode == 2 and "Traceback" not in made.stderr, made.stderr
    assert made.stderr.strip() == (f"error: --out {str(tmp_path / 'out')!r} is a folder: give the HTML file to write "
                                   f"(--out {str(tmp_path / 'out' / 'report.html')!r}, say)")
    monkeypatch.setattr(read.RunData, "read", lambda self: pytest.fail("read before the folder was refused"))
    with pytest.raises(ValueError, match="is a folder: give the HTML file to write"):
        write_report(tmp_path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "out"]
    assert not any((tmp_path / "out").iterdir())


def test_out_given_a_folder_of_several_runs_is_refused_and_writes_nothing(tmp_path):
    """``--out`` names one file, so it takes one run: a folder of runs is refused naming their number, and no
    page is written anywhere."""
    for run in ("a", "b", "c"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        _write(tmp_path / "runs" / run / "metrics.jsonl", [{"kind": "run", "step": 0, "world_size": 1},
                                                          {"kind": "train", "step": 1, "train/loss": 1.0}])
    made = _report_cli(str(tmp_path / "runs"), "--out", str(tmp_path / "report.html"))
    assert made.returncode == 2 and "Traceback" not in made.stderr, made.stderr
    assert made.stderr.strip() == (f"error: --out names one file but {str(tmp_path / 'runs')!r} holds 3 runs: give one "
                                   "run folder with --out, or leave --out out for one report beside each run's "
                                   "metrics.jsonl"), made.stderr
    assert not list(tmp_path.rglob("*.html"))


def test_out_naming_the_runs_metrics_file_or_another_file_not_a_page_is_refused(tmp_path):
    """``--out RUN/metrics.jsonl`` replaced the run's metrics with the page (and --out progress.txt its
    progress log), without a word. A file there that is not an HTML page is refused before the run is
    read; a report written before is replaced, as an empty file is."""
    records = [{"kind": "run", "step": 0, "world_size": 1}, {"kind": "train", "step": 1, "train/loss": 1.0}]
    _write(tmp_path / "metrics.jsonl", records)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    (tmp_path / "progress.txt").write_text("2026-11-29 00:00:00 | Job ID: 1 | # GPUs: 1 | Starting job\n")
    for name in ("metrics.jsonl", "progress.txt"):
        made = _report_cli(str(tmp_path), "--out", str(tmp_path / name))
        assert made.returncode == 2 and "Traceback" not in made.stderr, made.stderr
        assert "is a file that is not an HTML page" in made.stderr and name in made.stderr, made.stderr
        with pytest.raises(ValueError, match="is a file that is not an HTML page"):
            write_report(tmp_path, tmp_path / name)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert (tmp_path / "progress.txt").read_text().endswith("Starting job\n")
    (tmp_path / "empty.html").write_text("")
    for out in (tmp_path / "report.html", tmp_path / "report.html", tmp_path / "empty.html"):  # again: a page
        made = _report_cli(str(tmp_path), "--out", str(out))
        assert made.returncode == 0 and out.read_text().startswith("<!DOCTYPE html>"), made.stderr


def test_the_report_skips_a_line_over_the_limit_without_holding_it(tmp_path, monkeypatch):
    """16 MiB of zero bytes without a newline amid the records (the limit at 1 MiB) were read into
    memory whole: now one unreadable line, held a MiB at a time, and the records around it kept."""
    import tracemalloc

    from distmetrics import runlog

    monkeypatch.setattr(runlog, "LINE_LIMIT", 1 << 20, raising=False)
    with open(tmp_path / "metrics.jsonl", "wb") as f:
        f.write(b'{"kind": "run", "step": 0, "world_size": 1}\n{"kind": "train", "step": 1, "train/loss": 2.0}\n')
        f.write(b"\0" * (16 << 20) + b'\n{"kind": "train", "step": 2, "train/loss": 1.0}\n')
    tracemalloc.start()
    try:
        data = load_metrics(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (data.lines, data.bad_lines) == (4, 1) and data.scalars.series("train/loss")[2].tolist() == [2.0, 1.0]
    assert peak < 4 << 20, peak  # not the 16 MiB line


def test_a_byte_that_is_not_utf8_in_a_text_value_loses_no_record_of_the_report(tmp_path):
    """A host name holding \\xff: the report counted its whole record as unreadable (its loss and
    norms missing from every plot) where summary read it."""
    lines = [json.dumps({"kind": "run", "step": 0, "world_size": 1}).encode(),
             b'{"kind": "train", "step": 1, "train/loss": 1.5, "stragglers/step/host": "n\xff1"}',
             json.dumps({"kind": "train", "step": 2, "train/loss": 1.0}).encode()]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    data = load_metrics(tmp_path)
    assert data.bad_lines == 0 and data.records == 2
    assert data.scalars.series("train/loss")[2].tolist() == [1.5, 1.0]


def test_a_folder_of_run_folders_gets_one_report_per_run_as_summary_reads_it(tmp_path):
    # launch/demo.sh's layout: runs/demo/<date-time>/metrics.jsonl, one folder per demo run
    runs = tmp_path / "runs" / "demo"
    for name, loss in (("20250101-120000", 2.0), ("20250101-130000", 1.0)):
        (runs / name).mkdir(parents=True)
        _write(runs / name / "metrics.jsonl", [{"kind": "run", "step": 0, "world_size": 1},
                                               {"kind": "train", "step": 1, "train/loss": loss}])
    made = _report_cli(str(runs))
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.split() == ["report:", str(runs / "20250101-120000" / "report.html"),
                                   "report:", str(runs / "20250101-130000" / "report.html")]
    assert all((runs / name / "report.html").is_file() for name in ("20250101-120000", "20250101-130000"))
    refused = _report_cli(str(runs), "--out", str(tmp_path / "one.html"))
    assert refused.returncode == 2 and "holds 2 runs" in refused.stderr and not (tmp_path / "one.html").exists()
    with pytest.raises(ValueError, match="holds 2 runs"):
        write_report(runs)
    (runs / "20250101-130000" / "metrics.jsonl").unlink()  # one run left: the API takes the folder too
    assert write_report(runs, tmp_path / "one.html") == str(tmp_path / "one.html")


def test_a_run_folder_whose_name_is_not_utf8_gets_its_report(tmp_path):
    """A folder name with a byte that is not UTF-8 (the file system allows it; summary reads it):
    writing the page raised UnicodeEncodeError and left report.html.partial behind."""
    run = Path(os.fsdecode(bytes(tmp_path) + b"/run-\xff"))
    run.mkdir()
    _write(run / "metrics.jsonl", [{"kind": "run", "step": 0, "world_size": 1},
                                   {"kind": "train", "step": 1, "train/loss": 1.0}])
    assert write_report(run) == str(run / "report.html")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report.html"]
    assert "run-?" in (run / "report.html").read_text(encoding="utf-8")


def test_a_folder_name_that_is_not_utf8_on_a_strict_stdout_and_a_reader_that_stops(tmp_path):
    """On a strict UTF-8 stdout (PYTHONIOENCODING=utf-8, a UTF-8 locale) summary printed nothing and
    both commands exited 2 ("surrogates not allowed"), report after writing its pages; a reader
    that stopped reading (``| head -1``) made the command exit 2 with "Broken pipe"."""
    run = Path(os.fsdecode(bytes(tmp_path) + b"/run-\xff"))
    run.mkdir()
    _write(run / "metrics.jsonl", [{"kind": "run", "step": 0, "world_size": 1},
                                   {"kind": "train", "step": 1, "train/loss": 1.0}])
    for command in ("summary", "report"):
        done = run_python("-m", "distmetrics.cli", command, tmp_path, env={"PYTHONIOENCODING": "utf-8"})
        assert done.returncode == 0 and not done.stderr, done.stderr
        assert "run-\\udcff" in done.stdout, done.stdout
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    reader = subprocess.Popen([sys.executable, "-m", "distmetrics.cli", "summary", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.close()  # the reader goes away before the command prints
    assert reader.wait(timeout=120) == 0 and reader.stderr.read() == b""


def test_the_report_never_imports_torch_nor_pyplot(tmp_path):
    """torch made unimportable; the package's own __init__ (which imports the Monitor) left out."""
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "train/loss": 1.0}\n'
                                            '{"kind": "train", "step": 2, "train/loss": 0.5}\n')
    code = ("import sys, types; sys.modules['torch'] = None; "
            f"package = types.ModuleType('distmetrics'); package.__path__ = [{str(ROOT / 'distmetrics')!r}]; "
            "sys.modules['distmetrics'] = package; "
            f"from distmetrics.report import write_report; write_report({str(tmp_path)!r}); "
            "assert 'matplotlib.pyplot' not in sys.modules; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    assert (tmp_path / "report.html").is_file()


# --- reading --------------------------------------------------------------------------------------

def _write(path: Path, records: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record if isinstance(record, str) else json.dumps(record) + "\n")


def test_restarts_nan_and_a_line_cut_short(tmp_path):
    run = {"kind": "run", "step": 0, "world_size": 2, "modules": ["model", "b.2", "b.10", "b.1"],
           "ranks": [{"rank": 0, "host": "a", "local_rank": 0}, {"rank": 1, "host": "b", "local_rank": 0}]}

    def train(step, loss, rank1_ms):
        return {"kind": "train", "step": step, "time": "t", "train/loss": loss, "grad_norm/b.1": 1.0,
                "grad_norm/b.10": 2.0, "grad_norm/b.2": 3.0, "grad_norm/c": 4.0, "timers/step/rank0": 10.0,
                "timers/step/rank1": rank1_ms, "timers/step/max": max(10.0, rank1_ms),
                "timers/step/min": min(10.0, rank1_ms), "timers/step/mean": (10.0 + rank1_ms) / 2}

    records = [run] + [train(s, 5.0 - s / 100, 20.0) for s in (10, 20, 30)]
    records += ['{"kind": "train", "step": 40, "train/lo\n']  # a crash cut this line short
    records += [dict(run), train(20, "NaN", 11.0), train(30, 4.0, 11.0),
                {"kind": "alert", "step": 30, "alert": "nonfinite_grad", "message": "m", "first_module": "b.2"}]
    _write(tmp_path / "metrics.jsonl", records)
    data = load_metrics(tmp_path)
    assert data.bad_lines == 1
    assert [j["first_step"] for j in data.jobs] == [10, 20]
    assert data.jobs[1]["resumed_at_or_before_last"] and data.jobs[1]["previous_last_step"] == 30
    steps, jobs, loss = data.scalars.series("train/loss")
    assert steps.tolist() == [10, 20, 30, 20, 30] and jobs.tolist() == [0, 0, 0, 1, 1]
    assert math.isnan(loss[3]) and loss[4] == 4.0
    assert [data.modules[i] for i in data.module_rows] == ["b.2", "b.10", "b.1", "c"]  # the run record's, then the rest
    # the resumed job replaced steps >= 20 of the per-rank grid: rank 1 is 20 ms at 10, 11 ms after
    steps, values = data.grids[("rank", "timers/step")].logged()
    assert steps.tolist() == [10, 20, 30] and values[:, 1].tolist() == [20.0, 11.0, 11.0]
    assert data.alerts[0]["first_module"] == "b.2" and data.rank_hosts == {0: "a", 1: "b"}


def test_after_a_rollback_a_job_is_compared_with_the_last_step_logged_before_it(tmp_path):
    """Jobs 1-300, a rollback to 98 running to 200, a resume from 196: the third job resumed at or
    before step 200 (the last logged before it, as its resume record and summary say), not 300."""
    records = []
    for first, last in ((1, 300), (98, 200), (196, 250)):
        records.append({"kind": "run", "step": 0, "world_size": 1})
        records += [{"kind": "train", "step": s, "train/loss": 1.0} for s in range(first, last + 1, 2)]
    _write(tmp_path / "metrics.jsonl", records)
    data = load_metrics(tmp_path)
    assert [j.get("previous_last_step") for j in data.jobs] == [None, 299, 200]
    assert all(j["resumed_at_or_before_last"] for j in data.jobs[1:])


def test_a_job_that_evaluates_its_checkpoint_first_keeps_the_earlier_jobs_records_at_that_step(tmp_path):
    """Job 2 restarts from step 20's checkpoint and evaluates it before training from step 21:
    job 1's per-module values at 20 stay in the heatmap (job 2 never logs step 20), those after
    it are replaced; with a resume record, from the step it names (``from_step``)."""
    run = {"kind": "run", "step": 0, "world_size": 1, "modules": ["a"]}

    def train(step, value):
        return {"kind": "train", "step": step, "train/loss": 1.0, "grad_norm/a": value}

    for second_job in ([{"kind": "eval", "step": 20, "eval/loss": 2.5}],
                       [{"kind": "resume", "step": 20, "message": "m", "last_logged_step": 30, "from_step": 21},
                        {"kind": "eval", "step": 20, "eval/loss": 2.5}]):
        _write(tmp_path / "metrics.jsonl", [run, train(10, 1.0), train(20, 2.0), train(30, 9.0), dict(run),
                                             *second_job, train(30, 3.0)])
        steps, values = load_metrics(tmp_path).grids[("module", "grad_norm")].logged()
        assert list(zip(steps.tolist(), values[:, 0].tolist())) == [(10, 1.0), (20, 2.0), (30, 3.0)], second_job


def test_an_evaluation_only_job_replaces_no_heatmap_values(tmp_path):
    """Job 2 restores step 20's checkpoint, evaluates it and ends: it trained nothing, so job 1's
    values after step 20 stay (they were dropped at the evaluation, as TensorBoard dropped them)."""
    run = {"kind": "run", "step": 0, "world_size": 1, "modules": ["a"]}
    train = [{"kind": "train", "step": s, "train/loss": 1.0, "grad_norm/a": v} for s, v in ((10, 1.0), (20, 2.0),
                                                                                          (30, 9.0))]
    _write(tmp_path / "metrics.jsonl", [run, *train, dict(run), {"kind": "eval", "step": 20, "eval/loss": 2.5}])
    steps, values = load_metrics(tmp_path).grids[("module", "grad_norm")].logged()
    assert list(zip(steps.tolist(), values[:, 0].tolist())) == [(10, 1.0), (20, 2.0), (30, 9.0)]


def test_a_resume_inside_a_heatmap_bin_shows_none_of_the_abandoned_steps(tmp_path):
    """Bins two steps wide (1,200 log steps); job 2 resumes at step 1002, the second step of the bin
    1001-1002. That bin held job 1's abandoned step 1002 beside job 2's (mean 34 of 1, 1 and 100):
    every bin from the one holding the resume step on must hold job 2's values only."""
    run = {"kind": "run", "step": 0, "world_size": 1, "modules": ["a"]}

    def train(step, value):
        return {"kind": "train", "step": step, "train/loss": 1.0, "grad_norm/a": value}

    _write(tmp_path / "metrics.jsonl", [run, *(train(s, 1.0) for s in range(1, 1201)), dict(run),
                                         {"kind": "resume", "step": 1002, "message": "m", "last_logged_step": 1200,
                                          "from_step": 1002}, *(train(s, 100.0) for s in range(1002, 1101))])
    grid = load_metrics(tmp_path).grids[("module", "grad_norm")]
    assert grid.width == 2
    steps, values = grid.logged()
    job2 = [v for c, v in zip(steps.tolist(), values[:, 0].tolist()) if c > 1000]
    assert job2 and all(v == 100.0 for v in job2), sorted(set(job2))
    assert all(v == 1.0 for c, v in zip(steps.tolist(), values[:, 0].tolist()) if c < 1000)
    assert steps.max() < 1101  # job 1's abandoned steps after job 2's last are gone


def test_a_resume_before_the_first_step_logged_puts_its_steps_in_their_own_bins(tmp_path):
    """Job 1 logs steps 100-200; job 2 rolls back to step 50 (a checkpoint older than the file's
    first logged step) and logs 50-150: its steps 50-100 were all folded into the bin of step 100
    (their mean, 75.5) and the heatmap began at 94.5."""
    run = {"kind": "run", "step": 0, "world_size": 1, "modules": ["a"]}

    def train(step, value):
        return {"kind": "train", "step": step, "train/loss": 1.0, "grad_norm/a": value}

    _write(tmp_path / "metrics.jsonl", [run, *(train(s, float(s)) for s in range(100, 201, 10)), dict(run),
                                         {"kind": "resume", "step": 50, "message": "m", "last_logged_step": 200,
                                          "from_step": 50}, *(train(s, s + 0.5) for s in range(50, 151, 10))])
    grid = load_metrics(tmp_path).grids[("module", "grad_norm")]
    steps, values = grid.logged()
    assert grid.width == 1 and list(zip(steps.tolist(), values[:, 0].tolist())) == [(s, s + 0.5)
                                                                                    for s in range(50, 151, 10)]
    assert grid.image()[2] < 50
    full = StepGrid("module", "x")  # every bin in use: moving them right halves them first
    for step in range(1000, 1000 + full.bins):
        full.add(step, 0, slice(0, 1), 1, np.array([float(step)]))
    full.add(10, 1, slice(0, 1), 1, np.array([10.0]))
    steps, values = full.logged()
    assert full.first <= 10 and steps[0] == pytest.approx(full.first + (full.width - 1) / 2) and values[0, 0] == 10.0
    assert sum(full.count[:, 0]) == full.bins + 1 and values[-1, 0] == pytest.approx(999 + full.bins - full.width / 2
                                                                                      + 0.5)


def test_a_job_that_continues_after_the_last_step_drops_no_heatmap_value(tmp_path):
    """Job 2 starts at step 1202, after job 1's last (1201), in a bin two steps wide holding job 1's
    1201: a continuation drops nothing (the bin holding its first step was cleared)."""
    run = {"kind": "run", "step": 0, "world_size": 1, "modules": ["a"]}

    def train(step, value):
        return {"kind": "train", "step": step, "train/loss": 1.0, "grad_norm/a": value}

    _write(tmp_path / "metrics.jsonl", [run, *(train(s, 1.0) for s in range(1, 1202)), dict(run),
                                         *(train(s, 1.0) for s in range(1202, 1301))])
    grid = load_metrics(tmp_path).grids[("module", "grad_norm")]
    assert grid.width == 2 and int(grid.count[:, 0].sum()) == 1300


def test_the_last_step_before_a_job_is_the_one_the_monitor_reads(tmp_path):
    """A job logging to step 100 that saved checkpoint 105, then a job starting at 103: the Monitor
    reads 100 as the last step logged (train, eval and tensor_stats records) and drops nothing; the
    report read 105 from the progress record and cleared its heatmap from 103."""
    run = {"kind": "run", "step": 0, "world_size": 1, "modules": ["a"]}

    def train(step, value):
        return {"kind": "train", "step": step, "train/loss": 1.0, "grad_norm/a": value}

    _write(tmp_path / "metrics.jsonl", [run, *(train(s, 1.0) for s in range(10, 101, 10)),
                                         {"kind": "progress", "step": 105, "message": "Saved checkpoint"}, dict(run),
                                         *(train(s, 2.0) for s in (103, 113))])
    data = load_metrics(tmp_path)
    assert data.jobs[1]["previous_last_step"] == 100 and not data.jobs[1]["resumed_at_or_before_last"]
    steps, values = data.grids[("module", "grad_norm")].logged()
    assert values[:, 0].tolist() == [1.0] * 10 + [2.0, 2.0]


def test_gap_and_resume_records_are_events_not_metrics(tmp_path):
    from distmetrics.report.alerts import events_of

    run = {"kind": "run", "step": 0, "world_size": 1}
    _write(tmp_path / "metrics.jsonl", [
        run, {"kind": "train", "step": 10, "train/loss": 2.0},
        {"kind": "gap", "step": 30, "first_step": 20, "last_step": 20, "lost_records": 1,
         "error": "[Errno 28] No space left on device (ENOSPC)"},
        {"kind": "train", "step": 30, "train/loss": 1.0},
        run, {"kind": "resume", "step": 20, "message": "this job starts at step 20", "last_logged_step": 30},
        {"kind": "train", "step": 20, "train/loss": 1.5}])
    data = load_metrics(tmp_path)
    assert data.records == 3
    assert data.scalars.names == ["train/loss"]
    assert [(e["step"], e["type"]) for e in events_of(data)] == [(30, "gap"), (20, "resume")]
    assert "ENOSPC" in events_of(data)[0]["message"]
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    assert "3 metric records" in page and "Other metrics" not in page and "lost_records" not in page


def test_a_restarted_jobs_flags_at_a_step_the_earlier_job_flagged_too_are_listed(tmp_path):
    """Job 1 skipped a step in the interval of step 20, and so did job 2, restarted from step 11:
    the alert table kept job 1's row alone (events were one per step and kind, across jobs), and
    a spike's factor could be the other job's."""
    from distmetrics.report.alerts import events_of

    run = {"kind": "run", "step": 0, "world_size": 1}

    def train(step, skipped, factor):
        return {"kind": "train", "step": step, "train/loss": 1.0, "health/skipped_steps": skipped,
                "health/loss_spike": int(factor > 0), "health/loss_spike_factor": factor}

    _write(tmp_path / "metrics.jsonl", [run, train(10, 0, 0.0), train(20, 1, 6.0), dict(run),
                                         {"kind": "resume", "step": 11, "message": "m", "last_logged_step": 20,
                                          "from_step": 11}, train(20, 1, 9.0)])
    events = [(e["job"], e["step"], e["type"], e["message"]) for e in events_of(load_metrics(tmp_path))
              if e["type"] != "resume"]
    assert sorted(events) == [(0, 20, "loss_spike", "loss spike: 6 x the moving average"),
                              (0, 20, "skipped_steps", "1 skipped step(s)"),
                              (1, 20, "loss_spike", "loss spike: 9 x the moving average"),
                              (1, 20, "skipped_steps", "1 skipped step(s)")]


@pytest.mark.parametrize("second", ["eval first", "eval first, then resume"])
def test_a_job_that_evaluates_its_checkpoint_and_goes_on_is_no_resume(tmp_path, capsys, second):
    """Job 1 trains to step 30 and saves it; job 2 evaluates checkpoint 30, then trains from 31:
    summary said "logs step 30 again" and the report "resumed at step 30 <= last logged 30" (the
    Monitor, rightly, wrote no resume record). A job resuming from step 21 after evaluating step
    20 was said to resume at 20."""
    from distmetrics import cli

    run = {"kind": "run", "step": 0, "world_size": 1}
    job1 = [run] + [{"kind": "train", "step": s, "train/loss": 1.0} for s in (10, 20, 30)]
    if second == "eval first":
        job2 = [dict(run), {"kind": "eval", "step": 30, "eval/loss": 2.0}, {"kind": "train", "step": 40,
                                                                              "train/loss": 1.0}]
    else:
        job2 = [dict(run), {"kind": "eval", "step": 20, "eval/loss": 2.0},
                {"kind": "resume", "step": 21, "message": "m", "last_logged_step": 30, "from_step": 21},
                {"kind": "train", "step": 30, "train/loss": 1.0}]
    _write(tmp_path / "metrics.jsonl", job1 + job2)
    job = load_metrics(tmp_path).jobs[1]
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["summary", str(tmp_path)]) == 0
    summary = capsys.readouterr().out
    if second == "eval first":
        assert not job.get("resumed_at_or_before_last") and "again" not in summary and "resumed" not in page
    else:
        assert job["resumed_at_or_before_last"] and "resumed at step 21 &lt;= last logged 30" in page
        assert "resumed at step 21 (step 30 was logged before" in summary


def test_the_summary_row_gives_every_jobs_world_size(tmp_path):
    """Jobs on 2, 2 and 1 ranks: the summary said "world size 1", the last job's."""
    records = []
    for world, step in ((2, 10), (2, 20), (1, 30)):
        records += [{"kind": "run", "step": 0, "world_size": world}, {"kind": "train", "step": step, "train/loss": 1.0}]
    _write(tmp_path / "metrics.jsonl", records)
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    assert "<td>world size</td><td>2, 1 (the jobs ran on different world sizes)</td>" in page


def _names_like_ranks(rank: int, world: int, root: str) -> dict:
    """A real 2-rank run writing names that end in ``/rank<N>`` without being a rank's value: a
    metric ``u/rank0``, a metric ``data/rank2000000000``, a top-level module ``rank0``
    (``grad_norm/rank0``), beside an ``all`` metric ``c/z`` (``c/z/rank0``, ``c/z/rank1``)."""
    import torch

    import distmetrics as dm

    model = torch.nn.Module()
    model.rank0 = torch.nn.Linear(2, 2)
    model.head = torch.nn.Linear(2, 2)
    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, tensorboard=False, timing_log_level=-1)
    truth = []
    with dm.Monitor(cfg, model=model) as monitor:
        for step in (1, 2):
            for p in model.parameters():
                p.grad = torch.full_like(p, float(step))
            truth.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.rank0.parameters())))
            monitor.record("u/rank0", 5.0 * step)
            monitor.record("data/rank2000000000", 7.0)
            monitor.record("c/z", 10.0 * step * (rank + 1), reduce="all")
            monitor.clip_grad_norm_(math.inf)
            monitor.step(step, loss=1.0)
    return {"grad_norm/rank0": truth}


def test_only_an_all_metrics_rank_values_are_read_per_rank(tmp_path):
    """Any name ending in /rank<N> was read as rank N's value: data/rank2000000000 made the report
    allocate a grid of 2e9 rows (numpy MemoryError, 14.6 TiB, an uncaught traceback), u/rank0 was
    drawn as a ranks heatmap, and a module named rank0 dropped out of the module heatmap."""
    truth = run_ranks(_names_like_ranks, 2, str(tmp_path))[0]
    run = _report_cli(str(tmp_path))
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    data = load_metrics(tmp_path)
    assert sorted(name for kind, name in data.grids if kind == "rank") == ["c/z"]
    steps, values = data.grids[("rank", "c/z")].logged()
    assert steps.tolist() == [1, 2] and values.tolist() == [[10.0, 20.0], [20.0, 40.0]]
    for name, expected in (("u/rank0", [5.0, 10.0]), ("data/rank2000000000", [7.0, 7.0])):
        steps, _, values = data.scalars.series(name)
        assert steps.tolist() == [1, 2] and values.tolist() == expected, name
    steps, values = data.grids[("module", "grad_norm")].logged()
    assert values[:, data.modules.index("rank0")].tolist() == pytest.approx(truth["grad_norm/rank0"], rel=1e-6)


def test_a_report_too_big_for_memory_is_exit_status_2_with_a_message(tmp_path, capsys, monkeypatch):
    """Data the report cannot hold in memory ended in numpy's MemoryError traceback."""
    from distmetrics import cli

    def no_memory(self, n):  # what numpy raises (its _ArrayMemoryError is a MemoryError)
        raise MemoryError(f"Unable to allocate 7.28 TiB for an array with shape (1000, {n}) and data type float64")

    monkeypatch.setattr(StepGrid, "_grow", no_memory)
    _write(tmp_path / "metrics.jsonl", [{"kind": "run", "step": 0, "world_size": 2},
                                        {"kind": "train", "step": 1, "grad_norm/a": 1.0}])
    assert cli.main(["report", str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert "cannot be drawn" in said and "metrics.jsonl" in said and "Unable to allocate" in said, said


def test_a_grid_stays_bounded_however_long_the_run(monkeypatch):
    monkeypatch.setattr("distmetrics.report.store.MAX_COLUMNS", 8)
    grid = StepGrid("module", "grad_norm")
    for i in range(1, 101):
        grid.add(i * 10, 0, slice(0, 2), 2, np.array([float(i), 2.0 * i]))
    assert grid.bins == 8 and grid.width >= 100 and grid.seen.sum() <= 8
    values, _, x0, x1 = grid.image()
    assert values.shape[1] == 2 and np.nanmean(values[:, 1] / values[:, 0]) == pytest.approx(2.0)
    assert x0 <= 10 and x1 >= 1000
    assert grid.total[:, 0].sum() == pytest.approx(sum(range(1, 101))) and grid.count[:, 0].sum() == 100


def test_a_synthetic_run_with_every_feature(tmp_path):
    generate(tmp_path / "metrics.jsonl", steps=120, ranks=24, modules=60)
    out = Path(write_report(tmp_path, tmp_path / "out" / "report.html"))
    page = out.read_text(encoding="utf-8")
    assert "resumed at step" in page and page.count("<td>restart</td>") == 1  # job 1 resumes, job 2 follows
    assert "nonfinite_grad" in page and "layers." in page  # the alert with its first module
    assert "tensor_stats/&lt;layer&gt;/activation/max" in page and "modules outside" in page
    assert "power_w" in page and "sm_clock_mhz" in page  # the stragglers record's columns
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    stragglers = sum(1 for line in lines if json.loads(line).get("kind") == "stragglers")
    assert stragglers and f", {stragglers} stragglers record(s)" in page  # named in the summary as drawn
    assert "<th></th>" not in page  # every column of every table is named
    assert "step columns" not in page and re.search(r"\d+ columns \(each \d+ step\(s\) wide", page)
    for data in embedded_pngs(page):
        assert colours(decode_png(data)) > 16


def test_the_readme_names_the_healthy_bands_the_report_draws():
    from distmetrics.report.figures import HEALTHY_BANDS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("Healthy bands (`distmetrics/report/figures.py: HEALTHY_BANDS`):", 1)[1].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        name, healthy = (cell.strip() for cell in line.strip("|").split("|")[:2])
        low, high = (float(v.split()[0]) for v in healthy.split("…"))
        rows[name.split("`")[1]] = (low, high)
    assert rows == {name: (low, high) for name, (low, high, _) in HEALTHY_BANDS.items()}


@pytest.mark.parametrize("how", ["rss", "max", "mean"])
def test_heatmap_rows_beyond_max_rows_merge_neighbours_as_the_readme_says(how):
    """1,001 modules or ranks drawn as at most MAX_ROWS (500) rows: 3 neighbours per row (the last
    holds 2), norms as the root-sum-square of the merged values, ranks by their max, ratios by
    their mean; a row whose values are all missing stays missing, and a non-finite flag in any
    merged row marks the merged one. Truth: float64 loops over the groups, by hand."""
    import math

    import numpy as np

    from distmetrics.report import heatmap

    rng = np.random.default_rng(0)
    n, bins = 1001, 4
    values = rng.uniform(0.1, 2.0, size=(bins, n))
    values[:, 30:33] = np.nan  # a whole group with no value
    values[1, 7] = np.nan  # one missing value in a group
    flags = np.zeros((bins, n), dtype=bool)
    flags[2, 1000] = True
    row_name = "rank" if how == "max" else "module"
    labels = [f"rank {i}" if row_name == "rank" else f"m{i}" for i in range(n)]
    merged, merged_flags, names, k = heatmap._merge_rows(values, flags, labels, how, row_name)
    assert k == 3 and merged.shape == (bins, 334) and merged.shape[1] <= heatmap.MAX_ROWS
    for b in range(bins):
        for g in range(334):
            group = [float(values[b, i]) for i in range(3 * g, min(3 * g + 3, n)) if not math.isnan(values[b, i])]
            truth = (math.nan if not group else math.sqrt(math.fsum(v * v for v in group)) if how == "rss"
                     else max(group) if how == "max" else math.fsum(group) / len(group))
            got = float(merged[b, g])
            assert (math.isnan(truth) and math.isnan(got)) or abs(got - truth) <= 1e-12 * truth, (b, g, got, truth)
    assert merged_flags[2, 333] and merged_flags.sum() == 1
    assert names[0] == ("ranks 0-2" if how == "max" else "m0 (+2)")
    if how == "max":  # a group's job on the even ranks: a row of ranks 0, 2 and 4 says so
        even = heatmap._merge_rows(values, flags, [f"rank {2 * i}" for i in range(n)], how, row_name)[2]
        assert even[:2] == ["ranks 0-4 (3 of them)", "ranks 6-10 (3 of them)"]
    assert names[-1] == ("ranks 999-1000" if how == "max" else "m999 (+1)")


def test_an_all_metric_spanning_both_ends_of_float64_leaves_its_heatmap_a_note(tmp_path):
    """Every rank's timer at 1e308 on one rank and -1e308 on the other: the heatmap's colour bar
    raised ("Axis limits cannot be NaN or Inf") while drawn, before the PNG, and the whole report
    was refused (status 2)."""
    run = {"kind": "run", "step": 0, "world_size": 2, "hosts": ["h"]}
    records = [run] + [{"kind": "train", "step": s, "train/loss": 1.0, "timers/step/rank0": 1e308 if s == 10 else 2.0,
                        "timers/step/rank1": -1e308 if s == 10 else 2.0, "timers/step/max": 1e308 if s == 10 else 2.0,
                        "timers/step/min": -1e308 if s == 10 else 2.0, "timers/step/mean": 0.0 if s == 10 else 2.0}
                       for s in (10, 20)]
    _write(tmp_path / "metrics.jsonl", records)
    made = _report_cli(str(tmp_path))
    assert made.returncode == 0, made.stderr
    page = (tmp_path / "report.html").read_text()
    note = r'<p class="note">timers/step: ranks x steps[^<]*not drawn \(matplotlib raised'
    assert re.search(note, page), page[-3000:]
    assert 'alt="loss: Loss"' in page


def test_jobs_are_numbered_as_summary_numbers_them(tmp_path):
    """The report's jobs table, restart labels and alert rows number jobs from 1, as `distmetrics summary`
    does: a job called "job 2" in one is the same job in the other."""
    generate(tmp_path / "metrics.jsonl", steps=60, ranks=4, modules=8)
    page = Path(write_report(tmp_path, tmp_path / "report.html")).read_text(encoding="utf-8")
    summary = subprocess.run([sys.executable, "-m", "distmetrics", "summary", str(tmp_path / "metrics.jsonl")],
                             capture_output=True, text=True, check=True).stdout
    in_summary = [int(n) for n in re.findall(r"^job (\d+):", summary, re.M)]
    table = page[page.index("<th>first step</th>"):]
    in_report = [int(n) for n in re.findall(r"<tr><td>(\d+)</td><td>\d{4}-", table)]
    assert in_summary == in_report == list(range(1, len(in_summary) + 1)) and len(in_summary) >= 2
    alert_rows = re.findall(r"<tr><td>\d+</td><td>(\d+)</td><td style=", page)
    assert alert_rows and set(map(int, alert_rows)) <= set(in_summary)


def test_a_group_jobs_rank_values_are_read_per_rank_by_their_global_ranks(tmp_path):
    """A Monitor on ranks 2 and 3 of a world of 4 (Monitor(group=...)) writes x/rank2 and x/rank3
    with world_size 2: the report took them for scalars (2 >= 2), not the job's ranks."""
    _write(tmp_path / "metrics.jsonl", [
        {"kind": "run", "step": 0, "world_size": 2, "ranks": [{"rank": 2, "host": "a"}, {"rank": 3, "host": "a"}]},
        {"kind": "train", "step": 1, "x/rank2": 1.0, "x/rank3": 3.0, "x/max": 3.0, "x/min": 1.0, "x/mean": 2.0}])
    data = load_metrics(tmp_path)
    assert [name for kind, name in data.grids if kind == "rank"] == ["x"]
    steps, values = data.grids[("rank", "x")].logged()
    assert steps.tolist() == [1] and np.nanmax(values) == 3.0 and np.nanmin(values) == 1.0


def test_a_group_jobs_report_draws_and_counts_its_own_ranks_alone(tmp_path):
    """The same job's report said "world size 2 (4 ranks with per-rank values)" and drew rows for
    ranks 0 and 1, which hold nothing. Truth: the file's x/rank<r> keys, ranks 2 and 3."""
    _write(tmp_path / "metrics.jsonl", [
        {"kind": "run", "step": 0, "world_size": 2, "ranks": [{"rank": 2, "host": "a"}, {"rank": 3, "host": "a"}]},
        *({"kind": "train", "step": step, "x/rank2": 1.0 * step, "x/rank3": 3.0, "x/max": 3.0, "x/min": 1.0,
           "x/mean": 2.0} for step in range(1, 5))])
    page = Path(write_report(tmp_path, tmp_path / "report.html")).read_text(encoding="utf-8")
    assert "<td>world size</td><td>2 (2 ranks with per-rank values)</td>" in page
    assert "x: ranks x steps" in page and "2 rows x 4 columns" in page and "4 rows x" not in page


def test_heatmap_steps_lost_or_never_logged_are_grey_and_gaps_are_marked(tmp_path):
    """A disk full at steps 10-14 (a ``gap`` record, as the JSONL sink writes it when room comes
    back) and step 30 never logged: the heatmap painted steps 7-11 with step 6's value and 12-17
    with step 16's, no bin grey, no gap marked. Truth from the file read back with json: a column
    shows the nearest logged step's value where it is not a lost step (step 30, never logged, takes
    a neighbour's: a log interval may change within a run), else nothing."""
    from distmetrics.report.figures import Figures
    from distmetrics.report.heatmap import heatmap

    records = [{"kind": "run", "step": 0, "world_size": 1, "modules": ["a", "b"]}]
    for step in range(2, 41, 2):
        if step in (10, 12, 14, 30):
            continue
        if step == 16:
            records.append({"kind": "gap", "step": 16, "first_step": 10, "last_step": 14, "lost_records": 3,
                            "error": "[Errno 28] No space left on device (ENOSPC)"})
        records.append({"kind": "train", "step": step, "train/loss": 1.0, "grad_norm/a": step + 0.5,
                        "grad_norm/b": 100.0 + step})
        if step % 8 == 0:
            records.append({"kind": "eval", "step": step, "eval/loss": 2.0})
    _write(tmp_path / "metrics.jsonl", records)

    read_back = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in read_back if r["kind"] == "train"}
    lost = [(r["first_step"], r["last_step"]) for r in read_back if r["kind"] == "gap"]
    data = load_metrics(tmp_path)
    grid = data.grids[("module", "grad_norm")]
    values, flags, x0, x1 = grid.image(data.lost)
    assert grid.width == 1 and data.lost == lost == [(10, 14)]
    greys = []
    for column in range(values.shape[0]):
        step = x0 + 0.5 + column
        nearest = min(logged, key=lambda s: (abs(s - step), s))
        shown = step == nearest or not any(a <= step <= b for a, b in lost)
        for row, module in ((data.modules.index("a"), "a"), (data.modules.index("b"), "b")):
            if shown:
                assert values[column, row] == logged[nearest][f"grad_norm/{module}"], (step, module)
            else:
                assert math.isnan(values[column, row]), (step, module, values[column, row])
        greys += [] if shown else [int(step)]
    assert greys == [10, 11, 12, 13, 14] and not flags.any()
    figures = Figures(data)
    figure = heatmap(figures, grid, "grad_norm", data.modules, data.module_rows, "rss", log=True, cmap="viridis",
                     colour_label="grad_norm", row_name="module")
    assert "olive lines: the first and last steps of records lost (gap records)" in html.unescape(figure)

    # a later job resuming at step 12 logs the lost steps 12-14 again: only 10-11 stay lost
    records += [dict(records[0]), {"kind": "resume", "step": 12, "message": "m", "last_logged_step": 40,
                                   "from_step": 12}]
    records += [{"kind": "train", "step": s, "train/loss": 1.0, "grad_norm/a": 1.0, "grad_norm/b": 2.0}
                for s in range(12, 21, 2)]
    _write(tmp_path / "metrics.jsonl", records)
    data = load_metrics(tmp_path)
    values, _, x0, _ = data.grids[("module", "grad_norm")].image(data.lost)
    greys = [int(x0 + 0.5 + c) for c in range(values.shape[0]) if np.isnan(values[c]).all()]
    assert data.lost == [(10, 11)] and greys == [10, 11]

    # a log interval that changes (every step to 10, then every 100): no column grey, each the nearer's value
    steps = list(range(1, 11)) + list(range(100, 1001, 100))
    _write(tmp_path / "metrics.jsonl", [dict(records[0])] + [
        {"kind": "train", "step": s, "train/loss": 1.0, "grad_norm/a": float(s), "grad_norm/b": 1.0} for s in steps])
    data = load_metrics(tmp_path)
    grid = data.grids[("module", "grad_norm")]
    values, _, x0, _ = grid.image(data.lost)
    assert not np.isnan(values).any()
    row = data.modules.index("a")
    bins = x0 + 0.5 + np.arange(values.shape[0]) * grid.width  # each column's first step
    assert values[np.searchsorted(bins, 500, side="right") - 1, row] == 500.0

    # records lost with no gap record (a hard kill, then a resume past them): 10-200 and 500-700 every 10,
    # nothing between: the columns more than half the spacing (5) from 200 and 500 are grey, not 200's or 500's
    steps = list(range(10, 201, 10)) + list(range(500, 701, 10))
    _write(tmp_path / "metrics.jsonl", [dict(records[0])] + [
        {"kind": "train", "step": s, "train/loss": 1.0, "grad_norm/a": float(s), "grad_norm/b": 1.0} for s in steps])
    data = load_metrics(tmp_path)
    grid = data.grids[("module", "grad_norm")]
    values, _, x0, _ = grid.image(data.lost)
    first = x0 + 0.5 + np.arange(values.shape[0]) * grid.width
    column = values[:, data.modules.index("a")]
    assert np.isnan(column[(first > 210) & (first + grid.width - 1 < 490)]).all()
    assert not np.isnan(column[first + grid.width - 1 <= 200]).any() and not np.isnan(column[first >= 500]).any()


def _nested_modules(rank: int, world: int, root: str) -> dict:
    """A real 2-rank run of a model of 503 modules holding parameters (``embed``, ``blocks``, 167
    ``blocks.<i>`` and their ``fc1``, ``fc2``): every parameter's squared gradient in float64 and
    the parameters below each module, for the truth of merged heatmap rows."""
    import torch

    import distmetrics as dm

    model = torch.nn.Module()
    model.embed = torch.nn.Linear(2, 2)
    model.blocks = torch.nn.ModuleList()
    for _ in range(167):
        block = torch.nn.Module()
        block.fc1, block.fc2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        model.blocks.append(block)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, tensorboard=False, timing_log_level=-1,
                           log_update_norm=True)
    squares = {}
    with dm.Monitor(cfg, model=model, optimizer=optimizer) as monitor:
        for step in (1, 2):
            with torch.no_grad():  # fc2 updates above the relative-update band, the rest inside it
                for i, (name, p) in enumerate(model.named_parameters()):
                    p.fill_(100.0 if ".fc1." in name else 1.0)
                    p.grad = torch.full_like(p, (1e-3 if name.startswith("embed.") else 0.1) * (1 + i % 7 / 10) * step)
            squares[step] = {name: float(p.grad.double().pow(2).sum()) for name, p in model.named_parameters()}
            monitor.clip_grad_norm_(math.inf)
            optimizer.step()
            monitor.step(step, loss=1.0)
    below = {name: [f"{name}.{p}" for p, _ in module.named_parameters()] for name, module in model.named_modules()
             if name and any(True for _ in module.parameters())}
    return {"squares": squares, "below": below}


def test_merged_module_rows_are_the_norm_of_the_parameters_they_hold(tmp_path):
    """Above 500 modules rows merge in pairs: ``blocks.0 (+1)`` (blocks.0 and blocks.0.fc1) added
    fc1's norm to the block's that holds it, up to 30% high here. Truth: the float64 norm of the
    union of the row's modules' parameters' gradients. The share of modules outside the
    relative-update band counted the containers too (33% here, where half the leaf modules are
    outside); it counts leaf modules, read back from the JSONL with json."""
    from distmetrics.report.heatmap import MAX_ROWS, _merge_rows, _ordered
    from distmetrics.report.sections import outside_band

    truth = run_ranks(_nested_modules, 2, str(tmp_path))[0]
    data = load_metrics(tmp_path)
    values, flags, x0, _ = data.grids[("module", "grad_norm")].image(data.lost)
    values, flags, labels = _ordered(values, flags, list(data.modules), data.module_rows, "module")
    assert len(labels) == 503 and labels[:4] == ["embed", "blocks", "blocks.0", "blocks.0.fc1"]
    merged, _, names, k = _merge_rows(values, flags, labels, "rss", "module")
    assert k == 2 and merged.shape[1] == 252 <= MAX_ROWS and names[1] == "blocks.0 (+1)"
    for column in range(merged.shape[0]):
        step = int(x0 + 0.5) + column
        for row in range(merged.shape[1]):
            params = {p for module in labels[row * k: (row + 1) * k] for p in truth["below"][module]}
            expected = math.sqrt(math.fsum(truth["squares"][step][p] for p in params))
            assert merged[column, row] == pytest.approx(expected, rel=1e-6), (step, names[row])

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps, outside, below = outside_band(data, "relative_update_norm")
    for record, share_outside, share_below in zip([r for r in records if r["kind"] == "train"], outside, below):
        ratios = {key.split("/", 1)[1]: value for key, value in record.items()
                  if key.startswith("relative_update_norm/")}
        leaves = [m for m in ratios if not any(other.startswith(m + ".") for other in ratios)]
        assert len(leaves) == 1 + 2 * 167
        assert share_outside == pytest.approx(sum(not 1e-4 <= ratios[m] <= 1e-2 for m in leaves) / len(leaves))
        assert share_below == pytest.approx(sum(ratios[m] < 1e-4 for m in leaves) / len(leaves))
    assert steps.tolist() == [1, 2]


def test_the_summary_and_jobs_table_count_as_summary_does(tmp_path, capsys):
    """The jobs table's first step was the first record of any kind (job 2's resume record at 12,
    job 3's tensor_stats at 29) where summary gives the first train record; the record count
    counted progress (checkpoint) records as metric records; "modules | 0 (in model order)" was
    shown for a run with no module norm."""
    from distmetrics import cli

    run = {"kind": "run", "step": 0, "world_size": 1, "modules": ["model", "a"]}
    records = [run] + [{"kind": "train", "step": s, "train/loss": 1.0} for s in (10, 20)]
    records += [{"kind": "progress", "step": 20, "message": "Saved checkpoint", "checkpoint/tokens": 5.0}]
    records += [dict(run), {"kind": "resume", "step": 12, "message": "m", "last_logged_step": 20, "from_step": 12},
                {"kind": "eval", "step": 12, "eval/loss": 2.0}, {"kind": "train", "step": 14, "train/loss": 1.0},
                {"kind": "train", "step": 28, "train/loss": 1.0}]
    records += [dict(run), {"kind": "tensor_stats", "step": 29, "tensor_stats/l/activation/max": 1.0},
                {"kind": "train", "step": 30, "train/loss": 1.0}]
    _write(tmp_path / "metrics.jsonl", records)
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    assert cli.main(["summary", str(tmp_path)]) == 0
    summary = capsys.readouterr().out
    firsts = [int(s) for s in re.findall(r"^  first step (\d+):", summary, re.M)]
    lasts = [int(s) for s in re.findall(r"^  last step (\d+):", summary, re.M)]
    table = page[page.index("<th>first step</th>"):]
    rows = re.findall(r"<tr><td>(\d+)</td><td>[^<]*</td><td>(\d*)</td><td>(\d*)</td>", table)
    assert firsts == [10, 14, 30] and [(int(f), int(la)) for _, f, la in rows] == list(zip(firsts, lasts))
    metric = sum(json.loads(line)["kind"] in ("train", "eval", "tensor_stats")
                 for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert metric == 7 and f"{metric} metric records (train, eval, tensor_stats), 1 progress record(s), 3 job(s)" \
        in page
    assert "<td>modules</td>" not in page


def test_values_near_float64s_largest_leave_their_figure_undrawn_and_the_report_written(tmp_path):
    """A user's metric of 1e308 (one point: matplotlib's "arange: cannot compute length", exit status 2)
    or an ``all`` metric reaching 1.797e308 (its heatmap: an OverflowError traceback) left no report at
    all. Now that figure is a note naming matplotlib's error; the rest is drawn."""
    run = {"kind": "run", "step": 0, "world_size": 2,
           "ranks": [{"rank": 0, "host": "a", "local_rank": 0}, {"rank": 1, "host": "b", "local_rank": 0}]}
    records = [run] + [{"kind": "train", "step": s, "time": "t", "train/loss": 2.0 - s / 10, "u/x": 1e308,
                        "u/y/rank0": 1.0, "u/y/rank1": 1.7976931348623157e308 if s == 2 else 1.0,
                        "u/y/max": 1.7976931348623157e308 if s == 2 else 1.0, "u/y/min": 1.0,
                        "u/y/mean": 8.988465674311579e307 if s == 2 else 1.0, "u/y": 1.0} for s in (1, 2, 3)]
    records[1].pop("u/x")  # one point of u/x: at step 2 (a panel with one point)
    records[3].pop("u/x")
    _write(tmp_path / "metrics.jsonl", records)
    page = Path(write_report(tmp_path)).read_text()
    notes = re.findall(r'<p class="note">([^<]*not drawn \(matplotlib raised [^<]*)</p>', page)
    assert len(notes) == 2 and any("u/x" in n for n in notes) and any("u/y" in n for n in notes), notes
    assert 'alt="loss: Loss"' in page  # the loss is drawn


def test_jobs_timing_one_timer_max_and_all_both_have_their_values_drawn_and_tabled(tmp_path):
    """A file whose first job logged timers as minmax (timers/step, its /min) and whose second logged
    them as all (every rank's value): the per-rank figure hid the first job's values from every figure
    and the table."""
    run = {"kind": "run", "step": 0, "world_size": 2, "hosts": ["h"]}
    records = [run] + [{"kind": "train", "step": s, "train/loss": 1.0, "timers/step": 500.0 + s,
                        "timers/step/min": 400.0, "timers/step/max_rank": 1, "timers/step/min_rank": 0}
                       for s in (10, 20, 30)]
    records += [{"kind": "end", "step": 30, "how": "closed its Monitor", "unwritten_steps": 0}, run]
    records += [{"kind": "train", "step": s, "train/loss": 1.0, "timers/step/rank0": 10.0, "timers/step/rank1": 12.0,
                 "timers/step/max": 12.0, "timers/step/min": 10.0, "timers/step/mean": 11.0} for s in (40, 50)]
    _write(tmp_path / "metrics.jsonl", records)
    page = Path(write_report(tmp_path)).read_text()
    assert 'alt="timers (min/max over ranks): timers/step (ms)' in page  # the first job's
    assert 'alt="timers/step: ranks x steps' in page  # the second's
    row = re.search(r"<tr><td>timers/step</td>((?:<td>[^<]*</td>)+)</tr>", page).group(1)
    # the median of both jobs' maxima (510, 520, 530, 12, 12): 500; the last ones the second job's
    assert re.findall(r"<td>([^<]*)</td>", row)[:4] == ["510", "12", "10", "1"], row


def test_a_file_opening_with_an_end_record_numbers_its_jobs_as_summary_does(tmp_path):
    """A file whose head was lost (a copy made with tail) opens with an earlier job's end record:
    summary called the job after it job 2, the report's tables job 1."""
    _write(tmp_path / "metrics.jsonl", [
        {"kind": "end", "step": 40, "how": "closed its Monitor", "unwritten_steps": 0},
        {"kind": "run", "step": 0, "world_size": 1, "hosts": ["h"], "end_record": True},
        {"kind": "train", "step": 10, "train/loss": 1.0},
        {"kind": "alert", "step": 10, "alert": "loss_spike", "message": "loss spike"},
        {"kind": "train", "step": 20, "train/loss": 0.9}])
    said = subprocess.run([sys.executable, "-m", "distmetrics", "summary", str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout
    assert re.findall(r"^job (\d+):", said, re.M) == ["1", "2"] and "job 2: started" in said, said
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    table = page[page.index("<th>first step</th>"):]
    assert re.findall(r"<tr><td>(\d+)</td>", table)[:2] == ["1", "2"]
    assert re.findall(r"<tr><td>\d+</td><td>(\d+)</td><td style=", page) == ["2"]  # the alert's job


def test_summary_compares_a_job_with_the_latest_job_that_trained_as_the_monitor_does(tmp_path):
    """summary compared a job's first step with the job just before only: after a job that died
    before logging anything it said nothing of steps logged again; after a job that only evaluated
    (at step 100) it said step 60 was logged again, by that job."""
    run = {"kind": "run", "step": 0, "world_size": 1, "hosts": ["h"], "end_record": True}

    def train(steps):
        return [{"kind": "train", "step": s, "train/loss": 1.0 / s} for s in steps]

    for name, records, said in (
            ("died", [run, *train(range(10, 51, 10)), run, run, *train(range(30, 61, 10))],
             "logs step 30 again: job 1 logged up to step 50"),
            ("evaluated", [run, *train(range(10, 51, 10)), run, {"kind": "eval", "step": 100, "eval/loss": 1.0}, run,
                           *train(range(60, 91, 10))], None)):
        (tmp_path / name).mkdir()
        _write(tmp_path / name / "metrics.jsonl", records)
        out = subprocess.run([sys.executable, "-m", "distmetrics", "summary", str(tmp_path / name)],
                             capture_output=True, text=True, check=True).stdout
        job3 = out.split("job 3:")[1]
        assert (said in job3) if said else "again" not in job3, out


def test_hand_made_odd_records_are_read_and_a_bug_in_one_run_leaves_the_others_done(tmp_path):
    """Records that decode as records but held "hosts": null or [1] (summary: TypeError), an integer
    of 400 digits (report: OverflowError) or a step of 10**20 (report: beyond int64) gave tracebacks;
    in a folder of runs, one such run stopped every other run's output. Now each is read (a step
    beyond 64 bits is no record of ours: an unreadable line), and an error no rule foresaw in one run
    is said with its traceback while the other runs are done (status 1)."""
    def write(name: str, run_extra: dict, train: str) -> None:
        (tmp_path / name).mkdir()
        run = json.dumps({"kind": "run", "step": 0, "world_size": 1, **run_extra})
        (tmp_path / name / "metrics.jsonl").write_text(f"{run}\n{train}\n")

    write("hosts_null", {"hosts": None}, '{"kind": "train", "step": 10, "train/loss": 1.0}')
    write("hosts_int", {"hosts": [1]}, '{"kind": "train", "step": 10, "train/loss": 1.0}')
    write("bigint", {"hosts": ["h"]}, '{"kind": "train", "step": 10, "train/consumed_tokens": ' + "9" * 400 + "}")
    write("bigstep", {"hosts": ["h"]}, '{"kind": "train", "step": 100000000000000000000, "train/loss": 1.0}')
    for name in ("hosts_null", "hosts_int", "bigint", "bigstep"):
        for command in ("summary", "report"):
            made = run_python("-m", "distmetrics", command, str(tmp_path / name), timeout=300)
            assert made.returncode == 0 and "Traceback" not in made.stderr, (name, command, made.stderr)
    said = run_python("-m", "distmetrics", "summary", str(tmp_path / "hosts_int"), timeout=300).stdout
    assert "hosts 1," in said
    said = run_python("-m", "distmetrics", "summary", str(tmp_path / "bigstep"), timeout=300).stdout
    assert "1 unreadable line(s) skipped" in said and "0 train" in said, said
    # a bug met in one run of a folder: said with its traceback, the other runs summarised
    code = ("import distmetrics.cli as cli; real = cli.summarise\n"
            "def summarise(path):\n"
            "    if 'bigint' in str(path): raise TypeError('a bug')\n"
            "    return real(path)\n"
            "cli.summarise = summarise\n")
    made = run_python("-c", code + "import sys; sys.exit(cli.main(['summary', sys.argv[1]]))", str(tmp_path),
                      timeout=300)
    assert made.returncode == 1 and "TypeError: a bug" in made.stderr and "Traceback" in made.stderr, made.stderr
    assert made.stdout.count(": 1 job(s)") == 3, made.stdout


def test_a_run_record_whose_world_size_is_no_number_is_shown_as_it_is(tmp_path):
    """A hand-edited file's ``"world_size": [2]`` ended ``distmetrics report`` in a TypeError
    traceback (summary read it); a value that is not a number is read as it is."""
    _write(tmp_path / "metrics.jsonl", [
        {"kind": "run", "step": 0, "world_size": [2]},
        {"kind": "train", "step": 1, "train/loss": 1.0},
        {"kind": "run", "step": 0, "world_size": {"dp": 2}},
        {"kind": "train", "step": 2, "train/loss": 1.0}])
    page = Path(write_report(tmp_path, tmp_path / "report.html")).read_text(encoding="utf-8")
    assert "<td>world size</td><td>[2], {&#x27;dp&#x27;: 2} (the jobs ran on different world sizes)</td>" in page


def _timed_job(rank: int, world: int, out: str, option: str, start: int, steps: int) -> None:
    """Steps ``start`` on, a ``data`` timer the slow rank sleeps in: rank 1 in the first job, rank 0 in the
    job that resumes at an earlier step (another timing_log_option)."""
    import time

    import torch

    import distmetrics as dm

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = dm.MetricsConfig(output_dir=out, tensorboard=False, console=False, log_interval=2, timing_log_level=0,
                           timing_log_option=option, straggler_window=3)
    with dm.Monitor(cfg, model=model, optimizer=opt) as monitor:
        for step in range(start, start + steps):
            with monitor.timers("data", log_level=0):
                time.sleep(0.08 * (rank if start == 1 else 1 - rank))  # the straggler by 80 ms a step: over noise
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            monitor.step(step, loss=2.0, tokens=100)


def test_a_job_resumed_at_an_earlier_step_replaces_the_timer_tables_last_values_and_the_slowest_rank(tmp_path,
                                                                                                     monkeypatch):
    """Job 1 (timing_log_option all) logs steps 2..20, job 2 (minmax) resumes at 11 and logs 12..16. The timer
    table's 'last' values were job 1's step 20 (the highest step, though job 2 replaced it); the min..max band
    was one polygon going back from 20 to 12; the slowest-rank dots showed both jobs' ranks at 12..16; and the
    last stragglers record's per-timer rows were left out. Truth: the JSONL, read here."""
    from matplotlib.axes import Axes

    run_ranks(_timed_job, 2, str(tmp_path), "all", 1, 20, timeout=180)
    run_ranks(_timed_job, 2, str(tmp_path), "minmax", 11, 6, timeout=180)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "train"][-1]
    straggled = [r for r in records if r["kind"] == "stragglers"][-1]
    drawn: dict = {"fill": [], "scatter": []}
    fill, scatter = Axes.fill_between, Axes.scatter
    monkeypatch.setattr(Axes, "fill_between", lambda ax, x, *a, **k: (
        drawn["fill"].append((ax.get_title(), list(x))), fill(ax, x, *a, **k))[1])
    monkeypatch.setattr(Axes, "scatter", lambda ax, x, y, *a, **k: (
        drawn["scatter"].append((ax.get_title(), list(x), list(y))), scatter(ax, x, y, *a, **k))[1])
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    row = re.search(r"<tr><td>timers/step</td>(.*?)</tr>", page).group(1)
    cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)]
    assert float(cells[1]) == pytest.approx(last["timers/step"], rel=1e-3, abs=0.01), (cells, last)
    assert int(cells[3]) == last["timers/step/max_rank"], (cells, last)
    bands = [x for title, x in drawn["fill"] if title.startswith("timers/")]
    assert bands and all(x == sorted(x) for x in bands), bands
    dots = [(x, y) for title, x, y in drawn["scatter"] if title == "timers/data: the slowest rank at each log step"]
    assert dots and all(x.count(step) <= 1 for x, _ in dots for step in x), dots
    assert max(dots[0][0]) < 11, dots  # job 2 logged no rank's values (minmax): steps from 11 on are its
    minmax = [(x, y) for title, x, y in drawn["scatter"] if title.startswith("timers/data: the straggler")]
    assert minmax and [(int(x), int(y)) for x, y in zip(*minmax[0])] == [  # job 1's up to 10, then job 2's
        (2, 1), (4, 1), (6, 1), (8, 1), (10, 1), (12, 0), (14, 0), (16, 0)], minmax
    slow = [row["rank"] for row in straggled["timers"]["data"]]
    shown = re.findall(r"<tr><td>slowest in data</td><td>(\d+)</td>", page)
    assert slow and [int(rank) for rank in shown] == slow, (shown, straggled)


@pytest.mark.parametrize("lost_by", ["gap", "end"])
def test_a_job_resumed_over_steps_a_full_disk_lost_is_a_resume_in_the_report_as_in_summary(tmp_path, lost_by):
    """Job 1 logs steps 2..16 in the file; a full disk lost steps 18..20 from it (a gap record; or an end
    record whose last log step is 20, the records after 16 lost with no room for a gap record), which
    TensorBoard has. Job 2 starts at 20: the Monitor and summary read a resume over step 20, the report
    said 'restart' and left the lost steps from 19 on marked lost. Truth: runlog.last_logged_step, as
    the Monitor reads it, and the summary's line."""
    from distmetrics.runlog import last_logged_step

    run = {"kind": "run", "step": 0, "world_size": 1, "end_record": True, "ranks": [{"rank": 0, "host": "h"}]}
    first = [run] + [{"kind": "train", "step": s, "train/loss": 3.0 - 0.01 * s} for s in range(2, 17, 2)]
    if lost_by == "gap":
        first += [{"kind": "gap", "step": 20, "first_step": 18, "last_step": 20, "lost_records": 2},
                  {"kind": "end", "step": 20, "how": "closed its Monitor", "stepped": True, "unwritten_steps": 0}]
    else:
        first += [{"kind": "end", "step": 21, "how": "closed its Monitor", "stepped": True, "unwritten_steps": 1}]
    _write(tmp_path / "metrics.jsonl", first)
    assert last_logged_step(tmp_path / "metrics.jsonl") == 20
    resume = {"kind": "resume", "step": 20, "from_step": 20, "last_logged_step": 20, "tensorboard_dropped": True,
              "message": "this job starts at step 20, at or before step 20"}  # as the Monitor writes it
    _write(tmp_path / "metrics.jsonl", first + [run, resume] + [{"kind": "train", "step": s, "train/loss": 5.0}
                                                                for s in range(20, 25, 2)])
    said = run_python("-m", "distmetrics", "summary", str(tmp_path)).stdout
    assert "resumed at step 20 (step 20 was logged before" in said, said
    page = Path(write_report(tmp_path)).read_text(encoding="utf-8")
    job2 = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", re.findall(r"<tr><td>2</td>.*?</tr>", page)[0])]
    assert job2[-1] == "resumed at step 20 <= last logged 20", job2
    lost = load_metrics(tmp_path).lost
    assert lost == ([(18, 19)] if lost_by == "gap" else []), lost  # step 20 is job 2's
