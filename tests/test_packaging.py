"""The package as a user installs it: a wheel built from the project, installed (not editable)
into a folder of its own, names its distribution as every install line does and ships the
nvdlfw-inspect feature folder that tensor inspection loads by path."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = re.search(r'^name = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_every_install_line_names_the_distribution():
    """``pip install X[extra]`` anywhere in the project names the distribution of pyproject.toml
    (``distmetrics`` on the package index is an unrelated project)."""
    assert DISTRIBUTION == "torch-distmetrics"
    files = [ROOT / "README.md", *ROOT.glob("configs/*.yaml"), *(p for p in ROOT.glob("launch/*") if p.is_file()),
             *ROOT.glob("distmetrics/**/*.py")]  # (launch/__pycache__: the scripts the tests import, compiled)
    lines = []
    for path in files:
        for match in re.finditer(r"pip install [\"']?([A-Za-z0-9_.-]+)\[", path.read_text()):
            lines.append((path.name, match.group(1)))
    assert lines, "no install line found"
    assert {name for _, name in lines} - {"."} == {DISTRIBUTION}, lines  # "." is a checkout


def test_a_wheel_installs_the_feature_folder_and_tensor_inspection_finds_it(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "distmetrics", source / "distmetrics", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = (tmp_path / "wheel").glob("*.whl")
    assert wheel.name.startswith("torch_distmetrics-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "distmetrics/tensor_stats/nvdlfw_features/distmetrics_stats.py" in names
    assert not any(name.startswith("tests/") for name in names)

    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    work = tmp_path / "work"  # not the project folder: only the installed copy can be imported
    work.mkdir()
    shutil.copy(ROOT / "configs" / "tensor_stats_cpu.yaml", work / "features.yaml")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    where = subprocess.run([sys.executable, "-c", "import distmetrics; print(distmetrics.__file__)"], cwd=work,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    checked = subprocess.run([sys.executable, "-m", "distmetrics.cli", "check-features", "features.yaml"], cwd=work,
                             env=env, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and "mlp_activations" in checked.stdout, checked.stderr[-3000:]
