"""`pip install lambjax` (no extras) into a fresh virtual environment gives the optimizers
and the model without the training stack; and importing them, where everything is
installed, loads none of that stack.

The install takes about 30 s on 2 cores (most wheels come from local disk, a few from the
package registry; a warm pip cache barely changes it)."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TRAINING_STACK = ["tensorflow", "tensorflow_datasets", "grain", "clu", "ml_collections"]

# What the bare package's user runs: eager init, then donated jitted LAMB and LANS steps
# on a tiny BERT, whose loss must fall. (tests/optim checks the numbers of such steps.)
USER_SCRIPT = textwrap.dedent(
    """
    import importlib.util
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import lambjax
    from lambjax import optim
    from lambjax.models import encoder
    from lambjax.models.config import BertConfig
    from lambjax.models.params import init_params

    assert "site-packages" in lambjax.__file__, lambjax.__file__
    installed = [m for m in TRAINING_STACK if importlib.util.find_spec(m) is not None]
    assert not installed, f"the bare install pulled in {installed}"
    assert "orbax" not in sys.modules, "importing lambjax loaded orbax (flax installs it)"

    config = BertConfig.preset("tiny", vocab_size=64, dtype="float32")
    rng = np.random.default_rng(0)
    input_ids = jnp.asarray(rng.integers(0, 64, (2, 16)), jnp.int32)
    segment_ids = jnp.zeros((2, 16), jnp.int32)
    input_mask = jnp.ones((2, 16), jnp.int32)

    def loss_fn(params):
        h = encoder.encode(config, params, input_ids, segment_ids, input_mask)
        return jnp.mean(jnp.square(h - 0.5))

    for tx in (
        optim.lamb(1e-2, weight_decay=0.01, weight_decay_mask=optim.bert_weight_decay_mask,
                   stacked_layers=optim.stacked_layers_mask, max_global_norm=1.0),
        optim.lans(1e-2, weight_decay=0.01, weight_decay_mask=optim.bert_weight_decay_mask,
                   stacked_layers=optim.stacked_layers_mask),
    ):
        def step(params, state):
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        params = init_params(config, jax.random.key(0))
        state = tx.init(params)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        losses = []
        for _ in range(3):
            donated = params
            params, state, loss = jitted(params, state)
            losses.append(float(loss))
            assert all(x.is_deleted() for x in jax.tree.leaves(donated))
        assert losses[2] < losses[1] < losses[0], losses
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    print("ok")
    """
)


def run(command, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.slow
def test_bare_install_runs_lamb_and_lans_on_bert_without_the_training_stack(tmp_path):
    # The sources as `pip install <repo>` reads them, copied so that the build (setuptools
    # writes build/ and *.egg-info next to setup.py) does not touch the checkout.
    source = tmp_path / "lambjax-src"
    source.mkdir()
    for name in ("setup.py", "README.md", "pyproject.toml"):
        shutil.copy(os.path.join(REPO, name), source)
    shutil.copytree(
        os.path.join(REPO, "lambjax"),
        source / "lambjax",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "--quiet", str(source)], cwd=tmp_path)
    script = f"TRAINING_STACK = {TRAINING_STACK!r}\n{USER_SCRIPT}"
    assert run([python, "-c", script], cwd=tmp_path).strip().endswith("ok")


def test_importing_the_optimizers_and_the_model_loads_no_training_stack(tmp_path):
    """In the full environment (TensorFlow and the rest installed): nothing imports them."""
    script = textwrap.dedent(
        """
        import sys

        import lambjax
        from lambjax import optim
        from lambjax.models import bert, config, encoder, params, pretraining

        stack = {"tensorflow", "tensorflow_datasets", "grain", "clu", "orbax", "ml_collections"}
        loaded = sorted({name.split(".")[0] for name in sys.modules} & stack)
        print(loaded)
        """
    )
    assert run([sys.executable, "-c", script], cwd=tmp_path).strip() == "[]"
