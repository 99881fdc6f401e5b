"""The README's examples, run as they stand there (extracted from README.md, not copied)."""

import os
import re
from pathlib import Path

from tests.dist_utils import run_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
SLOW_MS = 20.0  # rank 1's loader sleeps this long per batch; rank 0's returns at once


def readme_block(heading: str) -> str:
    """The first ```python block under a README heading."""
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_adding_a_metric(rank: int, world: int, root: str) -> dict:
    import time

    import distmetrics as dm

    def loader():
        while True:
            if rank == 1:
                time.sleep(SLOW_MS / 1000)
            yield rank

    os.chdir(root)  # the example writes runs/data_wait/ relative to the working directory
    namespace = {"loader": loader()}
    exec(compile(readme_block("## Adding a metric"), "README.md", "exec"), namespace)
    records = [r for r in dm.read_jsonl(Path(root) / "runs/data_wait/metrics.jsonl") if r["kind"] == "train"]
    return {"records": records} if rank == 0 else {}


def test_the_adding_a_metric_example_runs_on_two_ranks_and_names_the_slow_rank(tmp_path):
    results = run_ranks(_run_adding_a_metric, 2, str(tmp_path))
    records = results[0]["records"]
    assert [r["step"] for r in records] == [10, 20]
    for record in records:
        assert record["data/wait_ms/max_rank"] == 1
        assert record["data/wait_ms"] >= SLOW_MS
        assert record["data/wait_ms"] < SLOW_MS * 50  # per step, not per interval
