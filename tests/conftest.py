import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a core test both without and under jax.jit (static kwargs via closure)."""
  if request.param:
    return lambda f, **static: jax.jit(lambda *a: f(*a, **static))
  return lambda f, **static: (lambda *a: f(*a, **static))
