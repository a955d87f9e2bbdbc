"""Every command and Python block a user is shown runs as written: the README's, the tutorials' and
the how-to guides'. sybil parses the Markdown; each document's blocks run in order in a folder of their own (with the
repository's ``examples/`` and ``docs/`` beside them, as in a clone), bash blocks through bash, Python blocks as
scripts. A document with a block under ``<!-- slow -->`` (over a minute) runs with the slow tests only; ``<!-- skip:
next ... -->`` (sybil's) leaves out what cannot run here (a GPU, a two-hour board), saying why. ``pip install`` lines
are not run again: the suite runs in the environment they built (``.ci/run`` runs them first)."""

import os
import re
import subprocess
import sys
import unittest
from pathlib import Path

import numpy as np
import pytest
import torch
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from conftest import write_idx

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *(p for folder in ("tutorials", "howto") for p in sorted((ROOT / "docs" / folder)
                                                                                         .glob("*.md"))
                                   if p.name != "index.md")]  # (the index pages list the others: no commands)
SLOW_MARK = "<!-- slow -->"


def _run(cmd: list[str], example) -> None:
    ns = example.namespace
    done = subprocess.run(cmd, cwd=ns["cwd"], env=ns["env"], capture_output=True, text=True, timeout=1800)
    ns["ran"].append(example.line)
    if done.returncode != 0:
        raise AssertionError(f"{Path(example.path).name}, line {example.line}: exit {done.returncode}\n"
                             f"{example.parsed}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


def run_bash(example) -> None:
    """A bash block, every line as written but ``pip install`` (the environment is installed)."""
    script = re.sub(r"(?m)^\s*pip install .*$", 'python -c "import fedskew"', example.parsed)
    _run(["bash", "-euo", "pipefail", "-c", script], example)


def run_python(example) -> None:
    """A Python block as a script of its own (its ``if __name__ == "__main__":`` block runs)."""
    path = Path(example.namespace["cwd"]) / f"block_line_{example.line}.py"
    path.write_text(example.parsed)
    _run([sys.executable, path.name], example)


SYBIL = Sybil(parsers=[CodeBlockParser("bash", run_bash), CodeBlockParser("python", run_python), SkipParser()])


@pytest.fixture(scope="module")
def fashion(tmp_path_factory) -> Path:
    """A Fashion-MNIST folder in its real format (the four IDX files), small enough that the lite-scale
    commands finish in about a minute: 8,000 training and 1,000 test images with a class pattern (MAP's lite
    preset keeps 20% of the training set for 100 clients: 160 a class)."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 8000), ("t10k", 1000)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 120, size=(n, 28, 28))
        for c in range(10):  # each class brightens its own band of rows
            images[labels == c, 2 * c + 4:2 * c + 8, :] += 120
        (root / "fmnist").mkdir(exist_ok=True)
        write_idx(root / "fmnist" / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / "fmnist" / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return root


def run_document(path: Path, folder: Path, data: Path) -> dict:
    for name in ("examples", "docs"):  # what a clone has beside the commands
        if not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name, target_is_directory=True)
    env = {**os.environ, "FEDSKEW_DATA": str(data), "OMP_NUM_THREADS": "1", "COLUMNS": "120",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}"}
    env.pop("PYTHONPATH", None)
    document = SYBIL.parse(path)
    document.namespace.update(cwd=str(folder), env=env, ran=[], skipped=[],
                              CUDA=torch.cuda.is_available())
    for example in document.examples():
        try:
            example.evaluate()
        except unittest.SkipTest as why:  # a block that cannot run here, and why
            document.namespace["skipped"].append((example.line, str(why)))
    return document.namespace


# Documents that run in one folder, in order: the first sweep's tutorial goes on where the README's two commands
# left off (its `fedskew sweep` finds the README's runs finished, as a second `fedskew sweep` does)
CHAINS = [[ROOT / "README.md", ROOT / "docs/tutorials/first-sweep.md"],
          *([p] for p in DOCUMENTS if p.name not in ("README.md", "first-sweep.md"))]


def _has_slow(chain: list[Path]) -> bool:
    return any(SLOW_MARK in p.read_text() for p in chain)


def _chain_id(chain: list[Path]) -> str:
    return "+".join(str(p.relative_to(ROOT)) for p in chain)


@pytest.mark.parametrize("chain", [pytest.param(c, marks=[pytest.mark.slow] if _has_slow(c) else [], id=_chain_id(c))
                                   for c in CHAINS])
def test_the_blocks_run_as_written(chain, tmp_path, fashion):
    """Every block of the documents (the ones under ``<!-- slow -->`` make the test a slow one)."""
    for path in chain:
        ns = run_document(path, tmp_path, fashion)
        assert ns["ran"] or ns["skipped"], f"{path.name}: no block found"
        for line, why in ns["skipped"]:  # every block left out says why
            assert why.strip(), f"{path.name}, line {line}: a skip without a reason"


def test_the_readme_python_snippet_is_run_by_this_module():
    """The snippet a newcomer copies first (the README's "From Python") is a block this module runs,
    on the bundled data: no data set a fresh machine lacks."""
    blocks = [e for e in SYBIL.parse(ROOT / "README.md").examples() if "fedskew.run(" in e.parsed]
    assert len(blocks) == 1 and "fmnist" not in blocks[0].parsed and "DATA" not in blocks[0].parsed
