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
  shapes (a Jupyter kernel per page, a second or two each).  The kernels' sockets are encrypted
  (``_encrypt_kernels``), so ipykernel has no plain-TCP warning to print.
* Code included from the sources (``literalinclude``) and the code cells of the derivation pages
  wrap within the column instead of scrolling sideways (``_static/npattn.css``, ``_wrap_code``);
  the cells' outputs (gradcheck's tables) keep their columns.
* Signatures show defaults as written in the source (``dtype=np.float64``, not
  ``dtype=<class 'numpy.float64'>``); where autodoc cannot read the source, numpy's reprs are
  spelled as written (``_numpy_defaults``).
"""

from __future__ import annotations

import os
import pathlib
import re
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
autodoc_preserve_defaults = True  # a default as the source spells it: dtype=np.float64
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
html_css_files = ["npattn.css"]
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


def _encrypt_kernels() -> None:
    """The executed pages' kernels talk to the build over CurveZMQ-encrypted sockets.

    myst-nb executes a page through nbclient (``jupyter_cache``'s ``single_nb_execution``) without
    any configuration, so the kernel manager keeps jupyter_client's ``transport_encryption =
    "disabled"``: plain TCP, on which ipykernel (7.4 and later) logs "Kernel is running over TCP
    without encryption ..." on its stderr, once a page.  This gives nbclient the configuration
    that warning asks for, ``KernelManager.transport_encryption = "auto"`` (keys provisioned
    when the kernelspec declares ``supported_encryption: curve``, as ipykernel's does): the
    cause removed, no output filtered.  Without CurveZMQ (an older jupyter_client, or libzmq
    without libsodium) there is no such warning either, and nothing is changed.
    """
    import zmq
    from jupyter_client.manager import KernelManager

    if "transport_encryption" not in KernelManager.class_trait_names() or not zmq.has("curve"):
        return
    from myst_nb.core.execute import direct
    from traitlets.config import Config

    run = direct.single_nb_execution
    if getattr(run, "encrypted", False):
        return

    def single_nb_execution(*args, **kwargs):
        kwargs.setdefault("config", Config({"KernelManager": {"transport_encryption": "auto"}}))
        return run(*args, **kwargs)

    single_nb_execution.encrypted = True  # type: ignore[attr-defined]
    direct.single_nb_execution = single_nb_execution


def _wrap_code(app, doctree) -> None:
    """Marks the code that wraps within the column (the ``npattn-wrap`` class, ``_static/npattn.css``):
    every block included from a source file (``literalinclude``), and on the derivation pages
    every code cell too; outputs (gradcheck's tables) keep their columns."""
    from docutils import nodes

    on_derivation_page = app.env.docname.startswith("derivations/")
    for node in doctree.findall(nodes.literal_block):
        included = bool(node.get("source"))  # literalinclude names the file it read
        if included or (on_derivation_page and "output" not in node["classes"]):
            node["classes"].append("npattn-wrap")


# what a signature shows of a default that autodoc could not read from the source (a hypothesis
# strategy's wrapper, a dataclass's field) is its repr: numpy's types and dtypes as they are written
_NUMPY_REPRS = [
    (re.compile(r"<class 'numpy\.(\w+)'>"), r"np.\1"),
    (re.compile(r"(?<![\w.])dtype\('(\w+)'\)"), r"np.dtype('\1')"),
]


def _numpy_defaults(app, what, name, obj, options, signature, return_annotation):
    """``dtype=np.float64`` in a signature, never ``dtype=<class 'numpy.float64'>``."""
    if signature:
        for pattern, spelled in _NUMPY_REPRS:
            signature = pattern.sub(spelled, signature)
    return signature, return_annotation


def _setup_sources(app) -> None:
    import _api

    _copy_mathjax(HERE / "_static")
    _copy_notebooks(HERE / "notebooks")
    _api.write_pages(HERE / "api")
    _encrypt_kernels()


def setup(app):
    os.makedirs(HERE / "_static", exist_ok=True)
    app.connect("builder-inited", _setup_sources)
    app.connect("doctree-read", _wrap_code)
    app.connect("autodoc-process-signature", _numpy_defaults)
