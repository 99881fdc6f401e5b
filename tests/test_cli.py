"""The ``distmetrics`` command as a user runs it (``python -m distmetrics.cli``, a real process):
commands that read files start without torch, ``summary`` takes run folders and refuses files that
are not a metrics.jsonl, ``check-config`` refuses what the Monitor would refuse, exit status 2."""

import os
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

KILLED = ("no end record: the job was killed (SIGKILL, an out-of-memory kill, a node lost, a SIGTERM with no handler: "
          "Slurm, torchrun)")


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "distmetrics.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def _write_run(folder: Path, jobs: list[list[int]]) -> Path:
    """A metrics.jsonl as the JsonlSink writes it: per job a run record, then train records."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for steps in jobs:
        lines.append({"kind": "run", "step": 0, "time": "2026-01-01T00:00:00.000+00:00", "world_size": 2,
                      "hosts": ["node0"], "layout": "data-parallel", "torch_version": "2.13.0"})
        lines += [{"kind": "train", "step": s, "time": "t", "train/loss": 10.0 / s} for s in steps]
    path = folder / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_commands_that_read_files_do_not_import_torch(tmp_path):
    """Checked in the process itself: ``torch`` is not in ``sys.modules`` when the command exits."""
    run = _write_run(tmp_path / "run", [[10, 20]])
    probe = ("import atexit, runpy, sys\n"
             "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
             "module, sys.argv = sys.argv[1], ['distmetrics'] + sys.argv[2:]\n"
             "runpy.run_module(module, run_name='__main__')\n")
    # python -m distmetrics.cli, and python -m distmetrics (the package's __main__)
    for args in (["distmetrics", "summary", run.parent],
                 ["distmetrics.cli", "check-config", "configs/metrics.yaml", "log_interval=5"]):
        out = subprocess.run([sys.executable, "-c", probe, *map(str, args)], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "torch imported: False" in out.stdout, (args, out.stdout)
        assert ("job 1:" in out.stdout) == (args[1] == "summary")


def test_summary_accepts_a_run_folder_and_a_folder_of_runs(tmp_path):
    _write_run(tmp_path / "demo" / "20260101-000000", [[10, 20]])
    _write_run(tmp_path / "demo" / "20260102-000000", [[10, 20, 30]])
    one = _run("summary", tmp_path / "demo" / "20260101-000000")
    assert one.returncode == 0, one.stderr
    assert "1 job(s)" in one.stdout and "last step 20: loss=0.5" in one.stdout
    both = _run("summary", tmp_path / "demo")
    assert both.returncode == 0, both.stderr
    assert both.stdout.index("20260101-000000") < both.stdout.index("20260102-000000")
    assert "last step 30" in both.stdout
    # runs/ holding runs/fsdp/ and runs/demo/<time>/: the deeper ones were skipped without a word
    _write_run(tmp_path / "fsdp", [[10, 20, 30, 40]])
    (tmp_path / "fsdp" / "tensorboard").mkdir()
    _write_run(tmp_path / "fsdp" / "tensorboard" / "not-a-run", [[10]])  # a run folder's own folders: not searched
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    _write_run(elsewhere / "r1", [[10, 20]])
    (tmp_path / "linked").symlink_to(elsewhere / "r1")  # a run linked in is a run
    (tmp_path / "demo" / "loop").symlink_to(tmp_path)  # a link back up the tree is read once
    every = _run("summary", tmp_path)
    assert every.returncode == 0, every.stderr
    assert all(name in every.stdout for name in ("20260101-000000", "20260102-000000", "fsdp", "linked")), every.stdout
    assert "not-a-run" not in every.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_summary_to_a_full_disk_says_so_with_status_2_not_a_traceback(tmp_path):
    """``distmetrics summary run > file`` on a full disk (/dev/full: every write ENOSPC) ended in a
    traceback with status 1."""
    _write_run(tmp_path / "run", [[10, 20]])
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "distmetrics.cli", "summary", str(tmp_path / "run")],
                              stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == "error: the output could not be written to stdout: [Errno 28] No space left on " \
        "device (ENOSPC)", done.stderr


def test_summary_tells_how_a_job_without_steps_or_without_its_run_line_ended(tmp_path):
    """A job that only evaluated "ended at step 0" (its end record's step, where no monitor.step
    came); a file whose first line (the run record) was cut off lost its job's end note."""
    folder = tmp_path / "run"
    path = _write_run(folder, [[10, 20], []])
    lines = path.read_text().splitlines(keepends=True)
    ends = [{"kind": "end", "step": 20, "how": "closed its Monitor", "unwritten_steps": 0, "stepped": True},
            {"kind": "end", "step": 0, "how": "closed its Monitor", "unwritten_steps": 0, "stepped": False}]
    lines.insert(3, json.dumps(ends[0]) + "\n")
    lines += [json.dumps({"kind": "eval", "step": 20, "eval/loss": 1.5}) + "\n", json.dumps(ends[1]) + "\n"]
    path.write_text("".join(lines[1:]))  # the first job's run line lost
    done = _run("summary", folder)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.split("job 2:")
    assert "records before any run record" in first and "  ended at step 20: closed its Monitor" in first, first
    assert "  ended before any monitor.step: closed its Monitor" in second and "step 0" not in second, second


def test_summary_refuses_what_is_not_a_metrics_jsonl(tmp_path):
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    empty = tmp_path / "empty"
    empty.mkdir()
    fifo_run = tmp_path / "fifo_run"  # a FIFO read waits for a writer: summary hung without a word
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "metrics.jsonl")
    dir_run = tmp_path / "dir_run"  # was said to be "a device, a FIFO or a socket"
    (dir_run / "metrics.jsonl").mkdir(parents=True)
    for path, message in ((ROOT / "README.md", "is not a distmetrics metrics.jsonl"),
                          (binary, "is not a distmetrics metrics.jsonl"),
                          (empty, "is a folder without metrics.jsonl"),
                          (tmp_path / "missing", "does not exist"),
                          ("/dev/null", "'/dev/null' is no regular file (a device, a FIFO or a socket)"),
                          (fifo_run, "metrics.jsonl' is no regular file (a device, a FIFO or a socket)"),
                          (fifo_run / "metrics.jsonl", "metrics.jsonl' is no regular file"),
                          (dir_run, "metrics.jsonl' is no regular file (a folder)")):
        out = _run("summary", path)
        assert out.returncode == 2 and message in out.stderr, (path, out.stdout, out.stderr)
    _write_run(tmp_path / "runs" / "a", [[1, 2]])  # in a folder of runs: said, the others summarised, status 1
    fifo_run.rename(tmp_path / "runs" / "b")
    out = _run("summary", tmp_path / "runs")
    assert out.returncode == 1 and "runs/a/metrics.jsonl: 1 job(s)" in out.stdout, (out.stdout, out.stderr)
    for command in ("summary", "report"):  # both say it alike
        out = _run(command, tmp_path / "runs")
        assert out.returncode == 1 and "runs/b/metrics.jsonl' is no regular file" in out.stderr, (command, out.stderr)


def test_summary_and_report_say_the_same_of_a_file_that_is_not_a_metrics_jsonl(tmp_path):
    """Both commands count the lines that are not records alike (blank lines are neither): the
    report counted the blank lines too, and said something else."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "notes.jsonl"
    path.write_text('\nnot json\n\n{"no": "kind"}\n\n')
    said = []
    for command in ("summary", "report"):
        out = _run(command, path)
        assert out.returncode == 2, (command, out.stdout, out.stderr)
        said.append(out.stderr.strip())
    assert said[0] == said[1] and "none of its 2 non-blank line(s)" in said[0], said


def test_a_run_that_cannot_be_read_is_said_and_the_others_are_summarised(tmp_path):
    """A folder of runs, one a 0-byte metrics.jsonl (a Monitor started on a full disk): summary said
    only that file was "not a distmetrics metrics.jsonl" and exited 2, nothing of the good runs."""
    _write_run(tmp_path / "runs" / "a_good", [[10, 20]])
    (tmp_path / "runs" / "b_full").mkdir()
    (tmp_path / "runs" / "b_full" / "metrics.jsonl").write_bytes(b"")
    _write_run(tmp_path / "runs" / "c_good", [[10, 20, 30]])
    out = _run("summary", tmp_path / "runs")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "a_good/metrics.jsonl: 1 job(s)" in out.stdout and "c_good/metrics.jsonl: 1 job(s)" in out.stdout
    assert "last step 20: loss=0.5" in out.stdout and "last step 30:" in out.stdout and "b_full" not in out.stdout
    full = tmp_path / "runs" / "b_full" / "metrics.jsonl"
    empty = f"{str(full)!r} holds no record: it is empty (a run that wrote nothing"
    assert empty in out.stderr and "1 of the 3 runs could not be read" in out.stderr, out.stderr
    assert "not a distmetrics metrics.jsonl" not in out.stderr and "Traceback" not in out.stderr
    # the empty file given alone, or a folder none of whose runs can be read: nothing done, status 2
    alone = _run("summary", full)
    assert alone.returncode == 2 and empty in alone.stderr and not alone.stdout, alone.stderr
    for name in ("a_good", "c_good"):
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("not json\n")
    none = _run("summary", tmp_path / "runs")
    assert none.returncode == 2 and not none.stdout, none.stdout
    assert none.stderr.count("is not a distmetrics metrics.jsonl") == 2 and empty in none.stderr
    assert "none of the 3 runs could be read" in none.stderr


def test_a_line_over_the_limit_is_unreadable_and_never_held_whole(tmp_path, monkeypatch):
    """A file without a newline (a checkpoint given by mistake) was read whole: 606 MB for 300 MB of
    zeros. With the limit at 1 MiB, 16 MiB of zeros are skipped in a few MiB of memory:
    as a line cut short where records surround it, as no metrics file where it comes first."""
    import tracemalloc

    from distmetrics import cli, runlog

    monkeypatch.setattr(runlog, "LINE_LIMIT", 1 << 20, raising=False)
    zeros = b"\0" * (16 << 20)
    inside = _write_run(tmp_path / "inside", [[10, 20]])
    with open(inside, "ab") as f:
        f.write(zeros + b"\n" + json.dumps({"kind": "train", "step": 30, "train/loss": 0.25}).encode() + b"\n")
    first = tmp_path / "checkpoint.pt"
    first.write_bytes(zeros)
    tracemalloc.start()
    try:
        text = cli.summarise(inside)
        _, inside_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with pytest.raises(ValueError) as refused:
            cli.summarise(first)
        _, first_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert inside_peak < 4 << 20 and first_peak < 4 << 20, (inside_peak, first_peak)  # not the 16 MiB line
    assert "1 job(s), 1 unreadable line(s) skipped" in text and "last step 30: loss=0.25" in text, text
    assert "is not a distmetrics metrics.jsonl: its first line is over 1,048,576 bytes long" in str(refused.value)


def test_a_record_the_monitor_wrote_over_the_limit_is_read_whole(tmp_path, monkeypatch):
    """Per-rank values of many names on many ranks make a record of 100 MB: with the limit at 64 MiB it
    was skipped as a line a crash cut short. A line that opens as the Monitor's records do is read
    whole (the limit patched to 1 MiB here, the record written by the JSONL sink itself)."""
    from distmetrics import cli, runlog
    from distmetrics.sinks.jsonl import JsonlSink, read_jsonl

    monkeypatch.setattr(runlog, "LINE_LIMIT", 1 << 20, raising=False)
    path = _write_run(tmp_path, [[10, 20]])
    sink = JsonlSink(path)
    big = {f"layer_stats/block.{i}/value": i + 0.5 for i in range(100_000)}  # about 3 MiB
    sink.log({"train/loss": 0.5, **big}, 30, "train")
    sink.close()
    text = cli.summarise(path)
    assert "unreadable" not in text and "last step 30: loss=0.5" in text, text
    assert [r["step"] for r in read_jsonl(path) if r["kind"] == "train"][-1] == 30


def test_summary_reports_each_job_and_a_job_that_logs_steps_again(tmp_path):
    """Two jobs appended to one file (a restart from step 20's checkpoint): each is reported
    with its own first and last step, and the overlap is named."""
    path = _write_run(tmp_path / "run", [[10, 20, 30, 40], [30, 40, 50]])
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 60, "tim')  # a line cut short by a crash
    out = _run("summary", path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "2 job(s), 1 unreadable line(s) skipped" in text
    first, second = text.split("job 2:")
    assert "first step 10:" in first and "last step 40:" in first
    assert "first step 30:" in second and "last step 50:" in second
    assert "logs step 30 again: job 1 logged up to step 40" in second


def test_check_config_without_a_path_names_the_path_alone(capsys):
    """argparse listed the optional overrides as required too."""
    from distmetrics.cli import main

    with pytest.raises(SystemExit):
        main(["check-config"])
    assert capsys.readouterr().err.strip().endswith("the following arguments are required: path")


def test_check_config_notes_what_stands_in_place_of_the_run_files_and_the_monitor_says_a_device(tmp_path, capsys,
                                                                                                  caplog):
    """check-config said "ok" where metrics.jsonl was a link to /dev/null (the Monitor then wrote every record into
    it, unsaid), a link into a folder that does not exist, or progress.txt a folder (both sinks turned off at
    start). It now notes each; the Monitor warns of the device. A link whose folder is there is fine."""
    import logging

    import distmetrics as dm
    from distmetrics.cli import main

    for name, target in (("device", "/dev/null"), ("nowhere", str(tmp_path / "gone" / "x")),
                         ("fine", str(tmp_path / "real.jsonl")), ("loop", str(tmp_path / "loop" / "metrics.jsonl"))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").symlink_to(target)
    (tmp_path / "folder" / "progress.txt").mkdir(parents=True)
    said = {}
    for name in ("device", "nowhere", "fine", "loop", "folder"):
        (tmp_path / f"{name}.yaml").write_text(f"output_dir: {tmp_path / name}\n")
        assert main(["check-config", str(tmp_path / f"{name}.yaml")]) in (0, None)
        said[name] = capsys.readouterr().out.strip().splitlines()[1:]
    assert said == {
        "device": [f"note: {tmp_path}/device/metrics.jsonl is no regular file (a link to /dev/null): what is written "
                   "there is not kept"],
        "nowhere": [f"note: {tmp_path}/nowhere/metrics.jsonl is a link to '{tmp_path}/gone/x', whose folder is "
                    "missing or no folder: its sink is turned off with a warning"],
        "loop": [f"note: {tmp_path}/loop/metrics.jsonl is a link that leads back to itself: its sink is turned off "
                 "with a warning"],
        "fine": [],
        "folder": [f"note: {tmp_path}/folder/progress.txt is a folder: its sink is turned off with a warning"]}
    with caplog.at_level(logging.WARNING, logger="distmetrics"):
        dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path / "device"), console=False, tensorboard=False)).close()
    assert f"{tmp_path}/device/metrics.jsonl is no regular file (a link to /dev/null)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distmetrics"):  # a folder: its sink says so, the claim nothing
        dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path / "folder"), console=False, tensorboard=False)).close()
    assert "no regular file" not in caplog.text and "progress.txt" in caplog.text, caplog.text


def test_check_config_refuses_bad_input_with_exit_status_2(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    huge = tmp_path / "huge.yaml"
    huge.write_text(f"num_params: {10 ** 400}\n")
    cases = [
        (["configs/metrics.yaml", "log_interval=[1"], "override 'log_interval=[1': the value '[1' is not valid YAML"),
        ([binary], "is not a UTF-8 text file"),
        ([huge], f"{huge}: num_params=1000"),
        (["configs/metrics.yaml", "wandb_mode=off"], "wandb_mode=False: YAML reads an unquoted off/on/no/yes"),
        (["configs/metrics.yaml", "wandb_project=off"], "override 'wandb_project=off': wandb_project=False: YAML reads "
                                                         "an unquoted off/on/no/yes as a boolean"),
        (["configs/metrics.yaml", "log_interval=1_000"], "override 'log_interval=1_000': the number '1_000' holds a "
                                                          "'_': YAML 1.1 reads it as 1000, YAML 1.2 as text"),
        (["configs/metrics.yaml", "writer_rank=middle"],
         "override 'writer_rank=middle': writer_rank='middle': accepted values are 'first', 'last'"),
    ]
    for args, message in cases:
        out = _run("check-config", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_check_config_applies_the_monitors_tensor_inspection_checks(tmp_path):
    """feature_dirs without allow_custom_feature_dirs, a missing features file: refused as the
    Monitor refuses them; the shipped CPU features file passes nvdlfw-inspect's own check."""
    inspect = ["tensor_inspect.enabled=true", "tensor_inspect.features=configs/tensor_stats_cpu.yaml"]
    refused = _run("check-config", "configs/metrics.yaml", *inspect, f"tensor_inspect.feature_dirs=[{tmp_path}]")
    assert refused.returncode == 2 and "allow_custom_feature_dirs" in refused.stderr
    missing = _run("check-config", "configs/metrics.yaml", "tensor_inspect.enabled=true",
                   f"tensor_inspect.features={tmp_path / 'nope.yaml'}")
    # named with the override that set it, as the config's own checks name a value (it named the config file,
    # and before that the features file alone)
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"error: override 'tensor_inspect.features={tmp_path / 'nope.yaml'}': "
                                     "tensor_inspect.features: "), missing.stderr
    assert "does not exist" in missing.stderr
    config = tmp_path / "config.yaml"  # set by the file: named with the file
    config.write_text(f"tensor_inspect: {{enabled: true, features: {tmp_path / 'nope.yaml'}}}\noutput_dir: /proc/x\n")
    for extra, lead in (((), f"error: {config}: tensor_inspect.features: "),
                        (("tensor_inspect.enabled=false",), f"error: {config}: output_dir='/proc/x' cannot be written"),
                        (("tensor_inspect.enabled=false", "output_dir=/proc/y"),
                         "error: override 'output_dir=/proc/y': output_dir='/proc/y' cannot be written")):
        said = _run("check-config", config, *extra)
        assert said.returncode == 2 and said.stderr.startswith(lead), (extra, said.stderr)
    ok = _run("check-config", "configs/metrics.yaml", *inspect)
    assert ok.returncode == 0 and "tensor_inspect: 1 section(s)" in ok.stdout, ok.stderr


def _monitor_refusals(rank: int, world: int, cases: list) -> list:
    """What ``Monitor()`` raises on this rank for each list of overrides of the shipped config."""
    import distmetrics as dm

    said = []
    for overrides in cases:
        try:
            dm.Monitor(dm.MetricsConfig.from_yaml(ROOT / "configs" / "metrics.yaml", overrides)).close()
            said.append(None)
        except ValueError as err:
            said.append(str(err))
    return said


def _tree(folder: Path) -> list:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def test_check_config_refuses_the_folders_the_monitor_cannot_make_and_makes_none(tmp_path):
    """check-config said "ok" for a tensor_inspect.log_dir or output_dir that the Monitor then
    refused (a file in the way, a folder under /proc). The truth is the Monitor's own refusal on 2
    gloo ranks; check-config refuses the same configs naming the same key, and makes nothing: not
    for a refused config, nor for an accepted one whose folders do not exist yet."""
    from tests.dist_utils import run_ranks

    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a folder cannot be made under a file, nor the file be one
    odd = {name: tmp_path / f"odd_{name}" for name in ("metrics.jsonl", "progress.txt")}
    for name, folder in odd.items():  # the writer read its last record there at start-up and waited forever
        folder.mkdir()
        os.mkfifo(folder / name)
    inspect = ["tensor_inspect.enabled=true", f"tensor_inspect.features={ROOT / 'configs' / 'tensor_stats_cpu.yaml'}"]
    quiet = ["console=false", "tensorboard=false", "hang_timeout_s=20"]
    cases = [  # (the overrides, what both the Monitor and check-config say)
        ([*inspect, f"tensor_inspect.log_dir={blocker / 'x'}", f"output_dir={tmp_path / 'out'}"],
         f"tensor_inspect.log_dir: nvdlfw-inspect's log folder {str(blocker / 'x')!r} cannot be made"),
        ([f"output_dir={blocker}"], f"output_dir={str(blocker)!r} cannot be written"),
        (["output_dir=/proc/nope/x"], "output_dir='/proc/nope/x' cannot be written"),
        *(([f"output_dir={folder}"], f"{folder / name} is a named pipe (FIFO), not a file")
          for name, folder in odd.items()),
    ]
    for rank_said in run_ranks(_monitor_refusals, 2, [overrides + quiet for overrides, _ in cases], timeout=180):
        for said, (_, message) in zip(rank_said, cases):
            assert said is not None and message in said, (said, message)
    before = _tree(tmp_path)  # what the Monitor's refusals left (its claim makes output_dir)
    for overrides, message in cases:
        out = _run("check-config", "configs/metrics.yaml", *overrides, *quiet)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (overrides, out.stderr)
    fresh = tmp_path / "new" / "run"
    ok = _run("check-config", "configs/metrics.yaml", *inspect, f"output_dir={fresh}", *quiet)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok.stderr
    assert _tree(tmp_path) == before and not (tmp_path / "new").exists()
    # a cluster's file system that does not exist here is the job's machines' to check: said, not refused
    absent = "/distmetrics-absent-fs-0"
    assert not Path(absent).exists()
    ok = _run("check-config", "configs/metrics.yaml", *inspect, f"output_dir={absent}/proj/run", *quiet)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok.stderr
    for key in ("output_dir", "tensor_inspect.log_dir"):
        assert f"note: {key} is not checked: {absent} does not exist on this machine" in ok.stdout, ok.stdout


def test_a_malformed_features_file_is_a_config_error_naming_the_key(tmp_path, capsys):
    from distmetrics.cli import main

    section = "s:\n  enabled: true\n  layers: {layer_name_regex_pattern: fc1}\n  distmetrics:\n    LogTensorStats:"
    cases = [
        (" null\n", "distmetrics.LogTensorStats must be a mapping of settings"),
        ("\n      enabled: true\n      tensors_struct: [activation]\n",
         "distmetrics.LogTensorStats.tensors_struct must be a list of mappings"),
        ("\n      enabled: true\n      tensors: activation\n", "distmetrics.LogTensorStats.tensors must be a list"),
        ("\n      enabled: true\n      tensors: [activation]\n      stats: max\n", "stats must be a non-empty list"),
        ("\n      enabled: true\n      tensors: [activation]\n      stats: [max]\n      freq: often\n",
         "freq must be a whole number of steps >= 1, got 'often'"),
        # what used to pass the check and fail (or be ignored) at a training step:
        ("\n      enabled: true\n      tensors_struct:\n        - {tensor: activation, stat: [max]}\n",
         "unknown key(s) ['stat'] in a distmetrics.LogTensorStats.tensors_struct entry"),
        ("\n      enabled: true\n      tensors: [activation]\n      stats: []\n", "stats must be a non-empty list"),
        ("\n      enabled: true\n      tensors: [activation]\n      stats: [L2_NORM]\n",
         # our statistics are named as listed (nvdlfw's own: any case)
         "distmetrics.LogTensorStats stat 'L2_NORM' for tensor 'activation' is not one of"),
        ("\n      enabled: true\n      tensors_struct:\n        - {tensor: activation, stats: [max], freqq: 3}\n",
         "unknown key(s) ['freqq']"),
        ("\n      enabled: true\n      tensors: [activation]\n      stats: [max]\n      start_step: '2'\n",
         "start_step for tensor 'activation' must be a whole step number"),
        ("\n      enabled: true\n      tensors: [activation]\n      stats: [max]\n      start_end_list: [[0]]\n",
         "start_end_list for tensor 'activation' must be a list of [start, end] step pairs"),
    ]
    base = "s:\n  enabled: true\n  layers: {layer_name_regex_pattern: fc1}\n  LogTensorStats:\n      enabled: true\n"
    for body, message in (("      tensors: [activation]\n      stats: [max]\n      freq: 0\n",
                           "freq must be a whole number of steps >= 1, got 0"),
                          ("      tensors: [activation]\n      stats: [median]\n",
                           "LogTensorStats stat 'median' for tensor 'activation' is not one of min, max, mean, std, "
                           "l1_norm, l2_norm")):
        cases.append((None, base + body, message))
    for number, case in enumerate(cases):  # the first as a command, the rest through the same main() in-process
        text, message = (case[1], case[2]) if len(case) == 3 else (section + case[0], case[1])
        body = text
        features = tmp_path / f"features{number}.yaml"
        features.write_text(text)
        args = ("check-config", ROOT / "configs" / "metrics.yaml", "tensor_inspect.enabled=true",
                f"tensor_inspect.features={features}")
        if number == 0:
            out = _run(*args)
            status, stderr = out.returncode, out.stderr
        else:
            capsys.readouterr()
            status, stderr = main(list(map(str, args))), capsys.readouterr().err
        assert status == 2 and message in stderr and "section 's'" in stderr, (body, stderr)
        assert "Traceback" not in stderr


def test_check_features_names_a_section_yaml_reads_as_a_number(tmp_path):
    """A section named ``1:`` (an int key in YAML) passed every check, then the "ok" line raised
    TypeError joining the section names, exit status 1."""
    path = tmp_path / "features.yaml"
    path.write_text("1:\n  enabled: true\n  layers: {layer_name_regex_pattern: fc1}\n  distmetrics:\n"
                    "    LogTensorStats: {enabled: true, tensors: [activation], stats: [max]}\n"
                    "s:\n  enabled: true\n  layers: {layer_name_regex_pattern: fc2}\n  distmetrics:\n"
                    "    LogTensorStats: {enabled: true, tensors: [activation], stats: [max]}\n")
    out = _run("check-features", path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith(f"ok: {path} (2 section(s): 1, s)"), out.stdout


def test_the_monitor_refuses_what_check_config_refuses(tmp_path):
    import distmetrics as dm

    config = dm.MetricsConfig.from_yaml(ROOT / "configs" / "metrics.yaml", [
        "tensor_inspect.enabled=true", "tensor_inspect.features=configs/tensor_stats_cpu.yaml",
        f"tensor_inspect.feature_dirs=[{tmp_path}]", f"output_dir={tmp_path}"])
    with pytest.raises(dm.ConfigError, match="allow_custom_feature_dirs"):
        dm.Monitor(config)


def test_summary_holds_a_few_records_at_a_time_however_long_the_file(tmp_path, monkeypatch):
    """Every decoded record was kept until the summary was written: memory 2.6× the file (a 3 GB
    file took 7.6 GiB, a 12 GB one would be killed). Counted here as the records alive at once:
    each decoded record is tracked until it is freed, and no more than a few may be alive."""
    import weakref

    from distmetrics import cli, runlog

    steps = range(1, 2001)
    path = _write_run(tmp_path / "run", [list(steps)])
    with open(path, "a") as f:
        f.write("".join(json.dumps({"kind": "eval", "step": s, "eval/loss": 1.0}) + "\n" for s in steps[::100]))
        f.write(json.dumps({"kind": "alert", "step": 2000, "message": "loss spike"}) + "\n")

    class Record(dict):  # a dict that a weak reference can follow
        pass

    alive, most, decode = [0], [0], runlog.decode_record

    def freed():
        alive[0] -= 1

    def counting(line):
        record = decode(line)
        if record is None:
            return None
        most[0] = max(most[0], alive[0])  # the records kept when the next one is read
        record = Record(record)
        alive[0] += 1
        weakref.finalize(record, freed)
        return record

    monkeypatch.setattr(runlog, "decode_record", counting)
    text = cli.summarise(path)
    assert "2000 train, 20 eval, 1 alert record(s)" in text and "first step 1:" in text, text
    assert "last step 2000: loss=0.005" in text and "alert step 2000: loss spike" in text, text
    assert most[0] <= 4, f"{most[0]} records alive at once"


_JOB = """
import os, signal, sys
import distmetrics as dm
out, how, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = dm.MetricsConfig(output_dir=out, log_interval=2, console=False, tensorboard=False, timing_log_level=-1)
if how == "closed":
    with dm.Monitor(config) as monitor:
        for step in range(first, first + 3):
            monitor.step(step, loss=1.0)
    sys.exit(0)
monitor = dm.Monitor(config)
for step in range(first, first + 3):
    monitor.step(step, loss=1.0)
if how == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "raised":
    raise RuntimeError("a failing step")
"""


def test_summary_and_report_tell_a_killed_job_from_one_that_ended(tmp_path):
    """Real processes on one output_dir: a job whose Monitor was closed, one that ended without closing
    it (its exit hook), one ending on an uncaught error, one SIGKILLed, then one closed, after a job of
    a version that wrote no end records (its run record says nothing of them: not taken for killed). A killed job
    wrote nothing to tell it by: summary and report could not tell it from a job that finished. Each
    Monitor that ends now writes an ``end`` record; the killed job has none."""
    older = {"kind": "run", "step": 0, "time": "2026-01-01T00:00:00.000+00:00", "world_size": 1}  # no end_record
    (tmp_path / "metrics.jsonl").write_text(json.dumps(older) + "\n")  # a job of a version without end records
    first = 1
    for how in ("closed", "open", "raised", "killed", "closed"):
        job = subprocess.run([sys.executable, "-c", _JOB, str(tmp_path), how, str(first)], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
        assert job.returncode == {"closed": 0, "open": 0, "raised": 1, "killed": -9}[how], job.stderr
        first += 4  # 3 steps from an odd one: the last, not a log step, is unwritten where the Monitor is not closed
    summary = _run("summary", tmp_path)
    assert summary.returncode == 0, summary.stderr
    ends = [line.strip() for line in summary.stdout.splitlines() if line.startswith("  ended") or "no end" in line]
    assert ends == ["no end record (written by a version without them): how the job ended is not known",
                    "ended at step 3: closed its Monitor",
                    "ended at step 7: its process ended with the Monitor open, never closed, the 1 step(s) since "
                    "its last log step not written",
                    "ended at step 11: its process ended with the Monitor open, on an uncaught RuntimeError, the 1 "
                    "step(s) since its last log step not written",
                    KILLED,
                    "ended at step 19: closed its Monitor"], summary.stdout
    report = _run("report", tmp_path, "--out", tmp_path / "report.html")
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report.html").read_text()
    assert all(f"<td>{end}</td>" in page for end in ends), page[page.find("<th>end"):][:3000]
    # the last job has no end record while it runs
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:-1]))
    assert _run("summary", tmp_path).stdout.rstrip().endswith(
        KILLED + " or is still running")


_ENDS_AT_EXIT = """
import atexit, resource, signal, sys
import distmetrics as dm
out, how = sys.argv[1], sys.argv[2]
held = {}
if how == "closed in a later exit hook":
    atexit.register(lambda: held["monitor"].close())  # registered first: runs after the Monitor's own hook
config = dm.MetricsConfig(output_dir=out, log_interval=2, console=False, tensorboard=False, timing_log_level=-1)
held["monitor"] = monitor = dm.Monitor(config)
monitor.step(1, loss=1.0)
monitor.step(2, loss=1.0)
if how == "full disk at exit":  # the file may not grow past what it holds now, plus a little
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    size = (__import__("os").path.getsize(out + "/metrics.jsonl") // 512 + 1) * 512
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    monitor.record("x/" + "a" * 2000, 1.0)  # a record too long for the room left: lost, a gap record marks it
monitor.step(3, loss=1.0)
monitor.step(4, loss=1.0)
if how == "no room for the end record":  # the file may not grow past the step 4 record
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    size = __import__("os").path.getsize(out + "/metrics.jsonl")
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
monitor.step(5, loss=1.0)
raise RuntimeError("a failing step")
"""


@pytest.mark.parametrize("how", ["closed in a later exit hook", "full disk at exit", "no room for the end record"])
def test_the_end_record_is_the_last_line_when_a_later_exit_hook_closes_or_records_were_lost(tmp_path, how):
    """A close() in an exit hook of the user's, after the Monitor's own, wrote a train record and a
    second end record after the first, which said the crash; the last (closed) hid it. Where records
    were lost, the end record was held for a close() that never came at an exit with the Monitor open:
    the job read as killed. The last line is now the end record, saying both, or after the gap record."""
    job = subprocess.run([sys.executable, "-c", _ENDS_AT_EXIT, str(tmp_path), how], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert job.returncode == 1 and "a failing step" in job.stderr, job.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if how == "no room for the end record":  # the job reads as killed, and the warning says why
        assert [(r["kind"], r["step"]) for r in records[1:]] == [("train", 2), ("train", 4)], records
        assert ("the jsonl sink could not write the job's end record to " + str(tmp_path / "metrics.jsonl")
                + " (a full disk, or a file size limit?): distmetrics summary and report will read this job as "
                "killed") in job.stderr, job.stderr
        assert _run("summary", tmp_path).stdout.rstrip().endswith(
            KILLED + " or is still running")
        return
    end = records[-1]
    assert end["kind"] == "end" and end["step"] == 5 and end["stepped"] is True, records
    if how == "closed in a later exit hook":
        assert end["how"] == ("its process ended with the Monitor open, on an uncaught RuntimeError; then closed "
                              "its Monitor, in an exit hook"), end
        assert end["unwritten_steps"] == 0 and records[-2]["step"] == 5, records  # close() wrote step 5
    else:
        assert records[-2]["kind"] == "gap" and records[-2]["lost_records"] == 1, records
        assert end["how"] == "its process ended with the Monitor open, on an uncaught RuntimeError", end
        assert end["unwritten_steps"] == 1, end
        assert ("the process ends with a Monitor open, on an uncaught RuntimeError: the 1 step(s) up to step 5 since "
                "the last log step are not written") in job.stderr, job.stderr  # it said "never closed"
    assert _run("summary", tmp_path).stdout.rstrip().endswith(f"ended at step 5: {end['how']}" + (
        ", the 1 step(s) since its last log step not written" if end["unwritten_steps"] else ""))


def _reduction_fails_at_step_2(monkeypatch) -> None:
    """The reduction of step 2 raises, after the interval's samples were taken (the narrowest boundary:
    a value the packs cannot hold is refused before it, in the collector's take_samples)."""
    from distmetrics.reduce import Reducer

    reduce = Reducer.reduce

    def failing(self, samples, tag=0, steps=0):
        if tag == 2:
            raise RuntimeError("the reduction failed")
        return reduce(self, samples, tag, steps)

    monkeypatch.setattr(Reducer, "reduce", failing)


def test_the_end_record_counts_the_steps_a_failed_log_step_lost(tmp_path, monkeypatch):
    """A log step that failed after taking its samples lost its interval's steps (said in a warning),
    but the end record said 0 steps unwritten: the interval's count had gone with the samples."""
    import distmetrics as dm
    from distmetrics.runlog import end_note

    config = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=2, console=False, tensorboard=False,
                              timing_log_level=-1)
    _reduction_fails_at_step_2(monkeypatch)
    with pytest.raises(Exception) as raised:
        with dm.Monitor(config) as monitor:
            for step in (1, 2):
                monitor.step(step, loss=1.0)
    end = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))[-1]
    how = f"left its Monitor on {type(raised.value).__name__}"
    assert (end["kind"], end["how"], end["unwritten_steps"]) == ("end", how, 2), (end, raised.value)
    # summary said them "since its last log step", where a failed log step's may be any interval's
    assert end["lost_in_log_steps"] == 2
    assert end_note(end, True) == f"ended at step 2: {how}, the 2 step(s) of failed log steps not written"
    end.update(step=12, unwritten_steps=3)  # a loop that went on to step 12 and left one step after its last
    assert end_note(end, True) == (f"ended at step 12: {how}, the 2 step(s) of failed log steps and the 1 step(s) "
                                   "since its last log step not written")


def test_a_failed_close_record_is_not_called_a_log_step(tmp_path, caplog, monkeypatch):
    """The record close() writes failing after its samples were taken was said as "the log step at
    step 2 did not complete", a step that was no log step."""
    import distmetrics as dm

    config = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=4, console=False, tensorboard=False,
                              timing_log_level=-1)
    _reduction_fails_at_step_2(monkeypatch)
    monitor = dm.Monitor(config)
    for step in (1, 2):
        monitor.step(step, loss=1.0)
    with caplog.at_level("WARNING", logger="distmetrics"), pytest.raises(Exception):
        monitor.close()
    said = [r.getMessage() for r in caplog.records if "did not complete" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("distmetrics: the record close() writes at step 2 did not complete"), said
    end = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))[-1]
    assert (end["kind"], end["unwritten_steps"], end["lost_in_log_steps"]) == ("end", 2, 2), end
