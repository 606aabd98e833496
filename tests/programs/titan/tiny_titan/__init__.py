"""torchtitan configs for tests/programs/titan/train.py (``--module tiny_titan``)."""
