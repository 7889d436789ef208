"""The device mesh and the one table that maps logical axis names to mesh axes.

Every parameter of the model is annotated with logical axis names (`vocab`, `embed`,
`heads`, `kv`, `mlp`, `layers`, ...). Nothing else in lambjax names a mesh axis: the
shardings of parameters, optimizer state and batches are all derived here.

Mesh axes:
  data:   pure data parallelism (parameters replicated).
  fsdp:   data parallelism with parameters and optimizer state sharded (ZeRO-3 style).
  tensor: tensor (model) parallelism inside attention and MLP blocks.
  stage:  the encoder's layers split into consecutive stages, one per device along the axis:
          the stages of Ouroboros' model parallelism (lambjax.contrib.ouroboros); size 1
          otherwise.

The mesh follows the hardware (`make_mesh`): within a TPU slice the axes are laid on the
ICI torus by `jax.experimental.mesh_utils` (the axes that carry the most traffic, `tensor`
then `fsdp`, on the most links), and across slices, which only the slower DCN joins, go
the axes named in `dcn` ({axis: slices it spans}; e.g. {"data": 2}: data parallel across
two slices, every other axis within each).
"""

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("stage", "data", "fsdp", "tensor")

# Logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("layers", "stage"),
    ("position", None),
    ("token_type", None),
    ("classes", None),
    ("norm", None),
)
_RULES = dict(LOGICAL_AXIS_RULES)


def mesh_shape(mesh_shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Resolves a mesh shape ({axis: size}, one size may be -1) for `num_devices` devices."""
    unknown = set(mesh_shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh axes {sorted(unknown)} are unknown; valid axes: {MESH_AXES}")
    sizes = [int(mesh_shape.get(axis, 1)) for axis in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {dict(mesh_shape)}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh {dict(mesh_shape)}: sizes must be positive or -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(
                f"mesh {dict(mesh_shape)} does not fit {num_devices} devices: the fixed axes "
                f"multiply to {known}, which does not divide {num_devices}"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {int(np.prod(sizes))} "
            f"devices but {num_devices} are available"
        )
    return dict(zip(MESH_AXES, sizes, strict=True))


def slice_count(devices: Sequence[jax.Device]) -> int:
    """The TPU slices `devices` belong to (1 on other platforms: their hosts' links are
    not told apart)."""
    if devices[0].platform != "tpu":
        return 1
    return len({getattr(d, "slice_index", 0) for d in devices})


def mesh_layout(
    shape: Mapping[str, int], dcn: Mapping[str, int], num_devices: int, num_slices: int = 1
) -> tuple[dict[str, int], dict[str, int]]:
    """(each axis's size, the slices it spans) for a mesh `shape` (one size may be -1)
    whose axes in `dcn` ({axis: slices}) cross `num_slices` slices; raises ValueError
    naming the setting that does not fit."""
    sizes = mesh_shape(shape, num_devices)
    unknown = set(dcn) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh.dcn axes {sorted(unknown)} are unknown; valid axes: {MESH_AXES}")
    slices = {axis: int(dcn.get(axis, 1)) for axis in MESH_AXES}
    if any(count < 1 for count in slices.values()):
        raise ValueError(f"mesh.dcn {dict(dcn)}: sizes must be positive")
    spanned = int(np.prod(list(slices.values())))
    if spanned == 1 < num_slices:
        raise ValueError(
            f"the devices form {num_slices} TPU slices and mesh.dcn places no axis across "
            f"them; valid: mesh.dcn sizes that multiply to {num_slices} "
            f"(e.g. mesh.dcn.data={num_slices})"
        )
    if spanned != num_slices:
        across = {axis: count for axis, count in slices.items() if count > 1}
        raise ValueError(
            f"mesh.dcn {across} spans {spanned} slices but the devices form {num_slices}; "
            f"valid: mesh.dcn sizes that multiply to {num_slices}"
            + (" (all 1 on one slice)" if num_slices == 1 else "")
        )
    for axis, count in slices.items():
        if sizes[axis] % count:
            raise ValueError(
                f"mesh.dcn.{axis}={count} does not divide mesh {axis}={sizes[axis]}; valid: "
                f"a divisor of {sizes[axis]} (the {axis} axis's slices)"
            )
    return sizes, slices


def make_mesh(
    shape: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
    dcn: Mapping[str, int] | None = None,
) -> Mesh:
    """Builds a mesh with axes `MESH_AXES` (one size may be -1 to take the remaining
    devices) laid on the devices' topology (`device_grid`)."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(device_grid(shape, devices, dcn), MESH_AXES)


def device_grid(
    shape: Mapping[str, int], devices: Sequence[jax.Device], dcn: Mapping[str, int] | None = None
) -> np.ndarray:
    """`devices` in an array of the mesh's shape (axes `MESH_AXES`): each slice's share of
    every axis (size / slices) laid on its ICI torus, the `dcn` axes across slices
    (`mesh_layout`). On CPU the devices' order as given."""
    sizes, slices = mesh_layout(shape, dcn or {}, len(devices), slice_count(devices))
    within = [sizes[axis] // slices[axis] for axis in MESH_AXES]
    across = [slices[axis] for axis in MESH_AXES]
    if int(np.prod(across)) > 1:
        return mesh_utils.create_hybrid_device_mesh(
            within, across, devices, allow_split_physical_axes=True
        )
    return mesh_utils.create_device_mesh(within, devices, allow_split_physical_axes=True)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh):
    """Maps one array's logical axis names to a `PartitionSpec` on `mesh`.

    A dimension is left replicated when its size does not divide by the mesh axes it maps
    to (e.g. BERT's vocabulary of 30,522 on a tensor axis of 4), and a mesh axis is used at
    most once per array. `mesh` may be abstract (`jax.sharding.get_abstract_mesh()` inside a
    traced function); its manual axes (inside `shard_map`) are left out, the array being that
    axis's shard already.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set(mesh.manual_axes)
    spec = []
    for name, size in zip(logical_axes, shape, strict=True):
        if name is not None and name not in _RULES:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(_RULES)}")
        target = _RULES.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used)
        if axes and size % int(np.prod([mesh.shape[a] for a in axes])) == 0:
            used.update(axes)
            spec.append(axes[0] if len(axes) == 1 else axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def tree_shardings(abstract_tree, logical_axes_tree, mesh: Mesh):
    """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) given its logical axes.

    `logical_axes_tree` has the same structure with a `PartitionSpec` of logical names per
    leaf (what `flax.linen.get_partition_spec` returns); a `None` leaf means replicated.
    """

    def one(leaf, names):
        names = tuple(names) if names is not None else (None,) * len(leaf.shape)
        return NamedSharding(mesh, logical_to_spec(names, leaf.shape, mesh))

    return jax.tree.map(
        one, abstract_tree, logical_axes_tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are split along their leading axis over the data-parallel mesh axes."""
    return NamedSharding(mesh, PartitionSpec(_RULES["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
