"""FBGEMM's TBE embedding kernels, which TorchRec's sharded embedding tables run on.

The fbgemm wheels (CPU and CUDA) have them. The slim offline bundle the GPU
runs use (``../shared/tools/gpu_bundle.sh``) drops them: there
``torch.ops.fbgemm.bounds_check_indices`` and the TBE lookups do not exist, and
a test that trains the example's sharded model cannot run. Such tests skip on a
CUDA host that lacks the kernels, with the reason; on a CPU host they fail as
usual, so a broken install never passes CI as a skip.
"""

from __future__ import annotations

import functools

import pytest
import torch


@functools.lru_cache(maxsize=1)
def tbe_missing() -> str | None:
    """Why FBGEMM's TBE kernels cannot run here, or None."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(8, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_SGD,
            pooling_mode=PoolingMode.NONE)
        tbe(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])).sum().backward()
        # TorchRec's sharded lookups check bounds first (missing in the bundle).
        torch.ops.fbgemm.bounds_check_indices  # noqa: B018 - raises AttributeError when missing
    except Exception as e:  # noqa: BLE001 - the reason goes into the skip message
        return f"{type(e).__name__}: {e}"
    return None


def skip_without_tbe(what: str) -> None:
    """Skip the calling test on a CUDA host whose FBGEMM lacks the TBE kernels."""
    reason = tbe_missing() if torch.cuda.is_available() else None
    if reason is not None:
        pytest.skip(f"FBGEMM's TBE embedding kernels are missing on this CUDA host, and {what} needs them "
                    f"({reason}); see docs/gpu.md")
