"""Everything Inductor-facing: the graph pass that swaps MoE blocks for `mok::moe`, the
`backend="mok"` compile backend and the cache keying. Imports `mok_inductor`, never the reverse at
import time (`mok_inductor.enable()` imports this package inside the function)."""
