"""Bucket packing: views without copies, fixed buffer, big tensors alone."""
import torch

from hybridrl.refit.bucket import BucketPacker, group_by_bytes, nbytes


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(10, 7, generator=g)), ("b", torch.randn(33, generator=g).bfloat16()),
            ("big", torch.randn(300, generator=g)), ("c", torch.randint(0, 9, (5,), generator=g)),
            ("d", torch.randn(3, 3, generator=g).double())]


def test_pack_unpack_roundtrip_views_into_one_buffer():
    packer = BucketPacker(512)
    buf = packer.buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    got = {}
    groups = 0
    for group in packer.pack(_tensors()):
        groups += 1
        for name, t in group:
            if name != "big":  # 1200 bytes > 512: goes alone, no copy
                assert lo <= t.data_ptr() < hi
            got[name] = t.clone()
    for name, t in _tensors():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert groups >= 3


def test_big_tensor_goes_alone_without_copy():
    big = torch.randn(1000)
    out = list(BucketPacker(256).pack_meta([("x", torch.ones(4)), ("big", big), ("y", torch.ones(4))]))
    assert [len(m) for _, m in out] == [1, 1, 1]
    assert out[1][0].data_ptr() == big.data_ptr()


def test_group_by_bytes_bounds_groups():
    ts = _tensors()
    for group in group_by_bytes(ts, 400):
        assert len(group) == 1 or sum(nbytes(t) for _, t in group) <= 400
    assert [n for g in group_by_bytes(ts, 400) for n, _ in g] == [n for n, _ in ts]
