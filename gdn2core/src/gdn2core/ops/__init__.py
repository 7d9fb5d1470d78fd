"""The ops, one package each: ``forward`` (the chunked operator) and ``decode`` (a few tokens
against a state pool). Each holds its ``spec`` (validation), its token-serial ``reference`` and
its public ``api``; :mod:`~gdn2core.ops.dispatch` runs a validated call on its backend.

The packages import nothing here, so that a spec or a reference can be imported without the api
above it (``docs/layout.md`` has the layers).
"""
