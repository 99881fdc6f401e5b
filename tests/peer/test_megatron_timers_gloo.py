"""Megatron-Core's ``Timers`` and ours, side by side on 2 real gloo ranks: for the same timings
``get_all_timers_string``, ``log`` and ``write`` must give the same output.

Follows megatron-core 0.16.1 ``megatron/core/timers.py`` (installed) and what Megatron-LM's
``tests/unit_tests/test_timers.py`` (refs/pull/5014) checked with mocked internals; here the
values travel through the real collective. Both implementations get the same ``set_elapsed``
values on each rank: timers that measured 0, a timer missing on one rank, float32 rounding,
names of 46–48 characters. One deliberate difference: Megatron writes nothing to a writer that
is neither a ``SummaryWriter`` instance nor the ``wandb`` module; ours writes to anything with
``add_scalar``.

Replaced here: Megatron's two CUDA calls (conftest.py); the writers ``write`` targets, which
record their calls instead of writing: a ``SummaryWriter`` subclass without an event file, and
the real ``wandb`` module with its ``wandb.log`` swapped for a recorder while ``write`` runs
(Megatron only writes to W&B when given the module itself, and no W&B run exists here).
"""

from __future__ import annotations

import contextlib
import io
import logging

import pytest

from tests.dist_utils import run_ranks
from tests.peer.conftest import recording_summary_writer

WORLD = 2
SCENARIO = {  # name -> seconds on rank 0, rank 1 (None: the timer does not exist there)
    "fwd": (0.1234, 0.2345),
    "zero-on-rank0": (0.0, 0.05),
    "only-rank0": (0.3, None),
    "zero-everywhere": (0.0, 0.0),
    "f32-rounding": (0.125185005, 0.125185005),
    "n" * 46: (0.001, 0.002),
    "m" * 47: (0.001, 0.002),
    "k" * 48: (0.001, 0.002),
}
NAMES = list(SCENARIO)
CASES = ["text_n1", "text_n10", "text_zero_only", "text_empty", "log_records", "log_stdout",
         "write_summarywriter", "write_wandb", "text_twice_kept", "text_twice_reset", "text_after_reset"]


def _outputs(timers_cls, rank: int) -> dict:
    import wandb

    out = {}
    for option in ("max", "minmax", "all"):
        timers = timers_cls(2, option)
        for name, values in SCENARIO.items():
            if values[rank] is not None:
                timers(name, log_level=0).set_elapsed(values[rank])
        r = {"text_n1": timers.get_all_timers_string(NAMES, normalizer=1.0, reset=False),
             "text_n10": timers.get_all_timers_string(NAMES, normalizer=10, reset=False),
             "text_zero_only": timers.get_all_timers_string(["zero-everywhere"], reset=False),
             "text_empty": timers.get_all_timers_string([], reset=False)}
        records = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
        root = logging.getLogger()
        level, root.level = root.level, logging.DEBUG
        root.addHandler(handler)
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            timers.log(NAMES, reset=False)
        root.removeHandler(handler)
        root.setLevel(level)
        r["log_records"], r["log_stdout"] = records, stdout.getvalue()
        writer = recording_summary_writer()
        timers.write(NAMES, writer, 7, normalizer=10, reset=False)
        r["write_summarywriter"] = writer.calls
        logged, saved = [], wandb.log
        wandb.log = lambda *args, **kwargs: logged.append(args)
        try:
            timers.write(NAMES, wandb, 7, reset=False)
        finally:
            wandb.log = saved
        r["write_wandb"] = logged
        twice = ["fwd", "fwd", "only-rank0"]  # a name listed twice: read twice, after its reset the second time
        r["text_twice_kept"] = timers.get_all_timers_string(twice, reset=False)
        r["text_twice_reset"] = timers.get_all_timers_string(twice)
        timers.get_all_timers_string(NAMES)  # reset=True: consumed
        r["text_after_reset"] = timers.get_all_timers_string(NAMES)
        out[option] = r
    return out


def _both(rank: int, world: int) -> dict:
    from distmetrics.collectors.timers import Timers
    from tests.peer.conftest import megatron_timers_on_cpu

    ours = _outputs(Timers, rank)
    with megatron_timers_on_cpu() as megatron:
        theirs = _outputs(megatron.Timers, rank)
    return {"ours": ours, "megatron": theirs}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_both, WORLD)


@pytest.mark.parametrize("option", ["max", "minmax", "all"])
def test_ours_gives_megatrons_output_byte_for_byte(results, option):
    for rank in range(WORLD):
        for case in CASES:
            assert results[rank]["ours"][option][case] == results[rank]["megatron"][option][case], (rank, case)


def test_the_reference_is_what_megatron_prints(results):
    """Pins the reference itself, so a change in Megatron's output shows here."""
    m = results[0]["megatron"]
    assert m["max"]["text_n1"] == "\n".join([
        "max time across ranks (ms):",
        "    fwd ............................................: 234.50",
        "    zero-on-rank0 ..................................: 50.00",
        "    only-rank0 .....................................: 300.00",
        "    f32-rounding ...................................: 125.18",
        "    " + "n" * 46 + " .: 2.00", "    " + "m" * 47 + " : 2.00", "    " + "k" * 48 + " : 2.00"])
    assert m["minmax"]["text_n10"].splitlines()[1:3] == [
        "    fwd ............................................: (12.34, 23.45)",
        "    zero-on-rank0 ..................................: (5.00, 5.00)"]
    assert m["all"]["text_n1"].splitlines()[:6] == [
        "times across ranks (ms):", "  fwd:", "     rank  0: 123.40", "     rank  1: 234.50",
        "  zero-on-rank0:", "     rank  1: 50.00"]
    for option in ("max", "minmax", "all"):
        assert m[option]["text_zero_only"] is None and m[option]["text_empty"] is None
        assert m[option]["text_after_reset"] is None
        assert results[0]["megatron"][option]["log_records"] == []  # only the last rank logs
        assert results[1]["megatron"][option]["log_records"] == [("INFO", m[option]["text_n1"])]
        sw = m[option]["write_summarywriter"]
        assert sw[0][0] == "fwd-time" and sw[0][1] == pytest.approx(0.02345) and sw[0][2] == 7
        assert "zero-everywhere-time" not in [c[0] for c in sw]
        assert m[option]["write_wandb"][0] == ({"fwd-time": pytest.approx(0.2345)}, 7)
