"""Weight refit: trainer tensors into the live rollout engine, in place, verified.

    stats = refit_from_model(engine, hf_model, bucket_bytes=256 << 20, verify=False)

    with refit_session(engine, verify=True) as s:   # begin() on enter
        for bucket in buckets:
            s.load(bucket)                           # validated, then written in place
    # finish() on exit: inference layouts, then derived caches, then checks

See ``session.py`` for the protocol, ``names.py`` for name validation, ``bucket.py`` /
``shm.py`` for transports and ``verify.py`` for the checks.
"""
from hybridrl.refit.bucket import BucketPacker, TensorMeta, group_by_bytes, unpack
from hybridrl.refit.errors import RefitError
from hybridrl.refit.session import Refit, RefitStats, State, refit_session
from hybridrl.refit.transport import refit_from_model

__all__ = [
    "BucketPacker", "Refit", "RefitError", "RefitStats", "State", "TensorMeta",
    "group_by_bytes", "refit_from_model", "refit_session", "unpack",
]
