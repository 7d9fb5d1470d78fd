"""Discovery through real entry points, in-process registration, and backend selection."""

import pytest

import gdn2core
from gdn2core import (
    Backend,
    BackendNotFoundError,
    BackendUnsupportedError,
    Capabilities,
    OpSpec,
    gdn2_forward,
    gdn2_forward_trainable,
    gdn2_token_serial_reference,
    get_backend,
    list_backends,
    register_backend,
    resolve_backend,
    unregister_backend,
    which_backend,
)
from gdn2core.config import DEFAULT_CONFIG
from tests.support.inputs import Case, make_inputs, rel_err
from tests.support.plugins import installed_plugins

FIRST_PARTY = {"jax_ref", "scan_baseline", "pallas_tpu"}


@pytest.fixture
def toy_plugins(tmp_path):
    with installed_plugins(tmp_path, "gdn2-toy-backend", "gdn2-broken-backend"):
        yield


@pytest.fixture(autouse=True)
def no_env_backend(monkeypatch):
    monkeypatch.delenv("GDN2_BACKEND", raising=False)


def test_first_party_backends_are_discovered_through_entry_points():
    infos = {i.name: i for i in list_backends()}
    assert FIRST_PARTY <= set(infos)
    for name in FIRST_PARTY:
        assert infos[name].version == "0.1.0"
        assert infos[name].source.startswith(f"entry point gdn2_{name}.plugin")
        assert not infos[name].broken
    assert infos["scan_baseline"].available


def test_importing_gdn2core_imports_no_backend():
    import subprocess
    import sys

    code = (
        "import sys, gdn2core; "
        "print(sorted(m for m in sys.modules if m.startswith(('gdn2_', 'flax', 'optax'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_third_party_distribution_is_discovered_and_selected_by_name(toy_plugins):
    infos = {i.name: i for i in list_backends()}
    toy = infos["toy_serial"]
    assert toy.available and toy.version == "0.3.1" and toy.priority == 1000
    assert "gdn2-toy-backend" in toy.source
    x = make_inputs(Case(dk=8, dv=5))
    o, h = gdn2_forward(*x.args, h0=x.h0, backend="toy_serial")
    o_ref, h_ref = gdn2_token_serial_reference(*x.args, h0=x.h0)
    assert rel_err(o, o_ref) == 0.0 and rel_err(h, h_ref) == 0.0


def test_broken_plugin_is_listed_and_isolated(toy_plugins):
    infos = {i.name: i for i in list_backends()}
    broken = infos["broken_demo"]
    assert broken.broken and not broken.available
    assert "ModuleNotFoundError" in broken.reason
    assert "gdn2_dependency_that_does_not_exist" in broken.reason
    assert list_backends()[-1].name == "broken_demo"  # broken ones sort last
    assert infos["toy_serial"].available and FIRST_PARTY <= set(infos)
    with pytest.raises(BackendNotFoundError, match="'broken_demo' failed to load: broken"):
        get_backend("broken_demo")


def test_auto_picks_highest_priority_backend_that_supports_the_spec(toy_plugins):
    small = make_inputs(Case(dk=8, dv=8))
    assert which_backend(*small.args) == "toy_serial"
    large = make_inputs(Case(dk=16, dv=8))  # toy_serial refuses dk=16
    assert which_backend(*large.args) == "jax_ref"


def test_auto_never_picks_pallas_tpu_off_a_tpu():
    spec = OpSpec(1, 64, 1, 128, 128, "float32", 0.1, False)
    assert resolve_backend(spec, DEFAULT_CONFIG).name != "pallas_tpu"
    assert not get_backend("pallas_tpu").auto_selectable()


def test_environment_variable_selects_backend(monkeypatch, toy_plugins):
    x = make_inputs(Case(dk=8, dv=8))
    monkeypatch.setenv("GDN2_BACKEND", "scan_baseline")
    assert which_backend(*x.args) == "scan_baseline"
    # an explicit name wins over the environment
    assert which_backend(*x.args, backend="toy_serial") == "toy_serial"
    monkeypatch.setenv("GDN2_BACKEND", "nonexistent")
    with pytest.raises(BackendNotFoundError, match="'nonexistent' is not installed"):
        gdn2_forward(*x.args)


def test_named_backend_not_installed_lists_installed_and_pip_command():
    x = make_inputs(Case())
    with pytest.raises(BackendNotFoundError) as err:
        gdn2_forward(*x.args, backend="triton_gpu")
    msg = str(err.value)
    assert "'triton_gpu' is not installed" in msg
    assert "scan_baseline" in msg and "jax_ref" in msg
    assert "install the package that provides the 'triton_gpu' gdn2 backend" in msg


def test_known_backend_missing_names_its_pip_command(monkeypatch):
    from gdn2core import registry

    real = registry._all
    monkeypatch.setattr(
        registry, "_all", lambda: {k: v for k, v in real().items() if k != "jax_ref"}
    )
    with pytest.raises(BackendNotFoundError, match="pip install gdn2-jax-ref"):
        get_backend("jax_ref")


def test_named_backend_that_cannot_run_the_spec_raises_its_reason(toy_plugins):
    x = make_inputs(Case(dk=16, dv=8))
    with pytest.raises(
        BackendUnsupportedError, match=r"'toy_serial' cannot run this call: dk=16 not in \(4, 8\)"
    ):
        gdn2_forward(*x.args, backend="toy_serial")
    spec = OpSpec(64, 65536, 16, 256, 256, "float32", 0.1, False)
    with pytest.raises(BackendUnsupportedError, match="associative scan needs ~.* GiB"):
        resolve_backend(spec, DEFAULT_CONFIG, "scan_baseline")


class ForwardOnly(Backend):
    name = "forward_only_test"
    priority = 5000
    capabilities = Capabilities(trainable=False)

    def forward(self, q, k, v, w, b, g, h0, *, spec, config):
        return gdn2_token_serial_reference(q, k, v, w, b, g, spec.scale, h0)


def test_register_backend_in_process():
    register_backend(ForwardOnly())
    try:
        assert "forward_only_test" in {i.name for i in list_backends()}
        with pytest.raises(ValueError, match="already registered"):
            register_backend(ForwardOnly())
        x = make_inputs(Case())
        assert which_backend(*x.args, trainable=False) == "forward_only_test"
        # gdn2_forward_trainable needs gradients: auto passes over it, a name refuses it
        assert which_backend(*x.args, trainable=True) != "forward_only_test"
        with pytest.raises(BackendUnsupportedError, match="forward-only"):
            gdn2_forward_trainable(*x.args, backend="forward_only_test")
    finally:
        unregister_backend("forward_only_test")
    assert "forward_only_test" not in {i.name for i in list_backends()}


def test_register_backend_rejects_non_backends():
    with pytest.raises(TypeError, match="expected a gdn2core.Backend instance"):
        register_backend(object())


def test_resolve_backend_is_exported():
    assert gdn2core.resolve_backend is resolve_backend
