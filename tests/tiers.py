"""The quick tier of `make test` (every backend and option once) and the rest (`make test-full`).

`tests/conftest.py` marks a test `full` when :func:`is_full` says so; `make test` deselects them,
`make test-full` runs only them, and `.ci/run` runs both. The rules, from measured durations
(`pytest --durations=0`, CPU here):

- a test function with several parametrizations keeps its first one that no other rule sends to
  the full tier;
- the conformance suite: for every target, the checks that repeat a feature the quick tier
  already runs (gradients of the forget-gate cases, dg's own-size check, jit+vmap+grad, x64,
  features combined, no-leakage beyond jax_ref);
- the Pallas interpret-mode repeats of forget gates and x64 (jax_ref and scan_baseline keep them);
- the slow end-to-end files: the examples (but the minimal usage), multi-device, the deviceless
  compiles (but one train step for v5e), packaging, the simulated-device and TPU-estimate benches;
- the ragged op's repeats: the Pallas interpret-mode step (the quick tier compiles it for v5e and
  runs every path on jax_ref), a request split across two calls, the layer's jitted step.

The long sweeps (marker ``slow``, `make test-slow`; CI runs only part of their compile matrix) take,
besides the tests marked so in their files, the two second conformance targets whole
(:func:`is_slow`): jax_ref at its default blocking (the layer, the examples and the tools run
jax_ref at its defaults in CI) and pallas_tpu under the race detector on two simulated cores in
a random order, whose every kernel and feature path tests/pallas_tpu/test_races.py runs in CI,
checked against the token-serial reference. The two took 994 s of test time in `make test-full`
(`pytest --durations=0`, CPU here beside a TPU estimate, 2026-12-06: 695 s and 299 s of its
7,300 s), after their repeat checks had already gone to the long sweeps; CI had run out of its
90 minutes once and finished a later run with 3.5 of them to spare.
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
#: Conformance targets of the long sweeps (the target name opens the parametrization id).
SLOW_TARGETS = ("jax_ref-default", "pallas_tpu-races")
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


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` goes to the long sweeps (module docstring): a check of a
    conformance target in SLOW_TARGETS."""
    path, _, params = _parts(nodeid)
    return path.endswith("test_conformance.py") and _target(params) in SLOW_TARGETS


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
    one_backend = ONE_BACKEND.get(name) if path.endswith("test_conformance.py") else None
    if one_backend and not _target(params).startswith(one_backend):
        return True
    return not first_of_function
