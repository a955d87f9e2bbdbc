"""The package as a user installs it: the sdist and the wheel build from the checkout, the wheel
installs into a fresh virtual environment without ``-e``, and ``fedskew sweep`` at its smallest and
``fedskew bench --list`` run from it, away from the checkout, so the package data (the published
registry, the bench's measured timings) is shown to ship. The version is the package's own."""

import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import fedskew

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_installs_and_runs_away_from_the_checkout(tmp_path):
    # the tracked files only, copied, so no build/ or egg-info of an earlier build reaches the wheel and
    # none is left in the checkout
    tree = tmp_path / "tree"
    tracked = subprocess.run(["git", "ls-files", "-z", "--", "pyproject.toml", "README.md", "LICENSE", "src"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, tracked):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir",
                            str(dist), str(tree)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel = next(dist.glob("fedskew-*.whl"))
    sdist = next(dist.glob("fedskew-*.tar.gz"))
    version = fedskew.__version__
    assert wheel.name.startswith(f"fedskew-{version}-") and sdist.name == f"fedskew-{version}.tar.gz"
    names = zipfile.ZipFile(wheel).namelist()
    registry = sorted((ROOT / "src/fedskew/experiments/published").glob("*.yaml"))
    assert registry and all(f"fedskew/experiments/published/{p.name}" in names for p in registry)
    assert "fedskew/experiments/bench_timings.yaml" in names and "fedskew/cli.py" in names
    with tarfile.open(sdist) as tar:
        assert any(n.endswith("src/fedskew/experiments/bench_timings.yaml") for n in tar.getnames())

    # a fresh environment: the wheel installed in it, without -e; the libraries it needs (torch and the
    # rest, gigabytes) are this environment's, reached by a path file, whose own .pth files (the editable
    # install of the checkout among them) are not read
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    inner = next((venv / "lib").glob("python3*/site-packages"))
    (inner / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    if installed.returncode != 0 and "no such option: --python" in installed.stderr:  # (pip < 22.3)
        installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                                    str(inner), str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import fedskew; print(fedskew.__file__, fedskew.__version__)"],
                           capture_output=True, text=True, cwd=work, timeout=300)
    path, version = where.stdout.split()
    assert Path(path).is_relative_to(venv) and version == fedskew.__version__, where.stdout + where.stderr
    script = venv / "bin" / "fedskew"  # the console script the wheel declares
    fedskew_cmd = [str(script)] if script.exists() else [str(python), "-m", "fedskew.cli"]
    listed = subprocess.run([*fedskew_cmd, "bench", "--list"], capture_output=True, text=True, cwd=work, timeout=600)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "seed-papers" in listed.stdout and re.search(r"19 of 173", listed.stdout), listed.stdout[-2000:]
    (work / "tiny.yaml").write_text("name: tiny\nbase: {rounds: 2, partition: {num_clients: 4}, clients_per_round: 2,"
                                    " final_personalization: false}\nmethods: [fedavg]\nseeds: [0]\n")
    swept = subprocess.run([*fedskew_cmd, "sweep", "tiny.yaml", "--jobs", "1"], capture_output=True, text=True,
                           cwd=work, timeout=600)
    assert swept.returncode == 0, swept.stdout[-2000:] + swept.stderr[-2000:]
    assert (work / "runs/sweep-tiny/results.sqlite").is_file() and (work / "runs/sweep-tiny/report/report.md").is_file()


def test_the_version_comes_from_one_place():
    """pyproject.toml reads it from the package; the citation file names the same."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'attr = "fedskew.__version__"' in text
    assert not re.search(r'(?m)^version\s*=', text.split("[tool.")[0])
    assert f"version: {fedskew.__version__}" in (ROOT / "CITATION.cff").read_text()
