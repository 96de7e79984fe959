"""Sphinx configuration of npattn's documentation site.

Build: ``pip install ".[docs]"`` then ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.

* The API pages (``api/*.rst``) are generated at build time from each public module's ``__all__``
  (``_api.py``): every public name gets its own anchor (``id="npattn.MultiHeadAttention"``), a name
  re-exported from a second module links to its first page instead of being documented twice.
* Math renders offline: MathJax 3 (the ``django-static-mathjax`` wheel ships its files; a plain
  Python package, Django is not needed) is copied into the build's ``_static``; no page loads
  anything from another host.
* Notebooks are rendered from their committed outputs (``nb_execution_mode = "off"``; the test
  suite executes them); they are copied next to these pages at build time.
* The derivation pages (``derivations/*.md``) are MyST notebooks executed by every build (their
  front matter sets ``mystnb: execution_mode: "force"``): each shows a ``gradcheck`` run on tiny
  shapes (a Jupyter kernel per page, a second or two each).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import npattn  # noqa: E402

project = "npattn"
author = "the npattn developers"
copyright = "the npattn developers, MIT licence"
release = npattn.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]

# -- autodoc / napoleon (numpy-style docstrings) ------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

# -- MyST / notebooks ------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
# "page.md#slug" / "notebook.ipynb#slug" links reach a section (the derivation pages link into the
# notebooks' sections); a slug that no heading has is a warning, so the build checks them
myst_heading_anchors = 3
nb_execution_mode = "off"
suppress_warnings = ["mystnb.unknown_mime_type"]

# -- HTML -------------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "npattn"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}

# MathJax from the build itself (offline).  tex-svg.js draws glyphs as SVG paths: no web fonts to load.
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {"tex": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]]}}


def _copy_mathjax(static: pathlib.Path) -> None:
    import mathjax  # the django-static-mathjax wheel (a package named ``mathjax``)

    src = pathlib.Path(mathjax.__file__).resolve().parent / "static" / "mathjax" / "es5"
    dst = static / "mathjax"
    if not (dst / "tex-svg.js").exists():
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "tex-svg.js", dst / "tex-svg.js")


def _copy_notebooks(target: pathlib.Path) -> None:
    target.mkdir(exist_ok=True)
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        dst = target / nb.name
        if not dst.exists() or dst.stat().st_mtime < nb.stat().st_mtime:
            shutil.copy2(nb, dst)


def _setup_sources(app) -> None:
    import _api

    _copy_mathjax(HERE / "_static")
    _copy_notebooks(HERE / "notebooks")
    _api.write_pages(HERE / "api")


def setup(app):
    os.makedirs(HERE / "_static", exist_ok=True)
    app.connect("builder-inited", _setup_sources)
