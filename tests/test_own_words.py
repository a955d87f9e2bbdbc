"""The project speaks of itself, to its users: no word of how its developers work (their sessions,
the GPU time they are lent by a draw, its windows) and no path that exists only on their machines,
anywhere a user reads: README, CONTRIBUTING, CHANGELOG, docs/ (raw command logs aside), and the
docstrings, help texts and messages of the package, the benchmark scripts and the examples."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = {
    "session": re.compile(r"(?<!own )(?<!interactive )(?<!new )\bsessions?\b", re.I),  # (not a process's)
    "lent": re.compile(r"\b(?:lent|lends?|lending)\b", re.I),
    "draw (of GPU time)": re.compile(r"\b(?:by chance|a draw|the draw|one draw)\b", re.I),
    "window (of GPU time)": re.compile(r"\bwindows?\b(?!\.\w)", re.I),  # (not a page's window.addEventListener)
    "a developers' path": re.compile(r"\.\./shared\b|/work/(?:shared|main)\b|\.\./\.library"),
}
# names of files and folders that hold the word and are not prose: the scripts, their record and logs
NAMES = re.compile(r"[\w./-]*(?:gpu_window|gpu-window|fedskew-window|window\.json|-window-)[\w./*-]*")


def user_text() -> list[tuple[str, int, str]]:
    """(file, line, text) of everything a user reads."""
    out = []
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
             *[p for p in sorted((ROOT / "docs").rglob("*.md")) if not {"gpu-runs", "generated", "_build"} &
               set(p.relative_to(ROOT / "docs").parts)]]
    for page in pages:
        out += [(page.relative_to(ROOT).as_posix(), i, line) for i, line in enumerate(page.read_text().splitlines(), 1)]
    code = [*sorted((ROOT / "src" / "fedskew").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
            *sorted((ROOT / "examples").glob("*.py"))]
    for path in code:
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.STRING and not re.fullmatch(r"[rbfu]*(['\"])\w*\1", tok.string, re.I):
                for j, line in enumerate(tok.string.splitlines()):
                    out.append((path.relative_to(ROOT).as_posix(), tok.start[0] + j, line))
    return out


def test_no_word_of_how_the_developers_work_where_a_user_reads():
    found = []
    for where, line_no, line in user_text():
        text = NAMES.sub("", line)
        found += [f"{where}:{line_no}: {name}: {line.strip()[:120]}" for name, pat in WORDS.items() if pat.search(text)]
    assert not found, f"{len(found)} lines:\n" + "\n".join(found)


def test_the_check_sees_what_it_should():
    assert WORDS["window (of GPU time)"].search("the next window runs it")
    assert not WORDS["window (of GPU time)"].search(NAMES.sub("", "python benchmarks/gpu_window.py writes window.json"))
    assert WORDS["a developers' path"].search('default="../shared/data"')
    assert WORDS["lent"].search("whenever a GPU is lent")
    assert not WORDS["draw (of GPU time)"].search("each sample draws its own noise")
