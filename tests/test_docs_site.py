r"""The documentation site, built once, checked in its files and opened in a real browser (headless
Chromium via Selenium).

The site is built with warnings as errors into a temporary directory (or ``$NPATTN_DOCS_SITE``,
built by ``.ci/run``).  In the built files: no page has raw TeX in its prose (text outside the
rendered math and the code: ``$$``, ``$``, ``\frac``, any backslash command), every internal link
and anchor resolves, every public name has its anchor, the landing page is one (what npattn is,
the two commands, a first example, the three ways in), the API index says what each module is,
signatures show defaults as written (``dtype=np.float64``) and the derivation pages' code is marked
to wrap within the column.  In the browser, served from a local ``http.server`` on 127.0.0.1,
every page is visited as a reader meets it: every formula typeset by the bundled MathJax, no raw
TeX left in the text, no code block wider than its column where the code wraps, no request leaving
the machine; the search page finds ``scaled_dot_product_attention`` and the notebook figures load.
A screenshot of a derivation page is saved as a CI artifact (to ``$NPATTN_ARTIFACTS``, else
``docs/_build/screenshots/``).

Skipped cleanly when sphinx, the docs extensions or selenium is missing (``pip install
".[docs]"``); the browser tests alone skip without ``/usr/bin/chromium`` or
``/usr/bin/chromedriver`` (``apt-get install chromium chromium-driver``).
"""

import functools
import html.parser
import http.server
import importlib.util
import json
import os
import pathlib
import re
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

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

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
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("the browser tests need Debian's chromium and chromium-driver")
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


def _pages(site):
    """Every page a reader opens: the landing page, guides, derivations, notebooks, API pages and the
    indexes (not the search page, which fills itself in, nor viewcode's source listings)."""
    pages = []
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site)
        if not {"_static", "_modules"} & set(rel.parts) and rel.name != "search.html":
            pages.append(rel.as_posix())
    return pages


# raw TeX in a page's prose (its text outside the rendered math and the code): $$ or a stray $
# (MyST left the math unparsed), any backslash command (\frac, \varepsilon, \mathcal, ...) or a
# MathJax delimiter
RAW_TEX = re.compile(r"\$|\\[A-Za-z]+|\\[\[\]()]")


# -- in the browser ------------------------------------------------------------------------------

# what a reader sees of a page: its prose (main's text without the code and the math), each formula
# typeset or not, and the blocks of code wider than their column (each its longest line)
_SEEN = """
const main = document.querySelector('main') || document.body;
const maths = [...main.querySelectorAll('.math')];
const clone = main.cloneNode(true);
clone.querySelectorAll('pre, code, script, style, textarea, mjx-container, .math, .highlight')
     .forEach(e => e.remove());
const pres = [...main.querySelectorAll('div[class*="highlight-"] pre')];
return {
  prose: clone.textContent,
  math: maths.length,
  untypeset: maths.filter(e => !e.querySelector('mjx-container svg')).map(e => e.textContent.slice(0, 80)),
  wraps: main.querySelectorAll('.npattn-wrap pre').length,
  wide: pres.filter(e => e.scrollWidth > e.clientWidth).map(e => ({
    classes: e.closest('div[class*="highlight-"]').className.split(' '),
    width: [e.clientWidth, e.scrollWidth],
    code: e.textContent.split('\\n').reduce((a, b) => (b.length > a.length ? b : a)).slice(0, 100),
  })),
};
"""


@pytest.fixture(scope="session")
def visited(site, server, browser):
    """Every page opened once in the browser (each asserted to load nothing from another host):
    ``{page: what a reader sees of it}``."""
    seen = {}
    for page in _pages(site):
        _open(browser, server, page)
        seen[page] = browser.execute_script(_SEEN)
    return seen


def test_math_is_typeset_offline(site, server, browser, visited):
    untypeset = {page: v["untypeset"] for page, v in visited.items() if v["untypeset"]}
    assert not untypeset, f"formulas MathJax did not typeset: {json.dumps(untypeset, indent=1)[:3000]}"
    with_math = [page for page, v in visited.items() if v["math"]]
    assert len(with_math) >= 20, f"only {len(with_math)} pages with typeset math (the check would be vacuous)"
    page = _derivation_page(site)
    _open(browser, server, page)
    assert len(browser.find_elements(By.CSS_SELECTOR, "mjx-container svg")) >= 3
    scripts = browser.execute_script("return [...document.scripts].map(s => s.src).filter(s => s.includes('mathjax'))")
    assert scripts and all(s.startswith(server) for s in scripts), f"MathJax not served by the site: {scripts}"
    shots = pathlib.Path(os.environ.get("NPATTN_ARTIFACTS") or DOCS / "_build" / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    path = shots / (page.replace("/", "_").replace(".html", "") + ".png")
    assert browser.save_screenshot(str(path)) and path.stat().st_size > 10_000


def test_no_page_shows_raw_tex(visited):
    raw = {}
    for page, v in visited.items():
        for line in v["prose"].splitlines():
            if RAW_TEX.search(line):
                raw.setdefault(page, []).append(line.strip()[:120])
    assert not raw, f"raw TeX in the rendered text of {len(raw)} pages:\n{json.dumps(raw, indent=1)[:3000]}"


def test_wrapped_code_stays_within_the_column(visited):
    """Code included from the sources (anywhere) and the derivation pages' code (the included
    functions and the code cells) fit their column: no sideways scrolling.  Outputs (gradcheck's
    tables) and the other pages' code cells keep their lines."""
    wide = {}
    for page, v in visited.items():
        derivation = page.startswith("derivations/")
        for block in v["wide"]:
            if "npattn-wrap" in block["classes"] or (derivation and "output" not in block["classes"]):
                wide.setdefault(page, []).append(block)
    assert not wide, f"code wider than its column:\n{json.dumps(wide, indent=1)[:3000]}"
    pages = [p for p in visited if p.startswith("derivations/") and p != "derivations/index.html"]
    bare = [p for p in pages if not visited[p]["wraps"]]
    assert pages and not bare, f"derivation pages without wrapping code: {bare}"


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


class _Prose(html.parser.HTMLParser):
    """The text of a page a reader reads as prose: ``<body>`` without the code (``<code>``,
    ``<pre>``, highlighted blocks), the math (``math`` spans and divs, MathJax containers), scripts
    and styles; ``lines`` holds each text run that shows raw TeX."""

    SKIP_TAGS = {"head", "script", "style", "code", "pre", "kbd", "samp", "textarea", "math", "svg", "mjx-container"}
    SKIP_CLASSES = {"math", "highlight"}
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open, self.skipping, self.lines = [], 0, []

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        skip = tag in self.SKIP_TAGS or bool(set((dict(attrs).get("class") or "").split()) & self.SKIP_CLASSES)
        self.open.append((tag, skip))
        self.skipping += skip

    def handle_endtag(self, tag):
        if tag in self.VOID or tag not in {t for t, _ in self.open}:
            return
        while self.open:
            t, skip = self.open.pop()
            self.skipping -= skip
            if t == tag:
                break

    def handle_data(self, data):
        if not self.skipping:
            self.lines += [line.strip()[:120] for line in data.splitlines() if RAW_TEX.search(line)]


def test_no_page_has_raw_tex_in_its_prose(site):
    """Display math inside a paragraph (``$$`` without blank lines around it) is not parsed by MyST
    and reaches the page as ``$`` signs and TeX commands: no page has any outside its math."""
    raw = {}
    for page in _pages(site):
        parser = _Prose()
        parser.feed((site / page).read_text(encoding="utf-8"))
        if parser.lines:
            raw[page] = parser.lines
    assert len(_pages(site)) >= 40, "fewer pages than the site has (the check would be vacuous)"
    assert not raw, f"raw TeX in the prose of {len(raw)} pages:\n{json.dumps(raw, indent=1)[:3000]}"


def _text(path):
    """A page's text, tags removed, whitespace collapsed."""
    text = re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8"))
    return " ".join(html.unescape(text).split())


def test_landing_page(site):
    """The first page says what npattn is, gives the two commands and a first example, and leads
    each of its three readers on: to study gradients, to use it in a NumPy project, to
    property-test a module of their own (each way to its guides, notebooks, derivations)."""
    page = site / "index.html"
    text, links = _text(page), set(_parse(page).targets)
    assert "pure NumPy" in text and "written by hand" in text
    blocks = re.findall(
        r'<div class="highlight-(\w+)[^"]*"><div class="highlight"><pre>(.*?)</pre>', page.read_text(), re.S
    )
    code = {lang: " ".join(html.unescape(re.sub(r"<[^>]+>", "", src)).split()) for lang, src in blocks}
    assert 'pip install ".[test]"' in code.get("bash", "") and "python -m pytest" in code.get("bash", "")
    assert "npattn.MultiHeadAttention" in code.get("python", "") and "gradcheck" in code.get("python", "")
    ways = {
        "Study gradients": [
            "guides/gradients_by_hand.html",
            "notebooks/04_gradients_by_hand.html",
            "derivations/index.html",
            "guides/curvature.html",
            "notebooks/12_curvature.html",
            "notebooks/11_attention_2026.html",
        ],
        "Use it in a NumPy project": [
            "guides/numpy_project.html",
            "guides/conventions.html",
            "guides/open_models.html",
            "notebooks/13_open_model_numpy.html",
            "api/index.html",
        ],
        "Property-test your module": ["guides/own_module.html", "guides/forward_mode.html", "api/npattn.testing.html"],
    }
    for way, targets in ways.items():
        assert way in text, f"the landing page does not offer the way {way!r}"
        missing = [t for t in targets if not any(link.split("#")[0] == t for link in links)]
        assert not missing, f"{way!r} does not link to {missing}"


def test_api_index_says_what_each_module_is(site):
    sys.path.insert(0, str(DOCS))
    try:
        import _api
    finally:
        sys.path.remove(str(DOCS))
    page = site / "api" / "index.html"
    text, links = _text(page), set(_parse(page).targets)
    for modname, blurb in _api.MODULES:
        assert f"{modname}.html" in links, f"the API index does not link to {modname}"
        line = re.sub(r"``|\*", "", blurb)
        assert f"{modname} — {line}" in text, f"the API index does not say what {modname} is ({line!r})"


class _Signatures(html.parser.HTMLParser):
    """The text of every signature (``<dt class="sig ...">``) of a page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth, self.signatures = 0, []

    def handle_starttag(self, tag, attrs):
        if self.depth:
            self.depth += tag == "dt"
        elif tag == "dt" and "sig" in (dict(attrs).get("class") or "").split():
            self.depth = 1
            self.signatures.append("")

    def handle_endtag(self, tag):
        if self.depth and tag == "dt":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.signatures[-1] += data


def test_signatures_show_defaults_as_written(site):
    """``dtype=np.float64`` in a signature, as the source writes it, not ``dtype=<class 'numpy.float64'>``."""
    signatures = []
    for page in sorted((site / "api").glob("*.html")):
        parser = _Signatures()
        parser.feed(page.read_text(encoding="utf-8"))
        signatures += [" ".join(s.split()) for s in parser.signatures]
    # a repr where the source has an expression (dataclass fields' default factories show <factory>)
    reprs = [s for s in signatures if re.search(r"<class '|(?<![\w.])dtype\('|<function |object at 0x", s)]
    assert not reprs, f"{len(reprs)} signatures show a default's repr:\n" + "\n".join(reprs[:10])
    assert any("dtype=np.float64" in s for s in signatures), "no signature shows dtype=np.float64"


def test_derivation_code_is_marked_to_wrap(site):
    """On the derivation pages every block of code (included from the sources, or a code cell) wraps
    within the column (``npattn-wrap``: ``white-space: pre-wrap`` in ``_static/npattn.css``); the
    outputs (gradcheck's tables) keep their columns.  The browser test measures the widths."""
    css = (site / "_static" / "npattn.css").read_text(encoding="utf-8")
    assert re.search(r"div\.npattn-wrap pre\s*\{[^}]*white-space:\s*pre-wrap", css)
    pages = sorted(p for p in (site / "derivations").glob("*.html") if p.name != "index.html")
    assert len(pages) >= 15
    unmarked = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "_static/npattn.css" in text, f"{page.name} does not load npattn.css"
        classes = re.findall(r'<div class="([^"]*\bhighlight-[^"]*)"', text)
        code = [c.split() for c in classes if "output" not in c.split()]
        assert len(code) >= 3, f"{page.name}: {len(code)} code blocks"
        bare = [c for c in code if "npattn-wrap" not in c]
        if bare:
            unmarked[page.name] = bare
    assert not unmarked, f"code that does not wrap: {unmarked}"


# -- the build -----------------------------------------------------------------------------------


def test_executed_pages_kernels_warn_of_no_plain_tcp(tmp_path, monkeypatch, capfd):
    """myst-nb executes each derivation page in a Jupyter kernel; ipykernel (7.4 and later) prints
    "Kernel is running over TCP without encryption" on its stderr whenever the kernel manager
    provisions no CurveZMQ keys, once a page of the build.  ``conf.py`` gives myst-nb's executions
    the configuration that asks for them: a page runs as before and its kernel warns of nothing."""
    nbformat = pytest.importorskip("nbformat")
    from myst_nb.core.execute import direct

    monkeypatch.setattr(direct, "single_nb_execution", direct.single_nb_execution)  # put back afterwards
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("npattn_docs_conf", DOCS / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    conf._encrypt_kernels()

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    result = direct.single_nb_execution(nb, cwd=str(tmp_path), timeout=WAIT, allow_errors=False)
    assert result.err is None, result.exc_string
    assert nb.cells[0].outputs[0]["text"] == "42\n"
    err = capfd.readouterr().err
    assert "running over TCP" not in err, err
