"""The golden file of round 4 and its recorder (``python tests/golden/record.py``)."""
