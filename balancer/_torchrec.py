"""TorchRec on demand: the token path runs without it.

:class:`~balancer.batch.BaseBatch`, its padding helpers and the TorchRec
train pipeline need ``torchrec`` (and with it fbgemm-gpu); the token path
(:class:`~balancer.tokens.TokenBatch`, ``BatchShuffler``, ``BalancedLoader``,
``plan_dispatch``, ``plan_micro_batches``, the cost models on token batches)
does not. The modules both paths share ask here instead of importing TorchRec.

An object can be a ``BaseBatch`` only once :mod:`balancer.batch` has been
imported, so :func:`batch_types` looks in ``sys.modules`` and imports nothing:
``import balancer`` and a shuffle of token batches leave TorchRec unloaded
(~4 s less import time on a 2-core box) and work where it is not installed.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

__all__ = ["BATCH_TYPES", "INSTALL_HINT", "batch_types", "require"]

_BATCH_MODULE = "balancer.batch"

INSTALL_HINT = (
    "install balancer with its torchrec extra (pip install -e '.[torchrec]' in a checkout), or torchrec "
    "with the fbgemm-gpu wheel built for your torch; TokenBatch, BatchShuffler, BalancedLoader, "
    "plan_dispatch and plan_micro_batches run without it"
)


def _loaded_class(module: str, name: str) -> type[Any] | None:
    # getattr: a module still being imported may not define the class yet,
    # and then nothing can be an instance of it either.
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


# How messages name the batch types, whichever :func:`batch_types` returns now
# (it leaves BaseBatch out until balancer.batch is loaded).
BATCH_TYPES = "BaseBatch or a TokenBatch"


def batch_types() -> tuple[type[Any], ...]:
    """The batch types a shuffle takes, for ``isinstance``: ``TokenBatch``, and
    ``BaseBatch`` once :mod:`balancer.batch` is loaded (no instance exists before)."""
    from balancer.tokens import TokenBatch  # torch only

    base = _loaded_class(_BATCH_MODULE, "BaseBatch")
    return (TokenBatch,) if base is None else (base, TokenBatch)


def require(module: str, what: str) -> ModuleType:
    """``module`` (one that imports TorchRec), imported for ``what``.

    Raises:
        ImportError: TorchRec or fbgemm-gpu is not installed, or does not load
            against this torch (fbgemm-gpu's kernels then fail with an
            ``OSError``), naming ``what``, the failing import and how to install;
            the original error is its ``__cause__``.
    """
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as e:
        # A missing module stays a ModuleNotFoundError, as it was when import balancer raised it.
        error = ModuleNotFoundError if isinstance(e, ModuleNotFoundError) else ImportError
        raise error(f"{what} needs torchrec, which did not import ({type(e).__name__}: {e}): "
                    f"{INSTALL_HINT}") from e
