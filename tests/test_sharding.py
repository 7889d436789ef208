import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lambjax import sharding


def test_make_mesh_fills_minus_one():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize(
    "shape, message",
    [
        ({"data": 3, "fsdp": -1}, "does not fit 8 devices"),
        ({"data": 2, "fsdp": 2}, "needs 4 devices but 8"),
        ({"data": -1, "fsdp": -1}, "at most one axis"),
        ({"pipeline": 2}, "unknown"),
    ],
)
def test_make_mesh_errors_name_the_shape(shape, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(shape)


def test_logical_to_spec_follows_rules_and_divisibility():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    assert sharding.logical_to_spec(("embed", "mlp"), (128, 512), mesh) == P("fsdp", "tensor")
    # 30,522 does not divide by 4: that dimension stays replicated.
    assert sharding.logical_to_spec(("vocab", "embed"), (30522, 128), mesh) == P(None, "fsdp")
    assert sharding.logical_to_spec(("layers", "embed"), (2, 128), mesh) == P(None, "fsdp")
    with pytest.raises(ValueError, match="no rule"):
        sharding.logical_to_spec(("nonsense",), (4,), mesh)


def test_batch_sharding_splits_over_data_and_fsdp():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    x = jax.device_put(np.zeros((16, 4)), sharding.batch_sharding(mesh))
    assert x.sharding.spec == P(("data", "fsdp"))
    assert len(x.addressable_shards) == 8
