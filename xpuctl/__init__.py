"""xpuctl: Intel XPU serving hygiene around vLLM."""

__version__ = "0.1.0"
