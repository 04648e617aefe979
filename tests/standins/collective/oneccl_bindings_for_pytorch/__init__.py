"""Stand-in for oneCCL's bindings (oneccl_bind_pt): importing it registers the `ccl` backend."""

import scenario

if scenario.conf().get("no_ccl"):
    raise ImportError("No module named 'oneccl_bindings_for_pytorch'")
__version__ = "2.7.0+xpu"
