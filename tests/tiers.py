"""The quick tier of `make test` (every backend and option once) and the rest (`make test-full`).

`tests/conftest.py` marks a test `full` when :func:`is_full` says so; `make test` deselects them,
`make test-full` runs only them, and `.ci/run` runs both. The rules, from measured durations
(`pytest --durations=0`, CPU here):

- a test function with several parametrizations keeps its first one that no other rule sends to
  the full tier;
- the conformance suite: jax_ref's second target (the default blocking), pallas_tpu's
  race-detection target (interpret mode on two simulated cores) and, for every other target,
  the checks that repeat a feature the quick tier already runs (gradients of the forget-gate
  cases, dg's own-size check, jit+vmap+grad, x64, features combined, no-leakage beyond jax_ref);
- the Pallas interpret-mode repeats of forget gates and x64 (jax_ref and scan_baseline keep them);
- the slow end-to-end files: the examples (but the minimal usage), multi-device, the deviceless
  compiles (but one train step for v5e), packaging, the simulated-device and TPU-estimate benches;
- the ragged op's repeats: the Pallas interpret-mode step (the quick tier compiles it for v5e and
  runs every path on jax_ref), a request split across two calls, the layer's jitted step.

The long sweeps (marker ``slow``, `make test-slow`; CI runs only their compile matrix) take,
besides the tests marked so in their files, those repeat checks on the two full targets
(:func:`is_slow`): a second target is there for its own configuration (the default blocking;
the race detector), which its other checks exercise, and the repeats took 511 s of CPU there
(`pytest --durations=0`, CPU here, 2026-12-06: 386 s on the race-detection target, 125 s on
jax_ref's second). Every kernel and feature path also runs under the race detector in
tests/pallas_tpu/test_races.py (CI).
"""

from __future__ import annotations

FULL_FILES = (
    "tests/multidevice/",
    "tests/packaging/",
    "tests/pallas_tpu/test_compile_features.py",
    "tests/tools/test_bench_devices.py",
)
#: Test functions of the full tier wherever they are: ``file::name`` or ``::name`` (any file).
FULL_FUNCTIONS = (
    "tests/examples/test_examples.py::test_train_mqar_packed_smoke",
    "tests/examples/test_examples.py::test_generate_prefill_and_decode_match_one_forward",
    "tests/examples/test_examples.py::test_train_gdn2_layer",
    "tests/examples/test_examples.py::test_train_mqar_two_devices",
    "tests/examples/test_serve_example.py::test_serve_matches_each_request_generated_alone",
    "tests/pallas_tpu/test_plan.py::test_vmem_byte_model_is_enough_for_the_compiler",
    "tests/pallas_tpu/test_compile.py::test_eight_heads_token_major_compile_in_place",
    "tests/pallas_tpu/test_gate_edges.py::test_bounded_gate_with_dt_bias_train_step_lowers_to_mosaic",
    "tests/pallas_tpu/test_decode_slots.py::test_dmas_executed_when_started_give_the_same",
    "tests/pallas_tpu/test_vmem_limits.py::test_largest_accepted_varlen_row_compiles",
    "tests/pallas_tpu/test_ragged_pallas.py::test_mixed_step_with_decodes_checkpoints_and_drafts_in_interpret_mode",
    "tests/core/test_ragged.py::test_a_request_split_across_two_calls_equals_one_call",
    "tests/layers/test_gdn2_layer_ragged.py::test_jitted_with_traced_metadata_equals_eager",
    "tests/pallas_tpu/test_vmem_limits.py::test_the_compiler_refuses_the_table_the_model_puts_at_the_whole_smem",
    "tests/tools/test_bench_decode.py::test_decode_bench_tpu_static_estimate",
    "tests/tools/test_reports.py::test_mesh_report_compiles_small_v5e_2x4",
    "tests/conformance/test_kit.py::test_wrong_backend_fails_naming_the_capability",
    "::test_forget_gates_gradients",
    "::test_dg_relative_to_its_own_size",
    "::test_jit_vmap_grad",
    "::test_x64_enabled_gradients",
    "::test_segments_with_gva_and_activations",
    "::test_varlen_with_gva_and_activations",
    "::test_float32_default_config",
    "tests/jax_ref/test_varlen.py::test_no_leakage_bit_for_bit",
)
#: Conformance targets of the full tier (the target name opens the parametrization id).
FULL_TARGETS = ("jax_ref-default", "pallas_tpu-races")
#: Checks the quick tier runs on one backend only.
ONE_BACKEND = {"test_segments_no_leakage": "jax_ref", "test_varlen_no_leakage": "jax_ref"}
#: Checks the quick tier runs on jax_ref and scan_baseline only (Pallas: the full tier).
PALLAS_ONLY = ("test_forget_gates", "test_x64_enabled")


def _parts(nodeid: str) -> tuple[str, str, str]:
    """``(path, function name, parametrization id)`` of a node id."""
    path, _, rest = nodeid.partition("::")
    name, _, params = rest.rpartition("::")[2].partition("[")
    return path, name, params


def _target(params: str) -> str:
    """The conformance target that opens a parametrization id."""
    return params.split("-B")[0].split("-N")[0].rstrip("]")


def _repeats_a_feature(name: str, params: str) -> bool:
    """A conformance check that repeats a feature the quick tier already runs on its target."""
    return (
        f"::{name}" in FULL_FUNCTIONS
        or name in ONE_BACKEND
        or (name in PALLAS_ONLY and "pallas" in params)
    )


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` goes to the long sweeps (module docstring): a check of a full
    target (FULL_TARGETS) that repeats a feature."""
    path, name, params = _parts(nodeid)
    if not path.endswith("test_conformance.py") or _target(params) not in FULL_TARGETS:
        return False
    return _repeats_a_feature(name, params)


def is_full(nodeid: str, first_of_function: bool) -> bool:
    """Whether the test ``nodeid`` belongs to the full tier.

    Args:
        nodeid: pytest's node id (``path::Class::name[params]``).
        first_of_function: whether no parametrization of its function is in the quick tier yet.

    Returns:
        True for the full tier, False for the quick tier.
    """
    path, name, params = _parts(nodeid)
    if path.startswith(FULL_FILES):
        return True
    if f"{path}::{name}" in FULL_FUNCTIONS or f"::{name}" in FULL_FUNCTIONS:
        return True
    if path.endswith("test_conformance.py") and name in PALLAS_ONLY and "pallas" in params:
        return True
    target = _target(params)
    if path.endswith("test_conformance.py"):
        if target in FULL_TARGETS:
            return True
        if name in ONE_BACKEND and not target.startswith(ONE_BACKEND[name]):
            return True
    return not first_of_function
