"""The documentation site: it builds with warnings as errors, every internal link and anchor of the
built pages resolves, and in headless Chromium every page loads with no console error and no missing
image, the search finds a method's page, a leaderboard column sorts, the navigation reaches every
page; screenshots of the home page and a leaderboard at desktop and phone widths are saved."""

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("site")]  # one worker, one build of the site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built from docs/ with ``-W --keep-going`` (a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(out / ".doctrees"), str(ROOT / "docs"), str(out / "html")],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    return out / "html"


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "img", "link", "script"):
                self.hrefs.append(a[key])


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(errors="replace"))
    return p


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if not p.relative_to(site).parts[0].startswith("_"))


def test_the_site_builds_and_every_internal_link_and_anchor_resolves(site):
    built = pages(site)
    assert len(built) > 100 and (site / "generated/methods/fedmr.html").is_file()
    parsed = {p: _parse(p) for p in built}
    broken = []
    for page, links in parsed.items():
        for href in links.hrefs:
            url = urlsplit(href)
            if url.scheme or href.startswith(("//", "mailto:")):
                continue  # external: never fetched here
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
            elif url.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(url.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {href} (no anchor '{url.fragment}')")
    assert not broken, "\n".join(broken[:50])


def test_the_link_check_catches_a_broken_anchor(tmp_path):
    """The check above can fail: a page whose link names an anchor the target lacks."""
    (tmp_path / "a.html").write_text('<a href="b.html#there">x</a><a href="b.html#here">y</a>')
    (tmp_path / "b.html").write_text('<h1 id="here">b</h1>')
    assert "there" not in _parse(tmp_path / "b.html").ids and "here" in _parse(tmp_path / "b.html").ids


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def browser(site):
    if _chromium() is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            yield chromium, f"http://127.0.0.1:{server.server_port}/"
        finally:
            chromium.close()
            server.shutdown()
            server.server_close()


def _open(chromium, url: str, width: int = 1280, height: int = 900, settle: bool = True):
    """A page, its console errors and the URLs that came back 4xx/5xx; ``settle``: wait for the network
    to idle (the scripts' own requests done), else for the load event (every image and script)."""
    page = chromium.new_page(viewport={"width": width, "height": height})
    errors, missing = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
    page.goto(url, wait_until="networkidle" if settle else "load")
    return page, errors, missing


def test_every_page_loads_with_no_console_error_and_no_missing_image(browser, site):
    chromium, base = browser
    problems = []
    page, errors, missing = _open(chromium, base + "index.html", settle=False)  # one tab, page after page
    for path in pages(site):
        rel = path.relative_to(site).as_posix()
        errors.clear()
        missing.clear()
        page.goto(base + rel, wait_until="load")
        broken = page.evaluate("Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))"
                               ".map(i => i.src)")
        problems += [f"{rel}: console: {e}" for e in errors] + [f"{rel}: {u} not found" for u in missing] + \
            [f"{rel}: image {u} did not load" for u in broken]
    page.close()
    assert not problems, "\n".join(problems[:40])


def test_the_navigation_reaches_every_page(browser, site):
    """Every page is one click from the home page's navigation (Furo's sidebar holds the whole tree)."""
    chromium, base = browser
    page, _, _ = _open(chromium, base + "index.html")
    hrefs = page.evaluate("Array.from(document.querySelectorAll('.sidebar-tree a')).map(a => a.href)")
    page.close()
    reached = {urlsplit(h).path.lstrip("/") for h in hrefs} | {"index.html"}
    generated_index = {"genindex.html", "search.html", "py-modindex.html"}
    every = {p.relative_to(site).as_posix() for p in pages(site)} - generated_index
    assert every <= reached, sorted(every - reached)


def test_the_search_finds_a_method_s_page_by_its_name(browser):
    chromium, base = browser
    page, errors, _ = _open(chromium, base + "search.html?q=fedmr")
    page.wait_for_selector("#search-results li a", timeout=60_000)
    found = page.evaluate("Array.from(document.querySelectorAll('#search-results li a')).map(a => a.href)")
    page.close()
    assert any(h.split("?")[0].endswith("generated/methods/fedmr.html") for h in found), found
    assert not errors


def _column(page, table: int, col: int) -> list[str]:
    return page.evaluate(f"Array.from(document.querySelectorAll('table.fedskew-sortable')[{table}]"
                         f".querySelectorAll('tbody tr')).filter(tr => !tr.hidden)"
                         f".map(tr => tr.children[{col}].innerText.trim())")


def _numbers(cells: list[str]) -> list[float]:
    return [float(m.group(0)) for c in cells if (m := re.match(r"-?\d+(\.\d+)?", c.strip()))]


def test_a_leaderboard_column_sorts_with_words_last_and_the_filter_keeps_one_method(browser):
    chromium, base = browser
    page, errors, _ = _open(chromium, base + "leaderboards/label-skew-lite.html")
    page.wait_for_selector("table.fedskew-sortable")
    heads = page.evaluate("Array.from(document.querySelectorAll('table.fedskew-sortable')[0]"
                          ".querySelectorAll('thead th')).map(th => th.innerText.trim())")
    assert heads[:3] == ["method", "avg rank", "W/T/L vs fedavg"], heads  # what a reader came for, first
    col = heads.index("#C=1")
    before = _numbers(_column(page, 0, col))
    assert before != sorted(before)  # (the board's order is by average rank, not by #C=1)
    header = page.locator("table.fedskew-sortable").first.locator("th").nth(col)
    header.locator("button").click()
    assert header.get_attribute("aria-sort") == "descending"
    assert _numbers(_column(page, 0, col)) == sorted(before, reverse=True)
    header.locator("button").click()
    assert header.get_attribute("aria-sort") == "ascending"
    assert _numbers(_column(page, 0, col)) == sorted(before)
    # the personalised table holds `none` cells (methods without personal models): last, either way
    tables = page.evaluate("document.querySelectorAll('table.fedskew-sortable').length")
    with_none = next(t for t in range(tables) if any(c == "none" for c in _column(page, t, 3)))
    other = page.locator("table.fedskew-sortable").nth(with_none).locator("th").nth(3)
    for _ in range(2):
        other.locator("button").click()
        cells = _column(page, with_none, 3)
        words = [i for i, c in enumerate(cells) if not re.match(r"\**-?\d", c)]
        assert words and words == list(range(len(cells) - len(words), len(cells))), (other.get_attribute("aria-sort"),
                                                                                     cells[:3], cells[-3:])
    page.locator("input.fedskew-filter").first.fill("localghbm")
    assert _column(page, 0, 0) == ["localghbm"]
    page.close()
    assert not errors


def _right_edge(page, selector: str) -> float:
    return page.evaluate(f"(() => {{ const r = document.querySelector({selector!r}).getBoundingClientRect(); "
                         f"return r.left + Math.min(r.width, 40); }})()")


def test_what_a_reader_came_for_is_on_screen_at_phone_and_desktop_widths(browser):
    """At 1280 px a board's avg rank and W/T/L columns are in view without scrolling sideways; at
    390 px a config key's meaning is (the table reads as one card a row)."""
    chromium, base = browser
    page, errors, _ = _open(chromium, base + "leaderboards/label-skew-lite.html", 1280, 900)
    page.wait_for_selector("table.fedskew-sortable")
    for n in (2, 3):  # the avg rank and W/T/L headers, moved after the method's
        assert _right_edge(page, f"table.fedskew-sortable thead th:nth-child({n})") < 1280
    page.close()
    page, errors2, _ = _open(chromium, base + "generated/config.html", 390, 844)
    cell = "table.fedskew-cards tbody tr td[data-label='meaning']"
    page.wait_for_selector(cell)
    assert _right_edge(page, cell) < 390
    page.close()
    assert not errors and not errors2


def test_screenshots_of_the_home_page_and_a_leaderboard_at_desktop_and_phone_widths(browser, site):
    chromium, base = browser
    shots = ROOT / "docs" / "_build" / "screenshots"  # (ignored by git; kept after the test for a person to look at)
    shots.mkdir(parents=True, exist_ok=True)
    for name, path in (("home", "index.html"), ("leaderboard", "leaderboards/label-skew-lite.html")):
        for width, height, kind in ((1280, 900, "desktop"), (390, 844, "phone")):
            page, errors, _ = _open(chromium, base + path, width, height)
            out = shots / f"{name}-{kind}.png"
            page.screenshot(path=str(out))
            page.close()
            assert out.stat().st_size > 10_000 and not errors
    print(f"screenshots: {shots}")
