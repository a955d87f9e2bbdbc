"""Pages and figures of the documentation site generated from the code and the committed boards.

At every build (``builder-inited``) this writes ``docs/generated/`` (ignored by git):

- ``config.md``: every config key with its type, default and allowed values, from the pydantic schema;
- ``sweep-file.md``: the sweep file's keys, from its schema;
- ``methods/``: one page per registered method (citation, equations, options, communication, code
  it was checked against) and an index grouped by family;
- ``published.md``: the published-results registry; ``suites.md``: the benchmark suites and their cost;
- ``partitions/*.png``: a heatmap of each label-skew partition on the bundled digits;
- ``boards/*.png``: per committed board, a critical-difference diagram of each ranked table
  (Friedman test with a post-hoc test, by autorank) and, where the board has published numbers,
  a published-vs-ours plot.

At ``source-read`` a board page (``leaderboards/*.md`` and the GPU campaign's boards) gets a header
naming its commit, scale, hardware and time, its figures, and a marker that makes its tables
sortable and filterable (``_static/boards.js``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # docs/
GEN = HERE / "generated"
BOARDS = ["leaderboards/label-skew-lite", "leaderboards/seed-papers-lite", "leaderboards/niid-bench-lite",
          "leaderboards/momentum-control-lite", "leaderboards/defaults-check-lite",
          "gpu-campaign/map-part/leaderboard"]


def _write(path: Path, text: str) -> None:
    """Write only what changed, so Sphinx rebuilds only the pages whose source moved."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# -- config keys --------------------------------------------------------------------------------------


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"<class '([^']+)'>", r"\1", text).replace("NoneType", "None")


def config_page() -> str:
    """Every key of a run config: the top-level fields of ``RunConfig``, then each section's."""
    from pydantic import BaseModel

    from fedskew.algorithms import allowed_values
    from fedskew.config import RunConfig

    lines = ["# Config keys", "",
             "Every key a run config takes, generated from the schema (`fedskew.config.RunConfig`) at each build. "
             "Set them in a YAML file, as `key=value` on the command line (dotted for nested keys: "
             "`partition.alpha=0.1`) or as keywords of `fedskew.run`. A bad key or value stops with one sentence "
             "naming it and what is allowed. `fedskew run --print-config` prints a config with every default "
             "resolved.", "",
             "`method`, `dataset`, `partition` and `model` take a name or a mapping with `name` and the options "
             "of that name; a method's options are on its [method page](methods/index.md).", ""]

    def table(model, prefix: str) -> list[str]:
        rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        nested = []
        for key, field in model.model_fields.items():
            default = field.get_default(call_default_factory=True)
            ann = field.annotation
            sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
            if sub is not None:
                nested.append((f"{prefix}{key}", sub))
                shown = "(section)"
            else:
                shown = f"`{default!r}`"
            rows.append(f"| `{prefix}{key}` | `{_cell(_type_name(ann))}` | {_cell(shown)} | "
                        f"{_cell(allowed_values(field))} | {_cell(field.description or '')} |")
        return rows, nested

    rows, nested = table(RunConfig, "")
    lines += ["## Top level", "", *rows, ""]
    seen = set()
    while nested:
        key, model = nested.pop(0)
        if (key, model) in seen:
            continue
        seen.add((key, model))
        rows, more = table(model, f"{key}.")
        lines += [f"## `{key}`", "", (inspect.getdoc(model) or "").split("\n\n")[0].replace("\n", " "), "", *rows, ""]
        nested += more
    lines += _sections_by_name()
    return "\n".join(lines) + "\n"


def _sections_by_name() -> list[str]:
    """The keys each data set, partition and model name reads (from its loader's or builder's
    signature: a key the chosen name does not read is an error)."""
    from fedskew.config import DATASETS, MODEL_NAMES, PARTITIONS, dataset_keys, model_keys, partition_keys

    lines = []
    for section, names, keys in (("dataset", DATASETS, dataset_keys), ("partition", PARTITIONS, partition_keys),
                                 ("model", MODEL_NAMES, model_keys)):
        lines += [f"## `{section}` by name", "",
                  f"The keys each `{section}` name reads besides the ones every name takes (a key the chosen name "
                  "does not read is an error).", "", "| name | its own keys |", "|---|---|"]
        for name in names:
            own = ", ".join(f"`{section}.{k}`" for k in sorted(keys(name))) or "none"
            lines.append(f"| `{name}` | {own} |")
        lines.append("")
    return lines


def sweep_file_page() -> str:
    from pydantic import BaseModel

    from fedskew.experiments.spec import SweepSpec

    lines = ["# Sweep file", "", (inspect.getdoc(SweepSpec) or "").replace("\n", " "), "",
             "Generated from the schema (`fedskew.experiments.spec.SweepSpec`). `fedskew sweep FILE` reads it; "
             "[how-to: sweeps](../howto/sweeps.md) shows a whole file.", ""]
    todo, seen = [("", SweepSpec)], set()
    while todo:
        prefix, model = todo.pop(0)
        if model in seen:
            continue
        seen.add(model)
        title = f"`{prefix.rstrip('.')}` entries" if prefix else "Top level"
        lines += [f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, field in model.model_fields.items():
            ann = field.annotation
            inner = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
            for sub in ([ann] if isinstance(ann, type) and issubclass(ann, BaseModel) else []) + inner:
                todo.append((f"{prefix}{key}.", sub))
            default = "required" if field.is_required() else f"`{field.get_default(call_default_factory=True)!r}`"
            lines.append(f"| `{prefix}{key}` | `{_cell(_type_name(ann))}` | {_cell(default)} | "
                         f"{_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# -- methods ---------------------------------------------------------------------------------------------


def _notes_sections() -> list[tuple[str, str, str]]:
    """(heading, anchor, body) of each section of docs/methods.md, the hand-written method notes."""
    from markdown_it import MarkdownIt
    from mdit_py_plugins.anchors import anchors_plugin

    text = (HERE / "methods.md").read_text()
    md = MarkdownIt().use(anchors_plugin, max_level=4)
    tokens = md.parse(text)
    heads = [(t.map[0], t.attrs.get("id"), tokens[i + 1].content) for i, t in enumerate(tokens)
             if t.type == "heading_open" and t.tag in ("h2", "h3")]
    lines = text.splitlines()
    out = []
    for j, (start, anchor, title) in enumerate(heads):
        end = heads[j + 1][0] if j + 1 < len(heads) else len(lines)
        out.append((title, anchor, "\n".join(lines[start + 1:end])))
    return out


def _communication(body: str) -> list[str]:
    """The rows of a notes section's table that say what travels and what is kept."""
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and re.search(r"down|up|state", cells[0]):
            rows.append(line)
    return rows


def method_pages() -> dict[str, str]:
    from fedskew.algorithms import METHODS, allowed_values, family_of, plain_text, search_space, source_file

    notes = _notes_sections()
    families: dict[str, list[str]] = {}
    pages = {}
    for name, cls in METHODS.items():
        family = family_of(cls)
        families.setdefault(family, []).append(name)
        doc = plain_text(inspect.getdoc(cls) or "")
        first, _, rest = doc.partition("\n\n")
        src = cls.source
        lines = [f"# `{name}`", "", " ".join(first.split()), ""]
        if source_file(cls):
            lines += [f"**Source:** `{source_file(cls)}` (the whole method: options, equations, class).", ""]
        if src is not None:
            arxiv = f", [arXiv {src.arxiv}](https://arxiv.org/abs/{src.arxiv.split(',')[0]})" if src.arxiv else ""
            lines += ["## Paper", "", f"{src.authors}, \"{src.title}\", {src.venue}"
                      f"{' ' + str(src.year) if src.year else ''}{arxiv}.", "",
                      f"**Implements:** {src.implements}.", "",
                      f"**Checked against:** {src.code} (the official code, or what stands in for it, that "
                      f"fedskew's float64 port was compared with).", ""]
        lines += ["## Options", "", f"Set as `method={name} method.OPTION=VALUE`; `fedskew methods {name}` prints "
                  "the same table.", "", "| option | default | allowed | meaning |", "|---|---|---|---|"]
        for opt, field in cls.Options.model_fields.items():
            lines.append(f"| `method.{opt}` | `{_cell(repr(field.get_default(call_default_factory=True)))}` | "
                         f"{_cell(allowed_values(field))} | {_cell(field.description or '')} |")
        space = search_space(cls.Options)
        lines += ["", "`fedskew bench` searches " + ", ".join(
            [f"`{k}` in {v}" for k, v in space.items()] + ["`lr` x {1/3, 1, 3}"]) + ".", ""]
        cited = [(t, a, b) for t, a, b in notes if f"`{name}`" in t]
        comm = [r for _, _, b in cited for r in _communication(b)]
        lines += ["## What it sends and keeps", ""]
        if comm:
            lines += ["| | |", "|---|---|", *dict.fromkeys(comm), ""]
        else:
            lines += ["As FedAvg: the model down and up, nothing kept between rounds beyond what the notes say.", ""]
        if rest.strip():
            lines += ["## How it works", "", *[" ".join(p.split()) + "\n" for p in rest.split("\n\n")]]
        if cited:
            lines += ["## Notes", "", "Details, choices and measurements: " + "; ".join(
                f"[{t.replace('`', '')}](../../methods.md#{a})" for t, a, _ in cited) + ".", ""]
        pages[name] = "\n".join(lines) + "\n"
    index = ["# Methods", "", f"The {len(METHODS)} registered methods, grouped by family; each is "
             "one module, `fedskew.algorithms.methods.<name>` (FedAvg: `fedskew.algorithms.base`). "
             "Every page is generated from the method's class: its paper, the "
             "equations it implements, its options with their defaults, and the official code its float64 port "
             "was checked against. `fedskew methods` prints the same list.", ""]
    for family, names in families.items():
        index += [f"## {family}", "", "| method | what it is |", "|---|---|"]
        for name in names:
            text = " ".join(plain_text((inspect.getdoc(METHODS[name]) or "").split("\n\n")[0]).split())
            index.append(f"| [`{name}`]({name}.md) | {_cell(text[:200] + ('...' if len(text) > 200 else ''))} |")
        index.append("")
    index += ["```{toctree}", ":hidden:", "", *METHODS, "```", ""]
    pages["index"] = "\n".join(index)
    return pages


# -- published registry and suites -------------------------------------------------------------------------


def published_page() -> str:
    from fedskew.experiments.published import load

    entries = load()
    lines = ["# Published results", "",
             f"The registry holds {len(entries)} published values, each with its paper, table, row and column, "
             "read from `src/fedskew/experiments/published/*.yaml` and generated here at each build. A benchmark "
             "suite puts our value beside every entry whose setting its runs match "
             "([suites](suites.md)).", ""]
    by_file: dict[str, list] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for file, group in by_file.items():
        src = group[0].source
        lines += [f"## {src.table}: {file}", "", f"{src.paper}; {src.venue}. Metric: `{group[0].metric.key}`, "
                  f"{group[0].metric.meaning}.", "", "| setting | row | column | method | value | spread |",
                  "|---|---|---|---|---|---|"]
        for e in group:
            lines.append(f"| {_cell(e.setting_id)} | {_cell(e.row)} | {_cell(e.column)} | `{e.method}` | "
                         f"{e.value} | {'' if e.spread is None else e.spread} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def suites_page() -> str:
    from fedskew.experiments.bench import listing

    lines = ["# Benchmark suites", "",
             "What `fedskew bench --list` prints, generated at each build: every suite at every scale, its runs, "
             "how many published entries it sits beside, and the time measured on the committed boards' runs.",
             "", "| suite | scale | what | runs | published entries beside | time |", "|---|---|---|---|---|---|"]
    for r in listing():
        lines.append(f"| `{r['suite']}` | `{r['scale']}` | {_cell(r['about'])} | {r['runs']:,} | "
                     f"{_cell(r['published'])} | {_cell(r['time'])} |")
    return "\n".join(lines) + "\n"


# -- partitions -------------------------------------------------------------------------------------------

PARTITIONS = {
    "iid": [],
    "pcdd": ["partition.classes_per_client=2"],
    "label_k": ["partition.classes_per_client=2"],
    "dirichlet": ["partition.alpha=0.1"],
    "exdir": ["partition.classes_per_client=3", "partition.alpha=0.5"],
    "inner_dirichlet": ["partition.alpha=0.5"],
    "random_classes": [],
    "label_count": ["partition.classes_per_client=2", "partition.samples_per_class=20"],
    "shards": ["partition.shards_per_client=2"],
}


def partition_figures() -> None:
    from fedskew.config import load_config
    from fedskew.data import load_federation
    from fedskew.engine.durable import save_png

    for name, extra in PARTITIONS.items():
        out = GEN / "partitions" / f"{name}.png"
        if out.exists():
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        cfg = load_config(None, [f"partition={name}", "partition.num_clients=20", *extra])
        save_png(load_federation(cfg).heatmap(), out, dpi=80)


# -- boards -----------------------------------------------------------------------------------------------


def board_tables(text: str) -> list[dict]:
    """Each ranked table of a board (its section title, settings and per-method means) and each
    published table (method, ours, published), read by :func:`fedskew.experiments.bench.written_sections`."""
    from fedskew.experiments.bench import board_tables as ranked_tables
    from fedskew.experiments.bench import column_means, written_sections

    out = []
    for title, (head, rows) in ranked_tables(text).items():
        settings = head[1:head.index("avg rank")]
        columns = [column_means(rows, 1 + j) for j in range(len(settings))]
        out.append({"kind": "ranked", "title": title, "settings": settings,
                    "means": {row[0]: [c.get(row[0]) for c in columns] for row in rows}})
    for title, _, cells in written_sections(text):
        if len(cells) < 3 or cells[0][:2] != ["method", "ours"] or "published" not in cells[0]:
            continue
        p, s = cells[0].index("published"), cells[0].index("seeds")
        points = []
        for row in cells[1:]:
            ours = re.match(r"(-?\d+\.\d+) \+- (\d+\.\d+)", row[1])
            pub = re.match(r"(-?\d+\.\d+)", row[p])
            if ours and pub:
                points.append((row[0], float(ours.group(1)), float(ours.group(2)), float(pub.group(1)), int(row[s])))
        if points:
            out.append({"kind": "published", "title": title, "points": points})
    return out


def cd_diagram(table: dict, path: Path) -> str | None:
    """A critical-difference diagram of a ranked table (autorank: Friedman test, then Nemenyi's
    post-hoc test), blocks = the settings, each the mean over its seeds. Returns the sentence that
    says what was tested, or None where the table has too few settings to test (under five) or too
    few methods (under three)."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    from autorank import autorank, plot_stats

    frame = pd.DataFrame({m: v for m, v in table["means"].items() if all(x is not None for x in v)})
    if frame.shape[0] < 5 or frame.shape[1] < 3:  # (autorank's floor: five blocks)
        return None
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # (autorank prints its tables)
        warnings.simplefilter("ignore")
        result = autorank(frame, alpha=0.05, verbose=False, force_mode="nonparametric", order="descending")
        height = max(3.0, 0.16 * frame.shape[1])
        ax = plot_stats(result, allow_insignificant=True, width=9)
        ranks = [t for t in ax.texts if t.get_text().isdigit()]  # the axis's rank numbers
        if len(ranks) > 20:  # (sixty of them overprint each other: 1 and every fifth)
            for t in ranks:
                t.set_visible(int(t.get_text()) == 1 or int(t.get_text()) % 5 == 0)
        fig = ax.figure
        fig.set_size_inches(9, height)
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
    test = f"Friedman test over {frame.shape[0]} settings (blocks), p = {result.pvalue:.2g}"
    return (f"{test}; Nemenyi's critical difference {result.cd:.1f} ranks (alpha 0.05) over {frame.shape[1]} "
            f"methods. Each block is one setting's mean over seeds: the board keeps means and spreads, not the "
            f"seeds' values.")


def published_plot(tables: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(t["title"], *p) for t in tables for p in t["points"]]
    fig, ax = plt.subplots(figsize=(6.5, 6.0))
    lo = min(min(p[2], p[4]) for p in points) - 5
    hi = max(max(p[2], p[4]) for p in points) + 5
    ax.plot([lo, hi], [lo, hi], color="#999", lw=1, ls="--", label="ours = published")
    ax.errorbar([p[4] for p in points], [p[2] for p in points], yerr=[p[3] for p in points], fmt="o", ms=4,
                capsize=2, alpha=0.8, label="ours: mean +- std over seeds")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published (%)")
    ax.set_ylabel("ours (%)")
    ax.set_title(f"{len(points)} cells beside a published value")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def board_header(docname: str, text: str) -> str:
    """The generated part of a board's page: what it is, where and when it ran, its figures."""
    slug = docname.replace("/", "-")
    read = re.search(r"## How to read it\n\n(.*?)\n\n", text, re.S)
    note = read.group(1) if read else ""
    scale = re.search(r"Scale: ([^:]+):", note)
    measured = re.search(r"Measured with (.*?); CPU results|Measured with (.*?)\.(?: |$)", note)
    hours = re.search(r"Wall-clock time.*?: (.*?)\.\n", text)
    lines = ["", ":::{container} fedskew-board", "Sort any column by selecting its header (cells without a number sort "
             "last); the box above each table filters its rows by method; a diagram opens full size when selected.",
             ":::", ""]
    facts = []
    if scale:
        facts.append(f"**Scale:** {scale.group(1)}")
    if measured:
        facts.append(f"**Commit, software and hardware:** {measured.group(1) or measured.group(2)}")
    if hours:
        facts.append(f"**Time:** {hours.group(1)}")
    if facts:
        lines += ["", *[f"- {f}" for f in facts], ""]
    tables = board_tables(text)
    out = GEN / "boards"
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for i, t in enumerate(x for x in tables if x["kind"] == "ranked"):
        png = out / f"{slug}-cd-{i}.png"
        said = cd_diagram(t, png)
        if not said:
            n = len(t["settings"])
            figures += [f"**{t['title']}**: no critical-difference diagram; {n} setting{'s are' if n != 1 else ' is'} "
                        "too few blocks for a Friedman test (five at least).", ""]
        else:
            image = f"{_rel(docname)}generated/boards/{png.name}"
            figures += [f"**Critical-difference diagram: {t['title']}.** {said} Methods joined by a bar are not "
                        "significantly different; lower average rank is better.", "",
                        f"[![critical-difference diagram; select it for the full-size image]({image})]({image})", ""]
    published = [t for t in tables if t["kind"] == "published"]
    if published:
        png = out / f"{slug}-published.png"
        published_plot(published, png)
        figures += ["**Published against ours.** Every cell of the board that sits beside a published value, "
                    "our mean with its spread over seeds; points below the diagonal are below the paper.", "",
                    f"![published against ours]({_rel(docname)}generated/boards/{png.name})", ""]
    lines += figures
    return "\n".join(lines) + "\n"


def _rel(docname: str) -> str:
    return "../" * docname.count("/")


# -- Python API -------------------------------------------------------------------------------------------


def api_page() -> str:
    """autodoc of every public name, ``fedskew.__all__``, functions first."""
    import fedskew

    names = [n for n in fedskew.__all__ if not n.startswith("_")]
    functions = [n for n in names if inspect.isfunction(getattr(fedskew, n))]
    classes = [n for n in names if n not in functions]
    lines = ["# Python API", "", "Everything `import fedskew` offers (`fedskew.__all__`), from its docstrings. "
             "`import fedskew` loads no torch; the names load on first use.", "", "## Functions", ""]
    for n in functions:
        lines += ["```{eval-rst}", f".. autofunction:: fedskew.{n}", "```", ""]
    lines += ["## Classes", ""]
    for n in classes:
        obj = getattr(fedskew, n)
        kind = "autoexception" if isinstance(obj, type) and issubclass(obj, BaseException) else "autoclass"
        lines += ["```{eval-rst}", f".. {kind}:: fedskew.{n}", "   :members:", "```", ""]
    return "\n".join(lines)


# -- Sphinx hooks ----------------------------------------------------------------------------------------


def generate(app) -> None:
    _write(GEN / "api.md", api_page())
    _write(GEN / "config.md", config_page())
    _write(GEN / "sweep-file.md", sweep_file_page())
    for name, text in method_pages().items():
        _write(GEN / "methods" / f"{name}.md", text)
    _write(GEN / "published.md", published_page())
    _write(GEN / "suites.md", suites_page())
    partition_figures()


def on_source_read(app, docname: str, source: list[str]) -> None:
    if docname in BOARDS:
        text = source[0]
        title_end = text.index("\n") + 1
        source[0] = text[:title_end] + board_header(docname, text) + text[title_end:]


def setup(app):
    app.connect("builder-inited", generate)
    app.connect("source-read", on_source_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

