"""Packaging contract: importing npattn pulls in numpy and the standard library only."""

import subprocess
import sys

import npattn

OPTIONAL = ("matplotlib", "hypothesis", "tqdm", "torch", "scipy", "threadpoolctl", "nbclient")


def test_import_is_numpy_only():
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import npattn, npattn.functional, npattn.book, npattn.models, npattn.optim, npattn.masks\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        f"bad = sorted(new & set({OPTIONAL!r}))\n"
        "assert not bad, bad\n"
        "third = {m for m in new if m not in sys.stdlib_module_names}\n"
        "assert third <= {'numpy', 'npattn'}, sorted(third)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_version_and_cli_version():
    assert npattn.__version__.count(".") == 2
    out = subprocess.run([sys.executable, "-m", "npattn", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"npattn {npattn.__version__}"


def test_public_names():
    for name in (
        "Module",
        "Parameter",
        "Linear",
        "LayerNorm",
        "Dropout",
        "Embedding",
        "FeedForward",
        "MultiHeadAttention",
        "EncoderBlock",
        "gradcheck",
        "no_grad",
        "TinyTransformer",
    ):
        assert hasattr(npattn, name), name
