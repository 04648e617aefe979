"""Stand-in for intel-extension-for-pytorch: importing it gives an old torch its torch.xpu."""

import torch
from torch import _xpu

__version__ = "2.3.110+xpu"
torch.xpu = _xpu
