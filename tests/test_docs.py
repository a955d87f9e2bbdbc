"""The docs say what the code does: docs/methods.md's option defaults come from the Options classes."""

import re
from pathlib import Path

import pytest

from fedskew.algorithms import COMPONENTS, METHODS, options_reference

ROOT = Path(__file__).resolve().parents[1]
METHODS_MD = (ROOT / "docs/methods.md").read_text()


def test_options_reference_is_generated_from_the_code():
    begin, end = "<!-- options-reference: begin -->\n", "<!-- options-reference: end -->"
    section = METHODS_MD[METHODS_MD.index(begin) + len(begin):METHODS_MD.index(end)]
    assert section == options_reference(), "docs/methods.md is stale: regenerate it with `fedskew methods --markdown`"


def _same(printed: str, default) -> bool:
    printed = re.split(r"[:\s/]", printed.strip())[0].strip("`")  # `code`: the ..., `a`/`b`, 1: the classifier
    if default is None:
        return printed.lower() == "none"
    if isinstance(default, bool):
        return printed.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(printed) == float(default)
        except ValueError:
            return False
    return printed == str(default)


def prose_defaults() -> list[tuple[str, str, str]]:
    """(method, option, printed default) of every ``| `method` | `option` (default ...`` cell in the
    hand-written tables of docs/methods.md (the generated section excluded)."""
    text = METHODS_MD[:METHODS_MD.index("## Options reference")]
    found = []
    for row in text.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not re.fullmatch(r"`[a-z_0-9]+`", cells[0]):
            continue
        name = cells[0].strip("`")
        if name not in METHODS:
            continue
        for option, value in re.findall(r"`([a-zA-Z_0-9]+)` \(([^,;)]+)", cells[1]):
            found.append((name, option, value))
    return found


def test_every_default_printed_in_the_method_tables_is_the_code_default():
    rows = prose_defaults()
    assert len(rows) > 40  # the tables were read
    wrong = []
    for name, option, printed in rows:
        fields = METHODS[name].Options.model_fields
        if option not in fields:
            wrong.append(f"{name}: '{option}' is not an option")
            continue
        default = fields[option].get_default(call_default_factory=True)
        if not _same(printed, default):
            wrong.append(f"{name}.{option}: docs say {printed.strip()}, code {default!r}")
    assert not wrong, wrong


def test_component_options_have_one_name_wherever_attached():
    """A named method built from a component takes the component's options under the component's
    names (issue 30: rs_form vs form, proto_share_fraction vs share_fraction)."""
    from fedskew.algorithms.compose import Composed

    for name, cls in METHODS.items():
        if not (isinstance(cls, type) and issubclass(cls, Composed)):
            continue
        method = cls()
        for comp in method.components:
            schema = type(comp.opt)
            shared = set(schema.model_fields) & set(cls.Options.model_fields)
            for option in shared:
                assert getattr(comp.opt, option) == getattr(method.opt, option), (name, option)
    assert set(COMPONENTS["rs"].Options.model_fields) <= set(METHODS["map"].Options.model_fields)
    assert set(COMPONENTS["prototypes"].Options.model_fields) <= set(METHODS["fedmr"].Options.model_fields)


def test_the_registry_holds_classes_only():
    from fedskew.algorithms.base import Method

    assert all(isinstance(cls, type) and issubclass(cls, Method) for cls in METHODS.values())


def test_every_option_of_every_method_and_component_says_what_it_means():
    missing = [f"{name}.{key}" for name, cls in {**METHODS, **COMPONENTS}.items()
               for key, field in cls.Options.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"options without a meaning: {missing}"


@pytest.mark.slow  # starts processes or runs sweeps: left out of the fast subset
def test_every_method_and_component_names_its_source_in_plain_text():
    """Issue 44: every registered method and component carries its own Source (paper, venue,
    year, official code, equations), `fedskew methods NAME` prints it, and no page shows Sphinx
    roles or a developer's sentence to users."""
    import subprocess
    import sys

    from fedskew.algorithms import BUILTIN, plain_text

    missing = [
        n
        for n, c in {**{k: METHODS[k] for k in BUILTIN}, **{f"component {k}": v for k, v in COMPONENTS.items()}}.items()
        if "source" not in c.__dict__ or c.source is None
    ]
    assert not missing, f"no Source: {missing}"
    for cls in [*(METHODS[k] for k in BUILTIN), *COMPONENTS.values()]:
        s = cls.source
        assert s.authors and s.title and s.venue and s.implements and s.code, cls
        assert s.arxiv is None or re.fullmatch(r"\d{4}\.\d{4,5}(, \d{4}\.\d{4,5})*", s.arxiv), s.arxiv
    assert (
        plain_text("see :class:`~fedskew.algorithms.components.Discrepancy` and ``x``") == "see `Discrepancy` and `x`"
    )
    for name in ("fedavg", "feddisco", "fedproc", "map", "rs"):
        out = subprocess.run([sys.executable, "-m", "fedskew.cli", "methods", name], capture_output=True, text=True,
                             timeout=120, env={**__import__("os").environ, "COLUMNS": "200"}).stdout
        assert "Paper: " in out and ":class:" not in out and ":func:" not in out, out[:500]
        assert "Subclasses override" not in out


# ---------------------------------------------------------------------------------------------
# Issue 44: every fact the leaderboard prose states agrees with the generated tables it cites

ORDINALS = {w: i + 1 for i, w in enumerate("first second third fourth fifth sixth seventh eighth ninth tenth "
                                           "eleventh twelfth".split())}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "", name.lower())


def section_kind(heading: str) -> str:
    """What a generated board's section scores, from its title: 'unseen', 'personalised' or 'global'."""
    return "unseen" if "held-out clients" in heading else "personalised" if "personalised" in heading else "global"


def md_tables(text: str) -> list[dict]:
    """Every methods x settings table of a generated leaderboard (header 'method', ..., 'avg rank'):
    its kind ('global' or 'personalised', from the lines above it) and per method its cells (mean,
    std, rank per setting) and average rank."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not (line.startswith("| method |") and "avg rank" in line):
            continue
        header = [c.strip() for c in line.strip("|").split("|")]
        above = " ".join(lines[max(0, i - 6):i]).lower()
        heading = next((h.lower() for h in reversed(lines[:i]) if h.startswith("## ")), "")
        if heading:  # a generated board: its section's title names what it scores
            kind = section_kind(heading)
        else:
            kind = "personalised" if "personalised" in above.split("global")[-1] else "global"
        rows = {}
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip().strip("*") for c in row.strip("|").split("|")]
            m = {"cells": {}, "avg": None}
            for setting, cell in zip(header[1:-2], cells[1:-2]):
                got = re.match(r"([\d.]+)(?: \+- ([\d.]+))? \(#([\d.]+)\)", cell)
                if got:
                    m["cells"][setting] = tuple(float(g) if g else None for g in got.groups())
            m["avg"] = float(cells[-2]) if re.fullmatch(r"[\d.]+", cells[-2]) else None
            rows[_key(cells[0])] = m
        out.append({"kind": kind, "settings": header[1:-2], "rows": rows})
    # the published cells beside ours: ours (mean, std), the published value and spread, the delta
    published = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and line.startswith("| ") and re.match(r"[\d.]+ \+- [\d.]+|not run", cells[1]):
            nums = [float(x) for c in cells[1:6] for x in re.findall(r"-?\d+\.\d+", c)]
            published.setdefault(_key(cells[0]), []).extend(abs(x) for x in nums)
    if published:
        out.append({"kind": "published", "settings": [], "rows": {
            k: {"cells": {"published": tuple(v)}, "avg": None} for k, v in published.items()}})
    return out


def position(table: dict, method: str) -> int | None:
    """1 + the number of methods whose average rank is strictly better."""
    avg = table["rows"][method]["avg"]
    if avg is None:
        return None
    return 1 + sum(1 for r in table["rows"].values() if r["avg"] is not None and r["avg"] < avg)


def _matches(value: str, x: float | None) -> bool:
    return x is not None and abs(float(value) - x) <= 0.5 * 10 ** -len(value.split(".")[1]) + 1e-9


def prose_problems(prose: str, tables: list[dict]) -> list[str]:
    """Claims of the prose (split into clauses at ';' and sentence ends) that its tables contradict.
    A claim belongs to the method named last before it in the clause (else the first after it): a
    decimal number that is none of that method's means, stds or average ranks; an ordinal ('first',
    'tenth', '12th') that is not the method's rank in the setting it names right after ('first
    under Dir0.5'), or without one its place by average rank. Numbers in code spans (option values,
    commands) and after 'p <' are not claims; write a claim's method in the same clause."""
    names = {k for t in tables for k in t["rows"]}
    settings = sorted({s for t in tables for s in t["settings"]}, key=len, reverse=True)
    problems = []
    # a method whose name is an English word (local, map) is a claim's method only in a code span
    words = {"local", "map"}
    text = re.sub(r"`[^`]*`", lambda m: (m.group(0).strip("`") + ("method" if m.group(0).strip("`") in words else ""))
                  if _key(m.group(0)) in names else "", prose)
    text = re.sub(r"\s+", " ", re.sub(r"\n\|.*", "", text))
    text = re.sub(r"\b(Dir)\((\d+(?:\.\d+)?)\)", r"\1\2", text)  # Dir(0.5) as the tables write it: Dir0.5
    tables = [{**t, "rows": {(n + "method" if n in words else n): r for n, r in t["rows"].items()}} for t in tables]
    names = {(n + "method" if n in words else n) for n in names}
    for clause in re.split(r";|\. (?=[A-Z*(])", text):
        keyed = _key_text(clause)
        spots = sorted((m.start(), n) for n in names for m in re.finditer(rf"(?<![\w-]){n}(?![\w-])", keyed))
        if not spots:
            continue
        tabs = [t for t in tables if t["kind"] in clause.lower()] or tables
        tabs += [t for t in tables if t["kind"] == "published" and t not in tabs]
        plain = clause.replace("(", "").replace(")", "")

        def owner(at: int, spots=spots) -> str:
            before = [n for pos, n in spots if pos <= at]
            return before[-1] if before else spots[0][1]

        def setting_after(at: int, plain=plain) -> str | None:
            """The setting an ordinal names right after it ('first under Dir0.5')."""
            m = re.match(r"\S+ (?:under|in) (\S+)", plain[at:])
            return next((s for s in settings if m and m.group(1).rstrip(",.:*") == _setting_text(s)), None)

        unit = r"\s?(?:s\b|M\b|h\b|%|x\b|points?\b)"  # a time, size, share or difference (also of a range a-b)
        for m in re.finditer(rf"(?<![\w.=/<])(\d+\.\d+)(?![\d.]*{unit})(?!-\d+(?:\.\d+)?{unit})", clause):
            value, at = m.group(1), m.start()
            if re.search(r"(p <|lr|alpha|sigma|lam|mu|beta|std|tau|=|Section)\s*$", clause[:at][-8:]):
                continue
            method = owner(len(_key_text(clause[:at])))
            ok = any(_matches(value, x) for t in tabs if method in t["rows"]
                     for c in [*t["rows"][method]["cells"].values(), (t["rows"][method]["avg"],)] for x in c)
            if not ok:
                problems.append(f"{value} for {method}: {clause.strip()[:160]}")
        for m in re.finditer(
            r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
            r"twelfth|\d+(?:st|nd|rd|th)) (?!(?:round|seed|trial|grid|rounds|day|session|table|in the other|"
            r"in \w+ settings))",
            clause,
        ):
            word, at = m.group(1), m.start()
            want = ORDINALS.get(word) or int(re.match(r"\d+", word).group())
            method = owner(len(_key_text(clause[:at])))
            setting = setting_after(len(clause[:at].replace("(", "").replace(")", "")))
            if setting:
                ok = any(method in t["rows"] and setting in t["rows"][method]["cells"] and
                         t["rows"][method]["cells"][setting][2] == want for t in tabs)
            else:
                ok = any(method in t["rows"] and position(t, method) == want for t in tabs)
            if not ok:
                problems.append(
                    f"'{word}' for {method}{' under ' + setting if setting else ''}: {clause.strip()[:160]}"
                )
    return problems


def _key_text(clause: str) -> str:
    """A clause with method names written as their registry names (FedETF -> fedetf, Per-FedAvg -> perfedavg)."""
    return re.sub(r"[A-Za-z][\w-]*", lambda m: _key(m.group(0)), clause)


def _setting_text(setting: str) -> str:
    return setting.replace("(", "").replace(")", "")


def test_the_prose_checker_catches_a_wrong_rank_and_a_wrong_number():
    table = md_tables("global accuracy\n\n| method | S1 | S2 | avg rank | W/T/L vs fedavg |\n|---|---|---|---|---|\n"
                      "| fedx | 70.00 +- 1.00 (#1) | 60.00 +- 1.00 (#2) | 1.50 | 1/1/0 |\n"
                      "| fedavg | 50.00 +- 2.00 (#2) | 61.00 +- 1.00 (#1) | 1.50 | - |\n")
    assert prose_problems("FedX is first under S1 (70.0).", table) == []
    assert len(prose_problems("FedX is second under S1 (70.0).", table)) == 1
    assert len(prose_problems("FedX reaches 71.3 under S1.", table)) == 1
    assert prose_problems("FedAvg's average rank is 1.50.", table) == []


def test_the_leaderboard_prose_agrees_with_the_tables_it_cites():
    """README cites the generated leaderboards between `<!-- NAME: begin -->` and `<!-- NAME: end -->`
    (docs/leaderboard.md is generated whole); every number, rank or position its prose gives a
    method there must be the one docs/leaderboards/NAME.md shows."""
    from fedskew.experiments.published import load

    registry = {}  # a published number of the registry, cited beside its method
    for e in load():
        registry.setdefault(_key(e.method), []).extend(v for v in (e.value, e.spread) if v is not None)
    registry_table = {"kind": "published", "settings": [],
                      "rows": {k: {"cells": {"registry": tuple(v)}, "avg": None} for k, v in registry.items()}}
    doc = (ROOT / "README.md").read_text()
    problems = []
    assert re.search(r"<!-- ([\w-]+): begin -->", doc)
    for name, body in re.findall(r"<!-- ([\w-]+): begin -->(.*?)<!-- \1: end -->", doc, re.S):
        tables = md_tables((ROOT / "docs/leaderboards" / f"{name}.md").read_text())
        assert tables, name
        tables.append(registry_table)
        problems += [f"{name}: {p}" for p in prose_problems(body, tables)]
    assert not problems, "\n".join(problems)


COUNT_WORDS = {"no": 0, "none": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
               "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def board_counts(board: str) -> dict[str, tuple[int, int]]:
    """Per table kind of a generated board (its section titles, as :func:`md_tables` reads them):
    the generated summary's counts of methods with a significant win, and a loss, against the
    baseline."""
    counts = {}
    for section in re.split(r"\n(?=## )", board):
        heading = section.splitlines()[0].lower()
        got = re.search(r"Significant wins against \w+, (\d+) methods? .*?significant losses, (\d+) method", section)
        if got:
            counts.setdefault(section_kind(heading), (int(got.group(1)), int(got.group(2))))
    return counts


def count_problems(prose: str, counts: dict[str, tuple[int, int]]) -> list[str]:
    """Issue 55: a count of methods that win (or lose) significantly against the baseline, in a
    sentence of the prose ('39 of the other 73 methods win significantly against it', '36 lose',
    'no method wins significantly ... and nine lose'), must be the generated summary's count of the
    table its sentence names ('personalised', 'unseen'; else the global one)."""
    problems = []
    number = r"(\d+|" + "|".join(COUNT_WORDS) + r")"
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z*])", re.sub(r"\s+", " ", prose)):
        low = sentence.lower()
        if "win" not in low or "significant" not in low:
            continue
        kind = "unseen" if "unseen" in low else "personalised" if "personalised" in low else "global"
        if kind not in counts:
            continue
        for which, pattern in ((0, rf"\b{number} (?:of the other \d+ )?methods? wins? significantly"),
                               (1, rf"\b{number} (?:methods? )?lose")):
            for m in re.finditer(pattern, low):
                said = int(m.group(1)) if m.group(1).isdigit() else COUNT_WORDS[m.group(1)]
                if said != counts[kind][which]:
                    problems.append(f"{said} {'win' if which == 0 else 'lose'} ({kind}; the summary says "
                                    f"{counts[kind][which]}): {sentence[:160]}")
    return problems


def test_the_count_check_catches_a_wrong_count():
    board = ("## x: global accuracy\n\nSummary (generated): Significant wins against fedavg, 2 methods (settings): "
             "a (1), b (2); significant losses, 1 method: c (1).\n\n## x: personalised accuracy\n\nSummary "
             "(generated): Significant wins against fedavg, 0 methods (settings): none; significant losses, 3 "
             "methods: a (1), b (1), c (1).\n")
    counts = board_counts(board)
    assert counts == {"global": (2, 1), "personalised": (0, 3)}
    assert count_problems("Two of the other 9 methods win significantly against it, one loses.", counts) == []
    assert count_problems("No method wins significantly against the personalised FedAvg, and three lose.",
                          counts) == []
    assert len(count_problems("3 methods win significantly against FedAvg, 1 loses.", counts)) == 1
    assert len(count_problems("In the personalised table 0 methods win significantly, 2 lose.", counts)) == 1


def test_the_leaderboard_prose_counts_wins_and_losses_as_the_boards_summaries_do():
    doc = (ROOT / "README.md").read_text()
    problems, checked = [], 0
    for name, body in re.findall(r"<!-- ([\w-]+): begin -->(.*?)<!-- \1: end -->", doc, re.S):
        counts = board_counts((ROOT / "docs/leaderboards" / f"{name}.md").read_text())
        problems += [f"{name}: {p}" for p in count_problems(body, counts)]
        checked += bool(counts)
    assert checked and not problems, "\n".join(problems)


def test_the_readme_counts_the_registry():
    readme = (ROOT / "README.md").read_text()
    counts = re.findall(r"any of the (\d+) names `fedskew methods` lists", readme)
    assert counts and {int(c) for c in counts} == {len(METHODS)}, (counts, len(METHODS))


def fedskew_names() -> dict:
    """Every fedskew module by its short name and full name, and every class and function defined
    in one by name (a module that cannot import here, Flower's without flwr, is left out)."""
    import importlib
    import pkgutil

    import fedskew

    names: dict = {}
    for info in pkgutil.walk_packages(fedskew.__path__, "fedskew."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        names[info.name] = names.setdefault(info.name.rsplit(".", 1)[1], module)
        for key, value in vars(module).items():
            if getattr(value, "__module__", None) == info.name:
                names.setdefault(key, value)
    return names


def test_design_cites_files_modules_and_hooks_that_exist():
    """docs/design.md's file names, dotted names (``lanes.signature``, ``LaneExecutor.train_requests``,
    ``fedskew.experiments.pool.pack_key``) and the hooks of its method-interface table name what
    the code has (issue 46 found 7 of 12 claims stale)."""
    from fedskew.algorithms.base import Method

    text = (ROOT / "docs/design.md").read_text()
    files = {p.name for d in ("src", "benchmarks", "tests", "examples") for p in (ROOT / d).rglob("*.py")}
    problems = [f"file {f}" for f in sorted(set(re.findall(r"([A-Za-z_0-9]+\.py)\b", text))) if f not in files]
    names = fedskew_names()
    for dotted in sorted(
        set(re.findall(r"`((?:fedskew\.)?[A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)+)`", text))
    ):
        head, *rest = dotted.split(".")
        if dotted.endswith((".py", ".md", ".json", ".jsonl", ".yaml", ".pt")) or head not in names:
            continue  # a file, or torch's, a config key, an argument
        if head == "fedskew":
            head, rest = next((".".join(dotted.split(".")[:i]), dotted.split(".")[i:])
                              for i in range(dotted.count(".") + 1, 0, -1) if ".".join(dotted.split(".")[:i]) in names)
        obj = names[head]
        for part in rest:  # (a field of a dataclass or a pydantic model: in its annotations)
            obj = getattr(obj, part, None) if part not in getattr(obj, "__annotations__", {}) else part
        if obj is None:
            problems.append(f"name {dotted}")
    table = text[text.index("| function | signature | FedAvg |"):].split("\n\n")[0]
    for row in table.splitlines()[2:]:
        for hook in re.findall(r"`([a-z_]+)`", row.split("|")[1]):
            if not hasattr(Method, hook):
                problems.append(f"hook {hook}")
    assert not problems, problems


# Sources whose paper has no arXiv version (checked by hand, issue 54): each with what was looked for
NO_ARXIV = {
    "fedrs": "KDD 2021 (ACM DL only)", "rs": "FedRS's component",
    "fedphp": "ECML PKDD 2021 (Springer only)", "hpm": "FedPHP's component",
    "map": "IEEE TKDE 2024 (the text in ../shared/papers)", "dittors": "MAP's Table II baseline",
    "fedmmd": "IEEE VCIP 2018", "fedas": "CVPR 2024 (CVF open access only)", "local": "no paper",
}


def test_every_source_with_an_arxiv_paper_names_its_id():
    """An arXiv id of the form YYMM.NNNNN (several comma-separated for a Source of two papers) on
    every method and component, except the papers listed in NO_ARXIV (issue 54 found ten Sources
    without the id their paper has)."""
    missing, malformed = [], []
    for name, cls in sorted({**METHODS, **COMPONENTS}.items()):
        src = cls.source
        if src.arxiv is None:
            if name not in NO_ARXIV:
                missing.append(name)
        elif not re.fullmatch(r"\d{4}\.\d{4,5}(, \d{4}\.\d{4,5})*", src.arxiv):
            malformed.append(f"{name}: {src.arxiv}")
        elif name in NO_ARXIV:
            malformed.append(f"{name} has an id but is listed in NO_ARXIV")
    assert not missing, f"Sources without an arXiv id (add it, or list the paper in NO_ARXIV): {missing}"
    assert not malformed, malformed


def test_the_published_entries_no_preset_runs_are_listed_as_the_code_counts_them():
    """Issue 54, item 9: `bench --list` printed every entry of a suite's papers as if it were linked;
    docs/reproductions.md lists the 105 that no suite at any scale sits beside, from the code."""
    from fedskew.experiments.bench import linked_entries, listing, unlinked_table

    text = (ROOT / "docs/reproductions.md").read_text()
    begin, end = "<!-- generated unlinked-entries begin -->\n", "<!-- generated unlinked-entries end -->"
    assert text[text.index(begin) + len(begin):text.index(end)] == unlinked_table()
    rows = {(r["suite"], r["scale"]): r for r in listing()}
    assert [rows["seed-papers", s]["linked"] for s in ("smoke", "lite", "paper")] == [19, 44, 73]
    assert [rows["niid-bench", s]["linked"] for s in ("smoke", "lite", "paper")] == [20, 20, 47]
    assert rows["seed-papers", "lite"]["published"] == "44 of 173"
    assert len(linked_entries("seed-papers", "lite")) == 44


def test_the_readme_s_suite_run_counts_are_the_code_s():
    """Issue 54, item 10: README and docs/leaderboard.md said 1,800 and 3,600 label-skew runs when the
    code planned 2,590 and 5,180; the counts they print now are `bench.listing()`'s."""
    from fedskew.experiments.bench import listing

    rows = {(r["suite"], r["scale"]): r["runs"] for r in listing()}
    readme = (ROOT / "README.md").read_text()
    assert f"--jobs 2   # {rows['label-skew', 'lite']:,} runs;" in readme


def inline_table(text: str) -> dict:
    """The hand-made tables of a piece of prose (rows '| Method | ... |'): every decimal number in a
    method's row is one of its values (the check of a claim outside the generated boards' sections)."""
    rows: dict = {}
    for line in text.splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 1:
            nums = tuple(abs(float(x)) for c in cells[1:] for x in re.findall(r"-?\d+\.\d+", c))
            rows.setdefault(_key(cells[0]), {"cells": {}, "avg": None})["cells"][len(rows)] = nums
    return {"kind": "published", "settings": [], "rows": rows}


def claims_outside_the_boards(text: str, boards: list[dict]) -> list[str]:
    """Issue 55: prose outside a board's markers (the rest of docs/leaderboard.md, README's claims)
    is checked too, section by section (`## ` headings): a number or place it gives a method must be
    one of that method's in a generated board, the registry or a table of the same section."""
    problems = []
    for section in re.split(r"\n(?=## )", text):
        tables = [*boards, inline_table(section)]
        problems += prose_problems(section, tables)
    return problems


def board_tables() -> list[dict]:
    from fedskew.experiments.published import load

    registry = {}  # a published number of the registry, cited beside its method
    for e in load():
        registry.setdefault(_key(e.method), []).extend(v for v in (e.value, e.spread) if v is not None)
    boards = [*sorted((ROOT / "docs/leaderboards").glob("*.md")),
              *sorted((ROOT / "docs/gpu-campaign").glob("*/leaderboard.md"))]  # (the GPU campaign's boards)
    tables = [t for path in boards for t in md_tables(path.read_text())]
    return [*tables, {"kind": "published", "settings": [],
                      "rows": {k: {"cells": {"registry": tuple(v)}, "avg": None} for k, v in registry.items()}}]


def test_claims_outside_the_boards_sections_agree_with_some_table():
    """The whole of docs/leaderboard.md, and README's leaderboard claims: an audit found 7 of 9 false
    statements outside the markers the check read before (issue 55)."""
    doc = (ROOT / "docs/leaderboard.md").read_text()
    outside = re.sub(r"<!-- ([\w-]+): begin -->.*?<!-- \1: end -->", "", doc, flags=re.S)
    problems = [f"docs/leaderboard.md: {p}" for p in claims_outside_the_boards(outside, board_tables())]
    readme = (ROOT / "README.md").read_text()
    for name, body in re.findall(r"<!-- ([\w-]+): begin -->(.*?)<!-- \1: end -->", readme, re.S):
        tables = md_tables((ROOT / "docs/leaderboards" / f"{name}.md").read_text())
        problems += [f"README.md ({name}): {p}" for p in prose_problems(body, tables)]
    assert not problems, "\n".join(problems)


def test_the_whole_file_check_catches_a_claim_outside_the_markers():
    boards = md_tables("global accuracy\n\n| method | S1 | S2 | avg rank | W/T/L vs fedavg |\n|---|---|---|---|---|\n"
                       "| fedx | 70.00 +- 1.00 (#1) | 60.00 +- 1.00 (#2) | 1.50 | 1/1/0 |\n"
                       "| fedavg | 50.00 +- 2.00 (#2) | 61.00 +- 1.00 (#1) | 1.50 | - |\n")
    text = "## A\n\nFedX reaches 70.0 under S1.\n\n## B\n\n| FedAvg | 33.50 |\n\nFedAvg gives 33.5 here; FedX 71.2.\n"
    problems = claims_outside_the_boards(text, boards)
    assert len(problems) == 1 and "71.2 for fedx" in problems[0]


def _generator():
    """docs/_ext/fedskew_docs.py, the generator of the site's reference pages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fedskew_docs", ROOT / "docs/_ext/fedskew_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_method_and_config_key_has_its_reference_entry():
    """The reference is generated from the code: every name of ``fedskew.__all__`` has its autodoc
    entry, every registered method its page (options, defaults, paper, the code it was checked
    against), every config key its row."""
    import fedskew
    from fedskew.config import RunConfig

    gen = _generator()
    api = gen.api_page()
    missing = [n for n in fedskew.__all__ if not n.startswith("_") and f"fedskew.{n}\n" not in api]
    pages = gen.method_pages()
    for name, cls in METHODS.items():
        page = pages.get(name, "")
        missing += [f"method {name}"] if not page else []
        missing += [f"method {name}: option {opt}" for opt in cls.Options.model_fields if f"`method.{opt}`" not in page]
        if cls.source is not None and cls.source.code not in page:
            missing.append(f"method {name}: its official code")
    config = gen.config_page()
    for key, field in RunConfig.model_fields.items():
        missing += [] if f"| `{key}` |" in config else [f"config key {key}"]
        sub = field.annotation
        for inner in getattr(sub, "model_fields", {}):
            missing += [] if f"| `{key}.{inner}` |" in config else [f"config key {key}.{inner}"]
    assert not missing, missing
    assert set(pages) == set(METHODS) | {"index"}


ISSUE_NUMBER = re.compile(r"\bissues?(?:[ -]|\s*\n\s*)?#?\d+", re.IGNORECASE)  # (wrapped at a line end too)


def user_texts() -> dict[str, str]:
    """Everything a user reads: README and the other front files, every page of docs/ (the GPU
    windows' raw logs under docs/gpu-runs are records of what ran, kept as they were), the package's
    source (docstrings, error messages, comments alike), and the command line's help."""
    from fedskew.cli import build_parser

    texts = {p.name: (ROOT / p).read_text() for p in (Path("README.md"), Path("CONTRIBUTING.md"),
                                                        Path("CHANGELOG.md"))}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").rglob("*.md")
              if "gpu-runs" not in p.parts and "_build" not in p.parts and "generated" not in p.parts}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "src").rglob("*.py")}
    parser = build_parser()
    texts["fedskew --help"] = parser.format_help()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        texts[f"fedskew {name} --help"] = sub.format_help()
    return texts


def test_no_user_text_cites_the_issue_tracker():
    """A user never meets an issue number: the evidence itself (a measurement, a commit, a command)
    stands where a pointer into the tracker stood."""
    found = [f"{where}: {m.group(0)!r}" for where, text in user_texts().items() for m in ISSUE_NUMBER.finditer(text)]
    assert not found, found


def test_the_issue_check_catches_a_citation():
    assert [m.group(0) for m in ISSUE_NUMBER.finditer("as issue 54 found; see issue #7, the issue-48 board, the "
                                                      "commit of issue\n43's work")] == \
        ["issue 54", "issue #7", "issue-48", "issue\n43"]
    assert not ISSUE_NUMBER.search("FedAvg's issues with label skew, 3 issues")
