"""`mok_inductor.functional` is `mok_inductor.integrations.megatron.functional` (the same module object): the name the
MoK functional ABI is called by."""

import sys

from .integrations.megatron import functional as _module

sys.modules[__name__] = _module
