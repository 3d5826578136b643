"""`mok_inductor.runtime` is `mok_inductor.integrations.megatron.runtime` (the same module object): the name the
MoK Megatron bridge is called by."""

import sys

from .integrations.megatron import runtime as _module

sys.modules[__name__] = _module
