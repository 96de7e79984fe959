"""The documentation site, built once and opened in a real browser (headless Chromium via Selenium).

The site is built with warnings as errors into a temporary directory, served from a local
``http.server`` on 127.0.0.1, and checked as a reader meets it: the math is typeset by the bundled
MathJax (no raw TeX left in the text), the search page finds ``scaled_dot_product_attention``, the
notebook figures load, no request leaves the machine, every internal link and anchor resolves, and
every public name has its anchor.  A screenshot of a derivation page is saved as a CI artifact (to
``$NPATTN_ARTIFACTS``, else ``docs/_build/screenshots/``).

Skipped cleanly when sphinx, the docs extensions, selenium, ``/usr/bin/chromium`` or
``/usr/bin/chromedriver`` is missing (``pip install ".[docs]"``; ``apt-get install chromium
chromium-driver``).
"""

import functools
import html.parser
import http.server
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import urllib.parse

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")
pytest.importorskip("pydata_sphinx_theme")
pytest.importorskip("mathjax")
pytest.importorskip("selenium")

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("needs Debian's chromium and chromium-driver", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
WAIT = 60  # seconds: a loaded two-core machine typesets slowly


@pytest.fixture(scope="session")
def site():
    """The built site (a temporary directory): ``python -m sphinx -W --keep-going -b html``.

    ``$NPATTN_DOCS_SITE`` names a site already built by that command (``.ci/run`` builds it once,
    with warnings as errors, before the tests), which is then checked instead of building again.
    """
    prebuilt = os.environ.get("NPATTN_DOCS_SITE")
    if prebuilt:
        assert (pathlib.Path(prebuilt) / "index.html").exists(), f"NPATTN_DOCS_SITE={prebuilt} holds no built site"
        yield pathlib.Path(prebuilt).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="npattn-docs-") as tmp:
        out = pathlib.Path(tmp) / "html"
        cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
        cmd += ["-d", str(pathlib.Path(tmp) / "doctrees"), str(DOCS), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, f"the docs build failed or warned:\n{proc.stdout}\n{proc.stderr}"
        yield out


@pytest.fixture(scope="session")
def server(site):
    """``http://127.0.0.1:<port>`` serving the built site."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="session")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="npattn-chromium-")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1280,1600",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()


def _open(browser, server, page):
    """Loads ``page``, waits for MathJax to finish where the page has it; returns the page's origin."""
    browser.get(f"{server}/{page}")
    WebDriverWait(browser, WAIT).until(lambda d: d.execute_script("return document.readyState") == "complete")
    browser.set_script_timeout(WAIT)
    browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "if (window.MathJax && MathJax.startup && MathJax.startup.promise)"
        "  MathJax.startup.promise.then(() => done(true), () => done(false)); else done(true);"
    )
    _assert_local_requests(browser, server, page)


def _assert_local_requests(browser, server, page):
    urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    urls.append(browser.current_url)
    outside = [u for u in urls if not (u.startswith(server + "/") or u.startswith("data:"))]
    assert not outside, f"{page} requested from outside the machine: {outside}"
    assert len(urls) > 1, f"{page}: no resources recorded (the check would be vacuous)"


def _derivation_page(site):
    pages = sorted(p.name for p in (site / "derivations").glob("*.html") if p.name != "index.html")
    return f"derivations/{pages[0]}" if pages else "guides/forward_mode.html"


# -- in the browser ------------------------------------------------------------------------------


def test_math_is_typeset_offline(site, server, browser):
    page = _derivation_page(site)
    _open(browser, server, page)
    typeset = browser.find_elements(By.CSS_SELECTOR, "mjx-container")
    assert len(typeset) >= 3, f"{page}: {len(typeset)} MathJax containers (the math was not typeset)"
    assert browser.execute_script("return document.querySelectorAll('mjx-container svg').length") >= 3
    text = browser.find_element(By.TAG_NAME, "main").text
    for raw in ("$$", "\\frac", "\\begin", "\\["):
        assert raw not in text, f"{page}: raw TeX {raw!r} left in the rendered text"
    scripts = browser.execute_script("return [...document.scripts].map(s => s.src).filter(s => s.includes('mathjax'))")
    assert scripts and all(s.startswith(server) for s in scripts), f"MathJax not served by the site: {scripts}"
    shots = pathlib.Path(os.environ.get("NPATTN_ARTIFACTS") or DOCS / "_build" / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    path = shots / (page.replace("/", "_").replace(".html", "") + ".png")
    assert browser.save_screenshot(str(path)) and path.stat().st_size > 10_000


def test_search_finds_scaled_dot_product_attention(server, browser):
    _open(browser, server, "search.html?q=scaled_dot_product_attention")
    target = "npattn.functional.html#npattn.functional.scaled_dot_product_attention"

    def found(d):
        links = d.execute_script("return [...document.querySelectorAll('#search-results a')].map(a => a.href)")
        return [u for u in links if u.endswith(target)]

    assert WebDriverWait(browser, WAIT).until(found), "the search did not list scaled_dot_product_attention"


def test_notebook_figures_load(server, browser):
    _open(browser, server, "notebooks/01_self_attention.html")
    WebDriverWait(browser, WAIT).until(lambda d: d.execute_script("return [...document.images].every(i => i.complete)"))
    sizes = browser.execute_script(
        "return [...document.querySelectorAll('main img')]"
        ".map(i => [i.getAttribute('src').slice(0, 40), i.naturalWidth])"
    )
    assert len(sizes) >= 1, "the notebook page shows no figure"
    assert all(w > 0 for _, w in sizes), f"figures that did not load: {[s for s, w in sizes if w == 0]}"


def test_api_page_has_anchors_and_no_outside_requests(server, browser):
    _open(browser, server, "api/npattn.html")
    assert browser.find_elements(By.ID, "npattn.MultiHeadAttention")
    _open(browser, server, "index.html")


# -- in the built files --------------------------------------------------------------------------


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.targets, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and not (tag == "link" and a.get("rel") in ("canonical",)):
                self.targets.append(a[key])


def _parse(path):
    p = _Links()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def test_internal_links_resolve(site):
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)  # _static: theme templates
    parsed = {p: _parse(p) for p in pages}
    broken = []
    for page, links in parsed.items():
        for target in links.targets:
            url = urllib.parse.urlsplit(target)
            if url.scheme or url.netloc or target.startswith(("mailto:", "javascript:")):
                continue  # an outside link is only followed by the reader (never loaded)
            dest = page if not url.path else (page.parent / urllib.parse.unquote(url.path)).resolve()
            if dest.is_dir():
                dest = dest / "index.html"
            if not dest.exists():
                broken.append(f"{page.relative_to(site)} -> {target}")
            elif url.fragment and dest.suffix == ".html":
                ids = parsed[dest].ids if dest in parsed else _parse(dest).ids
                if urllib.parse.unquote(url.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)} -> {target} (no such anchor)")
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:40])


def test_pages_load_nothing_from_another_host(site):
    """No ``<script src>``, stylesheet or image from another host anywhere in the site."""
    outside = []
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        for marker in ('src="http', "src='http", 'src="//', '<link rel="stylesheet" href="http'):
            if marker in text:
                outside.append(f"{page.relative_to(site)}: {marker}")
    assert not outside, outside


def test_every_public_name_has_an_anchor(site):
    sys.path.insert(0, str(DOCS))
    try:
        import _api
    finally:
        sys.path.remove(str(DOCS))
    import importlib
    import inspect

    missing = []
    for modname, _ in _api.MODULES:
        mod = importlib.import_module(modname)
        ids = _parse(site / "api" / f"{modname}.html").ids
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.ismodule(obj):
                continue
            if f"{modname}.{name}" not in ids:
                missing.append(f"{modname}.{name}")
    assert not missing, f"public names without an anchor: {missing}"
