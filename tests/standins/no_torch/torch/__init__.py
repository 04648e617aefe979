"""Shadows an installed torch: the test wants "torch is not installed"."""

raise ModuleNotFoundError("No module named 'torch'", name="torch")
