"""Sphinx configuration of fedskew's documentation site.

Build it with ``sphinx-build -W --keep-going docs docs/_build/html`` (the ``docs`` extra installs the
tools). The pages stay Markdown (MyST), so GitHub renders them too; the reference pages and the
leaderboards' figures are generated from the code and the committed boards at every build
(``docs/_ext/fedskew_docs.py``), never copied by hand.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

import fedskew  # noqa: E402

project = "fedskew"
author = "the fedskew authors"
copyright = "2026, the fedskew authors"
release = version = fedskew.__version__

extensions = [
    "myst_parser",  # Markdown pages
    "sphinx.ext.autodoc",  # the Python API from its docstrings
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinxarg.ext",  # the command line, from the argparse parser
    "sphinx_copybutton",
    "fedskew_docs",  # generated reference pages and board figures
]

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
# GitHub's anchors for headings (`page.md#a-heading`), so links work on GitHub and on the site alike
myst_heading_anchors = 4
suppress_warnings = ["myst.header"]  # the boards' pages start at a second-level heading after their title

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "generated/README.md",
    "gpu-runs/**",  # raw logs of the GPU windows, linked as files
    "gpu-campaign/*/map/**",
    "leaderboards/*.html",
]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_typehints = "description"
autosummary_generate = False

html_theme = "furo"
html_title = f"fedskew {release}"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"
html_css_files = ["fedskew.css"]
html_js_files = ["boards.js"]
html_theme_options = {
    "source_repository": "https://github.com/fedskew/fedskew/",
    "source_branch": "main",
    "source_directory": "docs/",
}
# no network at build time: intersphinx and external link checks stay off
linkcheck_ignore = [r"https?://.*"]
