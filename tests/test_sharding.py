import dataclasses
import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
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


# ----------------------------------------------------------------------------------------
# Meshes on the hardware's topology: fake TPU devices with the attributes JAX's mesh
# utilities read (as jax's tests/mesh_utils_test.py builds them)


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    id: int
    device_kind: str
    coords: tuple[int, int, int]
    slice_index: int
    process_index: int
    core_on_chip: int = 0  # one device per chip (v4 and v5p megacore, v5e)
    platform: str = "tpu"


def tpu_slices(kind: str, x: int, y: int, z: int, slices: int = 1) -> list[FakeTpu]:
    """The devices of `slices` TPU slices of x*y*z chips, in JAX's order (slice, then z, y,
    x; x fastest), four chips per host."""
    devices = []
    for index in range(slices):
        for cz, cy, cx in itertools.product(range(z), range(y), range(x)):
            n = len(devices)
            devices.append(FakeTpu(n, kind, (cx, cy, cz), index, n // 4))
    return devices


V4_32 = tpu_slices("TPU v4", 2, 2, 4)  # 16 chips, 32 TensorCores
V5P_128 = tpu_slices("TPU v5p", 4, 4, 4)  # 64 chips
TWO_V5E_256 = tpu_slices("TPU v5 lite", 16, 16, 1, slices=2)  # 2 x 256 chips


def runs_along(grid, axis: str) -> str:
    """The physical axes (x, y, z of the torus; 'slice' for DCN) that a step along the mesh
    axis `axis` moves on."""
    steps = np.moveaxis(grid, sharding.MESH_AXES.index(axis), -1)
    moved = set()
    for a, b in zip(steps[..., :-1].ravel(), steps[..., 1:].ravel(), strict=True):
        moved |= {"xyz"[d] for d in range(3) if a.coords[d] != b.coords[d]}
        moved |= {"slice"} if a.slice_index != b.slice_index else set()
    return "+".join(sorted(moved))


def layout(devices, shape, dcn=None) -> dict[str, tuple[int, str]]:
    """Each mesh axis of more than one device: (its size, the physical axes it runs along)."""
    grid = sharding.device_grid(shape, devices, dcn)
    return {
        axis: (size, runs_along(grid, axis))
        for axis, size in zip(sharding.MESH_AXES, grid.shape, strict=True)
        if size > 1
    }


def ids(grid):
    return np.vectorize(lambda d: d.id)(grid).reshape(-1).tolist()


@pytest.mark.parametrize(
    "shape, expected",
    [
        ({"data": -1}, {"data": (16, "x+y+z")}),
        ({"data": 4, "tensor": 4}, {"data": (4, "z"), "tensor": (4, "x+y")}),
        ({"fsdp": 8, "tensor": 2}, {"fsdp": (8, "y+z"), "tensor": (2, "x")}),
        (
            {"data": 2, "fsdp": 2, "tensor": 4},
            {"data": (2, "z"), "fsdp": (2, "z"), "tensor": (4, "x+y")},
        ),
    ],
)
def test_v4_32_meshes_follow_the_torus(shape, expected):
    assert layout(V4_32, shape) == expected


def test_v4_32_device_order():
    """Not jax.devices()'s order: tensor's four chips are a 2 x 2 plane of the torus."""
    grid = sharding.device_grid({"data": 4, "tensor": 4}, V4_32)
    assert ids(grid) == [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15]
    assert [d.coords for d in grid[0, :, 0, 0]] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]


@pytest.mark.parametrize(
    "shape, expected",
    [
        ({"fsdp": -1}, {"fsdp": (64, "x+y+z")}),
        ({"data": 4, "fsdp": 16}, {"data": (4, "z"), "fsdp": (16, "x+y")}),
        ({"fsdp": 16, "tensor": 4}, {"fsdp": (16, "y+z"), "tensor": (4, "x")}),
        (
            {"data": 2, "fsdp": 8, "tensor": 4},
            {"data": (2, "z"), "fsdp": (8, "y+z"), "tensor": (4, "x")},
        ),
    ],
)
def test_v5p_128_meshes_follow_the_torus(shape, expected):
    assert layout(V5P_128, shape) == expected


@pytest.mark.parametrize(
    "shape, expected",
    [
        ({"data": 2, "fsdp": -1}, {"data": (2, "slice"), "fsdp": (256, "x+y")}),
        ({"data": 32, "fsdp": 16}, {"data": (32, "slice+y"), "fsdp": (16, "x")}),
        (
            {"data": 2, "fsdp": 16, "tensor": 16},
            {"data": (2, "slice"), "fsdp": (16, "y"), "tensor": (16, "x")},
        ),
    ],
)
def test_two_v5e_256_slices_put_data_across_them(shape, expected):
    """mesh.dcn.data=2: the data axis crosses the two slices (DCN), all else stays on ICI."""
    assert layout(TWO_V5E_256, shape, dcn={"data": 2}) == expected
    grid = sharding.device_grid(shape, TWO_V5E_256, {"data": 2})
    data = sharding.MESH_AXES.index("data")
    halves = np.split(grid, 2, axis=data)  # the outer split of data is the slice
    assert [{d.slice_index for d in half.ravel()} for half in halves] == [{0}, {1}]


def test_cpu_devices_keep_their_order():
    grid = sharding.device_grid({"data": 2, "fsdp": 4}, jax.devices())
    assert [d.id for d in grid.ravel()] == [d.id for d in jax.devices()]


@pytest.mark.parametrize(
    "devices, shape, dcn, message",
    [
        (TWO_V5E_256, {"data": -1}, {}, "form 2 TPU slices and mesh.dcn places no axis across"),
        (
            TWO_V5E_256,
            {"data": 4, "fsdp": -1},
            {"data": 4},
            r"spans 4 slices but the devices form 2",
        ),
        (TWO_V5E_256, {"data": 3, "fsdp": -1}, {"data": 3}, "the fixed axes multiply to 3"),
        (TWO_V5E_256, {"fsdp": -1}, {"data": 2}, "mesh.dcn.data=2 does not divide mesh data=1"),
        (V4_32, {"data": -1}, {"data": 2}, r"spans 2 slices but the devices form 1; .* on one"),
        (V4_32, {"data": -1}, {"pipeline": 2}, "mesh.dcn axes \\['pipeline'\\] are unknown"),
    ],
)
def test_a_mesh_that_does_not_fit_the_slices_is_named(devices, shape, dcn, message):
    with pytest.raises(ValueError, match=message) as error:
        sharding.device_grid(shape, devices, dcn)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_checkpoint_restores_onto_a_two_slice_mesh(tmp_path):
    """Parameters saved from an FSDP mesh of 8, restored onto data 2 across two slices x
    fsdp 4 within each. CPU devices carry no slice index, so the two-slice device order is
    that of two fake v5e slices of 2 x 2 chips, given to the CPU devices of the same ids."""
    from lambjax.models.config import BertConfig
    from lambjax.models.params import init_params, param_logical_axes
    from lambjax.train import checkpointing

    fake_order = sharding.device_grid(
        {"data": 2, "fsdp": 4}, tpu_slices("TPU v5 lite", 2, 2, 1, slices=2), {"data": 2}
    )
    cpu = {d.id: d for d in jax.devices()}
    two_slices = Mesh(np.vectorize(lambda d: cpu[d.id])(fake_order), sharding.MESH_AXES)
    assert [d.id for d in two_slices.devices.ravel()] == [0, 1, 3, 2, 4, 5, 7, 6]

    config = BertConfig.preset("tiny", vocab_size=128, num_layers=1)
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))

    def on(mesh):
        shardings = sharding.tree_shardings(abstract, param_logical_axes(config), mesh)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
        )

    saved_on = on(sharding.make_mesh({"fsdp": 8}))
    state = jax.jit(
        lambda: init_params(config, jax.random.key(0)),
        out_shardings=jax.tree.map(lambda x: x.sharding, saved_on),
    )()
    ckpt = checkpointing.PhaseCheckpoints(str(tmp_path), "phase1", max_to_keep=1, async_save=False)
    ckpt.save(1, state, {"position": 1}, {"phase": "phase1"})
    restored = ckpt.restore_latest(on(two_slices)).state
    ckpt.close()
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    kernel = restored["encoder"]["layers"]["mlp"]["output"]["kernel"]
    assert kernel.sharding.mesh.devices.ravel().tolist() == two_slices.devices.ravel().tolist()
