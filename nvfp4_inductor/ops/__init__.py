"""Every `nvfp4::` custom op with its fake kernel: the dense ops (dense.py), the grouped
mixture-of-experts ops (grouped.py) and the KV cache's (kv.py). Importing this package defines
them all; their Python entry points are re-exported here."""

from nvfp4_inductor.ops import dense, grouped, kv
from nvfp4_inductor.ops.dense import *  # noqa: F401,F403
from nvfp4_inductor.ops.grouped import *  # noqa: F401,F403
from nvfp4_inductor.ops.kv import *  # noqa: F401,F403

__all__ = [*dense.__all__, *grouped.__all__, *kv.__all__]
