"""``gradgradcheck``'s import path: the check itself lives in :mod:`npattn.testing.gradcheck`
(one engine for first and second order)."""

from .gradcheck import gradgradcheck

__all__ = ["gradgradcheck"]
