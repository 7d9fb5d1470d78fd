"""Discovery through real entry points, in-process registration, and backend selection."""

import pytest

import gdn2core
from gdn2_conformance import Case, ReferenceBackend, make_inputs, rel_err
from gdn2core import (
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
    assert infos["scan_baseline"].available and not infos["scan_baseline"].auto


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
    with pytest.raises(
        BackendNotFoundError, match="'broken_demo' cannot be used: broken: ModuleNotFoundError"
    ):
        get_backend("broken_demo")


def test_auto_picks_highest_priority_backend_that_supports_the_spec(toy_plugins):
    small = make_inputs(Case(dk=8, dv=8))
    assert which_backend(*small.args) == "toy_serial"
    large = make_inputs(Case(dk=16, dv=8))  # toy_serial refuses dk=16
    assert which_backend(*large.args) == "jax_ref"


def test_auto_never_picks_pallas_tpu_off_a_tpu():
    spec = OpSpec(1, 64, 1, 128, 128, "float32", 0.1)
    assert resolve_backend(spec, DEFAULT_CONFIG).name != "pallas_tpu"
    # ... but would pick it for a call that runs on a TPU (its declared platform)
    assert resolve_backend(spec, DEFAULT_CONFIG, platform="tpu").name == "pallas_tpu"


def test_info_tells_what_a_call_would_do_here():
    """On this CPU host pallas_tpu is not available for ordinary calls: the row says why and
    what would make a named call run; the same verdict refuses the call itself."""
    infos = {i.name: i for i in list_backends()}
    pallas = infos["pallas_tpu"]
    assert not pallas.available and not pallas.auto
    assert "runs on tpu, this call on cpu" in pallas.reason
    assert "KernelConfig(interpret=True)" in pallas.reason
    x = make_inputs(Case(dk=64, dv=64))
    with pytest.raises(BackendUnsupportedError, match="runs on tpu, this call on cpu"):
        gdn2_forward(*x.args, backend="pallas_tpu")
    assert infos["jax_ref"].available and infos["jax_ref"].auto


def test_environment_variable_selects_backend(monkeypatch, toy_plugins):
    x = make_inputs(Case(dk=8, dv=8))
    monkeypatch.setenv("GDN2_BACKEND", "scan_baseline")
    assert which_backend(*x.args) == "scan_baseline"
    # an explicit name wins over the environment
    assert which_backend(*x.args, backend="toy_serial") == "toy_serial"
    monkeypatch.setenv("GDN2_BACKEND", "nonexistent")
    with pytest.raises(
        BackendNotFoundError, match="^GDN2_BACKEND=nonexistent: .*'nonexistent' is not installed"
    ):
        gdn2_forward(*x.args)
    monkeypatch.setenv("GDN2_BACKEND", "toy_serial")
    big = make_inputs(Case(dk=16, dv=8))
    with pytest.raises(
        BackendUnsupportedError, match=r"'toy_serial' \(from GDN2_BACKEND=toy_serial\)"
    ):
        gdn2_forward(*big.args)


def test_named_backend_not_installed_lists_installed_and_pip_command():
    x = make_inputs(Case())
    with pytest.raises(BackendNotFoundError) as err:
        gdn2_forward(*x.args, backend="triton_gpu")
    msg = str(err.value)
    assert "'triton_gpu' is not installed" in msg
    assert "scan_baseline" in msg and "jax_ref" in msg
    assert (
        "'triton_gpu' is not one of gdn2's own backends: install the package that provides it"
        in msg
    )
    assert "pip install" not in msg  # no folder backends/triton_gpu to install from


def test_a_misspelt_backend_gets_the_closest_installed_name_and_no_pip_command():
    """``backend="jax-ref"`` offered ``pip install ...#subdirectory=backends/jax-ref``, a folder
    that does not exist; now: "did you mean 'jax_ref'?", and no pip command."""
    x = make_inputs(Case())
    for typo in ("jax-ref", "JAX_REF", "jaxref"):
        with pytest.raises(BackendNotFoundError) as err:
            gdn2_forward(*x.args, backend=typo)
        msg = str(err.value)
        assert f"gdn2 backend {typo!r} is not installed (installed: " in msg
        assert "did you mean 'jax_ref'?" in msg and "pip install" not in msg, msg


def test_install_hints_offer_pip_commands_for_gdn2s_own_folders_only():
    """A pip command names ``backends/NAME`` only for one of gdn2's own backends (the fixed list,
    which is the repository's backends/ folders); any other name gets "install the package"."""
    from pathlib import Path

    from gdn2core.install import OWN_BACKENDS, any_backend_hint, backend_hint, own_backend_command

    root = Path(__file__).resolve().parents[2]
    folders = {p.parent.name for p in (root / "backends").glob("*/pyproject.toml")}
    assert set(OWN_BACKENDS) == folders == FIRST_PARTY
    # an own backend that is not installed, asked for by its name or by a close one
    assert backend_hint("pallas_tpu", ["jax_ref"]).endswith(own_backend_command("pallas_tpu"))
    close = backend_hint("pallas-tpu", ["jax_ref"])
    assert close.startswith("did you mean 'pallas_tpu', one of gdn2's own backends? pip install")
    assert "#subdirectory=backends/pallas_tpu" in close and "backends/pallas-tpu" not in close
    # a close installed name wins over the own list; an unknown name gets no command
    assert backend_hint("pallas-tpu", ["jax_ref", "pallas_tpu"]).startswith(
        "did you mean 'pallas_tpu'? (else install the package that provides 'pallas-tpu')"
    )
    for other in ("nosuch", "triton_gpu", "my-kernels"):
        hint = backend_hint(other, ["jax_ref", "pallas_tpu", "scan_baseline"])
        assert "pip install" not in hint and "install the package that provides it" in hint
    nothing = any_backend_hint()
    assert own_backend_command("jax_ref") in nothing and "<name>" not in nothing
    with pytest.raises(ValueError, match=r"name: expected one of gdn2's own backends .* got 'x'"):
        own_backend_command("x")


def test_install_hint_matches_the_readme_command():
    """The hint for a missing first-party backend is the README's git command for it."""
    from pathlib import Path

    from gdn2core.install import backend_hint

    hint = backend_hint("jax_ref")
    command = hint.split(": ", 1)[1].split(";")[0]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert (
        command
        == 'pip install "gdn2-jax-ref @ git+https://github.com/<org>/gdn2.git#subdirectory=backends/jax_ref"'
    )
    assert command in readme


def test_named_backend_that_cannot_run_the_spec_raises_its_reason(toy_plugins):
    x = make_inputs(Case(dk=16, dv=8))
    with pytest.raises(
        BackendUnsupportedError, match=r"'toy_serial' cannot run this call: dk=16 not in \(4, 8\)"
    ):
        gdn2_forward(*x.args, backend="toy_serial")
    spec = OpSpec(64, 65536, 16, 256, 256, "float32", 0.1)
    with pytest.raises(BackendUnsupportedError, match="associative scan needs ~.* GiB"):
        resolve_backend(spec, DEFAULT_CONFIG, "scan_baseline")


def ForwardOnly():
    return ReferenceBackend(
        "forward_only_test", priority=5000, capabilities=Capabilities(trainable=False)
    )


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
    with pytest.raises(TypeError, match="expected a gdn2core.plugin.Backend instance"):
        register_backend(object())


def test_resolve_backend_is_exported():
    assert gdn2core.resolve_backend is resolve_backend
