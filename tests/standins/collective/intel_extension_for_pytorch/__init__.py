"""Stand-in for intel-extension-for-pytorch (torch < 2.8 with the ccl backend)."""

__version__ = "2.7.10+xpu"
