"""Fault injection: third-party plugins that collide, call back into the registry, hand over
malformed backends, raise in their verdict methods, or claim other platforms. Each breaks at most
itself, with a short reason, and never the others."""

from __future__ import annotations

import logging
import threading

import pytest

from gdn2_conformance import Case, make_inputs
from gdn2core import (
    BackendNotFoundError,
    BackendUnsupportedError,
    gdn2_forward,
    get_backend,
    list_backends,
    which_backend,
)
from gdn2core.commands import info_main
from gdn2core.registry import Status
from tests.support.plugins import fake_distribution, on_path

HEADER = "from gdn2core.plugin import Capabilities, hookimpl\nfrom gdn2_conformance import ReferenceBackend\n"


def plugin_source(body: str, hook: str = "return Plugged()") -> str:
    """A plugin module: ``class Plugged(ReferenceBackend)`` with ``body``, and the hook."""
    return (
        f"{HEADER}\n\nclass Plugged(ReferenceBackend):\n{body}\n\n"
        f"@hookimpl\ndef gdn2_backend():\n    {hook}\n"
    )


@pytest.fixture(autouse=True)
def no_env_backend(monkeypatch):
    monkeypatch.delenv("GDN2_BACKEND", raising=False)


def one_backend(site, name: str, body: str) -> None:
    """A third-party distribution named after its one backend, ``class Plugged`` with ``body``."""
    module = f"fault_{name}"
    fake_distribution(site, name.replace("_", "-"), {module: plugin_source(body)}, {name: module})


def rows(name: str) -> list:
    return [i for i in list_backends() if i.name == name]


def short(text: str) -> bool:
    """A reason fit for a one-line message: no pluggy registry dump (module reprs), no traceback."""
    return len(text) < 400 and "<module" not in text and "\n" not in text


def test_third_party_plugin_cannot_take_a_first_party_name(tmp_path):
    src = plugin_source("    name = 'jax_ref'\n    priority = 5000")
    fake_distribution(tmp_path, "evil-jax-ref", {"fault_evil": src}, {"jax_ref": "fault_evil"})
    with on_path(tmp_path, prefixes=("fault_",)):
        (real, shadow) = sorted(rows("jax_ref"), key=lambda i: i.broken)
        assert real.status is Status.OK and real.distribution == "gdn2-jax-ref" and real.available
        assert shadow.status is Status.SHADOWED and shadow.distribution == "evil-jax-ref"
        assert "belongs to the first-party gdn2-jax-ref" in shadow.reason and short(shadow.reason)
        assert type(get_backend("jax_ref")).__name__ == "JaxRefBackend"
        x = make_inputs(Case())
        assert which_backend(*x.args) == "jax_ref"  # auto: not "no backend installed"


def test_two_third_party_plugins_with_one_name_conflict_and_spare_the_others(tmp_path):
    src = plugin_source("    name = 'dup'\n    priority = 1")
    fake_distribution(tmp_path, "dup-one", {"fault_one": src}, {"dup": "fault_one"})
    fake_distribution(tmp_path, "dup-two", {"fault_two": src}, {"dup": "fault_two"}, version="2.0")
    with on_path(tmp_path, prefixes=("fault_",)):
        found = rows("dup")
        assert [i.status for i in found] == [Status.CONFLICT, Status.CONFLICT]
        assert {i.distribution for i in found} == {"dup-one", "dup-two"}
        with pytest.raises(BackendNotFoundError, match=r"dup-one 1\.0, dup-two 2\.0") as err:
            get_backend("dup")
        assert short(str(err.value))
        assert get_backend("jax_ref").name == "jax_ref"


def test_reentrant_hook_does_not_deadlock(tmp_path):
    """A wrapper backend whose hook looks up another backend (and lists them all)."""
    src = (
        "import gdn2core\n" + plugin_source(
            "    name = 'wrapper'\n    priority = 1",
            hook="gdn2core.list_backends(); Plugged.inner = gdn2core.get_backend('jax_ref'); "
            "return Plugged()",
        )
    )  # fmt: skip
    fake_distribution(tmp_path, "wrapper", {"fault_wrapper": src}, {"wrapper": "fault_wrapper"})
    result = {}

    def discover():
        result["names"] = {i.name for i in list_backends()}
        result["inner"] = get_backend("wrapper").inner.name

    with on_path(tmp_path, prefixes=("fault_",)):
        worker = threading.Thread(target=discover, daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "discovery deadlocked"
    assert result["inner"] == "jax_ref" and {"wrapper", "jax_ref"} <= result["names"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("    name = 'bad'\n    priority = 'high'", "priority: expected an int, got str 'high'"),
        ("    name = 'bad'\n    priority = True", "priority: expected an int, got bool True"),
        (
            "    name = 'bad'\n    capabilities = {'dk': (8,)}",
            "capabilities: expected a gdn2core.plugin.Capabilities, got dict",
        ),
        ("    name = 'other'", "the entry point is 'bad' but the backend is named 'other'"),
        (
            "    name = 'bad'\n    capabilities = Capabilities(dk=[8], platforms=('tpu', 'npu'))",
            "ValidationError: dk: Input should be a valid tuple; platforms.1: Input should be",
        ),
        (
            "    name = 'bad'\n    shard_map_check_vma = 'yes'",
            "shard_map_check_vma: expected a bool",
        ),
    ],
)
def test_a_malformed_backend_is_broken_alone(tmp_path, body, reason, capsys):
    one_backend(tmp_path, "bad", body)
    with on_path(tmp_path, prefixes=("fault_",)):
        (bad,) = rows("bad")
        assert bad.status is Status.BROKEN and reason in bad.reason and short(bad.reason)
        assert info_main([]) == 0 and "bad" in capsys.readouterr().out
        x = make_inputs(Case())
        assert which_backend(*x.args) == "jax_ref"
        with pytest.raises(BackendNotFoundError, match="'bad' cannot be used: broken"):
            get_backend("bad")


def test_hook_returning_garbage_or_failing_validation_is_broken_alone(tmp_path):
    none_src = f"{HEADER}\n@hookimpl\ndef gdn2_backend():\n    return None\n"
    args_src = f"{HEADER}\n@hookimpl\ndef gdn2_backend(unexpected):\n    return None\n"
    fake_distribution(tmp_path, "nothing", {"fault_none": none_src}, {"nothing": "fault_none"})
    fake_distribution(tmp_path, "badargs", {"fault_args": args_src}, {"badargs": "fault_args"})
    with on_path(tmp_path, prefixes=("fault_",)):
        (nothing,) = rows("nothing")
        assert "expected a gdn2core.plugin.Backend instance, got NoneType" in nothing.reason
        (badargs,) = rows("badargs")
        assert badargs.status is Status.BROKEN and short(badargs.reason), badargs.reason
        assert "PluginValidationError" in badargs.reason
        assert get_backend("jax_ref").name == "jax_ref"


def test_raising_supports_declines_only_that_call(tmp_path, caplog):
    body = (
        "    name = 'flaky'\n    priority = 5000\n    capabilities = Capabilities()\n"
        "    def supports(self, spec, config):\n        raise RuntimeError('boom in supports')"
    )
    one_backend(tmp_path, "flaky", body)
    x = make_inputs(Case())
    with on_path(tmp_path, prefixes=("fault_",)):
        caplog.set_level(logging.WARNING, logger="gdn2core")
        assert which_backend(*x.args) == "jax_ref"  # auto passes over it
        assert "'flaky': supports() raised RuntimeError: boom in supports" in caplog.text
        with pytest.raises(BackendUnsupportedError, match="supports\\(\\) raised RuntimeError"):
            gdn2_forward(*x.args, backend="flaky")
        (flaky,) = rows("flaky")
        assert flaky.available  # it is fine for calls whose spec it does not choke on


def test_raising_availability_declines_and_is_listed(tmp_path, caplog):
    body = (
        "    name = 'gone'\n    priority = 5000\n    capabilities = Capabilities()\n"
        "    def availability(self):\n        raise OSError('driver missing')"
    )
    one_backend(tmp_path, "gone", body)
    with on_path(tmp_path, prefixes=("fault_",)):
        (gone,) = rows("gone")
        assert not gone.available and "availability() raised OSError: driver missing" in gone.reason
        x = make_inputs(Case())
        assert which_backend(*x.args) == "jax_ref"


def test_platforms_are_enforced(tmp_path):
    body = (
        "    name = 'gpu_only'\n    priority = 5000\n"
        "    capabilities = Capabilities(platforms=('gpu',))"
    )
    one_backend(tmp_path, "gpu_only", body)
    x = make_inputs(Case())
    with on_path(tmp_path, prefixes=("fault_",)):
        assert which_backend(*x.args) == "jax_ref"
        with pytest.raises(BackendUnsupportedError, match="runs on gpu, this call on cpu$"):
            gdn2_forward(*x.args, backend="gpu_only")
        (row,) = rows("gpu_only")
        assert not row.available and not row.auto and "runs on gpu" in row.auto_reason
