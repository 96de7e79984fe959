"""What the command line runs (``npattn check``, ``demo``, ``bench``); the library never imports these."""

__all__: list[str] = []
