"""npattn: transformer attention in pure NumPy, every backward pass written by hand."""
__version__ = "0.1.0"
