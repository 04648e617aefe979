"""Until cli/ lands: the names cli.py still reads here (see probes/runner, reconcile, baseline)."""

from xpuctl.probes.baseline import load_baseline, record_baseline  # noqa: F401
from xpuctl.probes.reconcile import attach  # noqa: F401
